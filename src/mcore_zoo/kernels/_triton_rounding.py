"""Rounding helper shared by the Triton row kernels (``_hf_rmsnorm_triton``, ``_rope_triton``,
``_swiglu_triton``): importing this module imports Triton."""

import triton
import triton.language as tl


@triton.jit
def rounded(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to ``DT`` (round to nearest, ties to even), as fp32: bfloat16 by its
    bits (Triton's interpreter truncates a bfloat16 cast; the GPU's cast rounds the same as
    this), float16 by a cast, float32 as it is."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
