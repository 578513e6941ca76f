"""Megatron-Core's unfused SwiGLU (``MLP.forward`` without bias-activation fusion) in one pass each
way, with torch's roundings.

Megatron-Core computes, on ``linear_fc1``'s output ``x = [gate, up]``::

    gate, up = torch.chunk(x, 2, dim=-1)
    out = F.silu(gate) * (up + config.glu_linear_offset)

three kernels and two temporaries forward, more backward. :func:`swiglu` reads ``x`` once and
writes ``out`` once: ``silu`` as torch's CUDA kernel computes it (``x / (1 + expf(-x))`` in fp32:
the accurate ``expf`` and an IEEE division, not Triton's fast ones), the offset added and the
product taken, each rounded to ``x.dtype``; its backward reads ``x`` and the gradient once and
writes ``dx`` once, as autograd's chain rounds (``silu_backward``: ``dy * s * (1 + x * (1 - s))``,
whose ``1 + x * (1 - s)`` nvcc compiles into one fused multiply-add: the kernel takes ``fma`` there
and contracts nothing else). Output and gradients bitwise equal to torch's on an H100 (float32,
bfloat16, float16: ``tests/gpu/test_swiglu_kernel_gpu.py``, 2026-11-27; without that ``fma`` the
float16 / float32 gradients differed); Triton's CPU interpreter takes numpy's ``exp`` (and computes
``fma`` as two roundings), so the CPU test bounds the difference to one unit in the last place instead.

Contract: ``x [..., 2 * ffn]`` contiguous, float32 / bfloat16 / float16; CUDA tensors, or CPU tensors
under Triton's interpreter. Output ``[..., ffn]``, ``x``'s dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .logprob_rows import available  # noqa: F401
from .triton_rows import cdiv, tl_dtype, warps

#: columns of a row one program takes
BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernels():  # type: ignore[no-untyped-def]
    from . import _swiglu_triton as k

    return k.swiglu_forward_kernel, k.swiglu_backward_kernel


def _accurate(x: torch.Tensor) -> bool:
    """``libdevice``'s ``expf`` (compiled kernels) or numpy's (Triton's interpreter, which has no libdevice)."""
    return x.is_cuda


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offset: float) -> torch.Tensor:  # type: ignore[override]
        forward, _ = _kernels()
        ffn = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        out = torch.empty(*x.shape[:-1], ffn, dtype=x.dtype, device=x.device)
        if out.numel():
            forward[(rows, cdiv(ffn, BLOCK))](x, out, ffn, float(offset), BLOCK=BLOCK, DT=tl_dtype(x.dtype),
                                              ACCURATE=_accurate(x), enable_fp_fusion=False, num_warps=warps(BLOCK))  # fmt: skip
        ctx.save_for_backward(x)
        ctx.offset = float(offset)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _, backward = _kernels()
        (x,) = ctx.saved_tensors
        grad = grad.contiguous()
        ffn = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        dx = torch.empty_like(x)
        if dx.numel():
            backward[(rows, cdiv(ffn, BLOCK))](x, grad, dx, ffn, ctx.offset, BLOCK=BLOCK, DT=tl_dtype(x.dtype),
                                               ACCURATE=_accurate(x), enable_fp_fusion=False, num_warps=warps(BLOCK))  # fmt: skip
        return dx, None


def swiglu(x: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``F.silu(gate) * (up + offset)`` of ``x = [gate, up]`` (module docstring)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu takes [..., 2 * ffn], got {tuple(x.shape)}")
    return _SwiGLU.apply(x.contiguous(), offset)
