"""The Triton kernels of :mod:`mcore_zoo.kernels.swiglu` (imported by it when first used: importing
this module imports Triton). Launch them with ``enable_fp_fusion=False`` and ``ACCURATE=True`` on a
GPU (``libdevice``'s ``expf``, CUDA's own; Triton's ``tl.exp`` on float32 is an approximation);
Triton's interpreter has no ``libdevice``: ``ACCURATE=False`` there (numpy's ``exp``)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._triton_rounding import rounded


@triton.jit
def exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def silu(x, ACCURATE: tl.constexpr):
    """``x / (1 + exp(-x))`` with ``expf`` and an IEEE division, as torch's CUDA ``silu``."""
    return tl.math.div_rn(x, 1.0 + exp(-x, ACCURATE))


@triton.jit
def sigmoid(x, ACCURATE: tl.constexpr):
    """``1 / (1 + exp(-x))`` as torch's CUDA ``silu_backward`` computes it."""
    return tl.math.div_rn(1.0 + 0.0 * x, 1.0 + exp(-x, ACCURATE))


@triton.jit
def swiglu_forward_kernel(x_ptr, out_ptr, ffn, offset, BLOCK: tl.constexpr, DT: tl.constexpr, ACCURATE: tl.constexpr):
    """Row ``row`` of ``x [rows, 2 * ffn]`` (``[gate, up]``): ``silu(gate) * (up + offset)``, each
    op rounded to ``DT`` as torch's ``silu``, ``add`` and ``mul`` round."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < ffn
    g = tl.load(x_ptr + row * 2 * ffn + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * ffn + ffn + col, mask=m, other=0.0).to(tl.float32)
    act = rounded(silu(g, ACCURATE), DT)
    lin = rounded(u + offset, DT)
    tl.store(out_ptr + row * ffn + col, rounded(act * lin, DT).to(DT), mask=m)


@triton.jit
def swiglu_backward_kernel(x_ptr, g_ptr, dx_ptr, ffn, offset, BLOCK: tl.constexpr, DT: tl.constexpr,
                           ACCURATE: tl.constexpr):  # fmt: skip
    """What autograd computes through the forward's ops: ``d up = grad * silu(gate)``, ``d gate =
    silu_backward(grad * (up + offset), gate)`` (torch's ``dy * s * (1 + x * (1 - s))``), each rounded
    to ``DT``."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < ffn
    g = tl.load(x_ptr + row * 2 * ffn + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * ffn + ffn + col, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(g_ptr + row * ffn + col, mask=m, other=0.0).to(tl.float32)
    act = rounded(silu(g, ACCURATE), DT)
    lin = rounded(u + offset, DT)
    d_act = rounded(dy * lin, DT)
    d_up = rounded(dy * act, DT)
    s = sigmoid(g, ACCURATE)
    # nvcc contracts torch's ``1 + x * (1 - s)`` into one fused multiply-add (its default -fmad=true)
    d_gate = rounded(d_act * s * tl.fma(g, 1.0 - s, 1.0), DT)
    tl.store(dx_ptr + row * 2 * ffn + col, d_gate.to(DT), mask=m)
    tl.store(dx_ptr + row * 2 * ffn + ffn + col, d_up.to(DT), mask=m)
