"""The Triton kernels of :mod:`mcore_zoo.kernels.rope` (imported by it when first used: importing
this module imports Triton). Launch them with ``enable_fp_fusion=False``: a float32 ``a * c + b * s``
contracted into one FMA would round once where torch rounds twice."""

import triton
import triton.language as tl

from ._triton_rounding import rounded


@triton.jit
def cos_sin(cos_ptr, sin_ptr, s, j, m, HALF: tl.constexpr):
    """Position ``s``'s cos and sin rows (``[positions, 2 * HALF]``), each as its two halves, fp32."""
    at = s * 2 * HALF + j
    c1 = tl.load(cos_ptr + at, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + at + HALF, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + at, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + at + HALF, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def rope_kernel(src_ptr, cos_ptr, sin_ptr, out_ptr, heads, batch, s_stride, b_stride, h_stride, dim,
                HALF: tl.constexpr, BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, DT: tl.constexpr,
                BACKWARD: tl.constexpr):  # fmt: skip
    """One (position, batch, head) row of ``src`` (strided; ``out`` contiguous ``[rows, dim]``).
    Forward: ``t * cos + rotate_half(t) * sin``, each product and the sum rounded to ``DT`` as
    torch's ops round them. Backward (``src`` the output's gradient ``g``): what autograd computes
    through those ops - ``g * cos`` plus ``rotate_half``'s transpose of ``g * sin``
    (``rotate_half(t) = cat(-t2, t1)``: ``t1`` receives ``(g * sin)[HALF:]``, ``t2`` receives
    ``-(g * sin)[:HALF]``), each rounded, summed and rounded. Both: the tail past ``2 * HALF``
    as it is."""
    row = tl.program_id(0).to(tl.int64)
    h = row % heads
    b = (row // heads) % batch
    s = row // (heads * batch)
    src = src_ptr + s * s_stride + b * b_stride + h * h_stride
    dst = out_ptr + row * dim
    j = tl.arange(0, BLOCK)
    m = j < HALF
    a1 = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
    a2 = tl.load(src + HALF + j, mask=m, other=0.0).to(tl.float32)
    c1, c2, s1, s2 = cos_sin(cos_ptr, sin_ptr, s, j, m, HALF)
    if BACKWARD:
        p1 = rounded(a2 * s2, DT)
        p2 = -rounded(a1 * s1, DT)
    else:
        p1 = rounded(-a2 * s1, DT)
        p2 = rounded(a1 * s2, DT)
    o1 = rounded(rounded(a1 * c1, DT) + p1, DT)
    o2 = rounded(rounded(a2 * c2, DT) + p2, DT)
    tl.store(dst + j, o1.to(DT), mask=m)
    tl.store(dst + HALF + j, o2.to(DT), mask=m)
    if PASS_BLOCK > 0:  # the tail past the rotary part, as it is
        k = tl.arange(0, PASS_BLOCK)
        mp = 2 * HALF + k < dim
        tl.store(dst + 2 * HALF + k, tl.load(src + 2 * HALF + k, mask=mp, other=0.0), mask=mp)
