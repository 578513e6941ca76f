"""The Triton kernels of :mod:`mcore_zoo.kernels.hf_rmsnorm` (imported by it when first used:
importing this module imports Triton)."""

import triton
import triton.language as tl

from ._triton_rounding import rounded


@triton.jit
def square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, x * x, mask=mask)


@triton.jit
def normalize_kernel(x_ptr, r_ptr, w_ptr, out_ptr, n_cols,
                     BLOCK: tl.constexpr, MID: tl.constexpr, OUT: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row)
    y = rounded(x * r, MID)  # transformers' cast back to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = rounded(w * y, OUT)  # weight * y: fp32 product, one rounding
    tl.store(out_ptr + row * n_cols + cols, out.to(OUT), mask=mask)  # (exact: already rounded)


@triton.jit
def backward_kernel(x_ptr, r_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, n_rows, n_cols, inv_n,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, MID: tl.constexpr, OUT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid * ROWS
    for i in range(0, ROWS):
        row = first + i
        live = mask & (row < n_rows)
        at = row.to(tl.int64) * n_cols + cols
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row, mask=row < n_rows, other=0.0)
        g = tl.load(g_ptr + at, mask=live, other=0.0).to(tl.float32)
        y = rounded(x * r, MID)  # the forward's y, recomputed
        dw += rounded(g * y, OUT)  # autograd: grad * y in the output dtype, then summed
        gy = rounded(rounded(g * w, OUT), MID)  # autograd: grad * weight, cast to y's dtype
        s = tl.sum(gy * x, axis=0)  # d loss / d r
        dx = gy * r - (s * r * r * r * inv_n) * x  # through x * r, rsqrt and the mean of squares
        tl.store(dx_ptr + at, rounded(dx, MID).to(MID), mask=live)
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
