"""Megatron-Core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``, non-interleaved) in one
pass, forward and backward, with its roundings: the same output and gradient bits.

Megatron-Core (and transformers, whose ``apply_rotary_pos_emb`` it matches op for op) computes::

    cos_, sin_ = (cos(freqs) * mscale).to(t.dtype), (sin(freqs) * mscale).to(t.dtype)
    out = cat(t[..., :rot] * cos_ + rotate_half(t[..., :rot]) * sin_, t[..., rot:])

with ``rotate_half(x) = cat(-x2, x1)``: about eight kernels and as many temporaries forward, more
backward. :func:`rope` keeps ``cos_`` / ``sin_`` as torch computes them (small: one row per
position) and does the rest in one Triton pass over the rows, each product and the sum rounded to
``t.dtype`` as torch rounds them (round to nearest even; a float32 ``a * c + b * s`` is not
contracted into an FMA); its backward is one pass too: ``g * cos_`` plus ``rotate_half``'s
transpose of ``g * sin_``, each rounded, summed and rounded - what autograd computes through those
ops.

Contract: ``t [s, b, h, d]`` (any strides with a unit last stride) of float32 / bfloat16 / float16;
``freqs [s, 1, 1, rot]`` with ``rot`` even and ``<= d``; CUDA tensors, or CPU tensors under
Triton's interpreter. Output ``[s, b, h, d]`` contiguous, ``t``'s dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .logprob_rows import available  # noqa: F401
from .triton_rows import block, runs_on, tl_dtype, warps  # noqa: F401 - runs_on: the dispatch's device check


@functools.lru_cache(maxsize=None)
def _kernel():  # type: ignore[no-untyped-def]
    from . import _rope_triton as k

    return k.rope_kernel


def _blocks(half: int, dim: int) -> tuple[int, int]:
    """Elements a program loads for each rotary half, and for the tail past them (0: none)."""
    rest = dim - 2 * half
    return block(half), (block(rest) if rest else 0)


def takes(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether :func:`rope` takes these arguments (the module docstring's contract, device aside)."""
    return (
        t.dim() == 4 and freqs.dim() == 4 and t.stride(-1) == 1 and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and freqs.shape[0] == t.shape[0] and freqs.shape[1] == 1 and freqs.shape[2] == 1
        and freqs.shape[-1] % 2 == 0 and 0 < freqs.shape[-1] <= t.shape[-1]
    )  # fmt: skip


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        kernel = _kernel()
        s, b, h, d = t.shape
        half = cos.shape[-1] // 2
        out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
        width, rest = _blocks(half, d)
        if out.numel():
            kernel[(s * b * h,)](t, cos, sin, out, h, b, t.stride(0), t.stride(1), t.stride(2), d, HALF=half, BLOCK=width,
                                 PASS_BLOCK=rest, DT=tl_dtype(t.dtype), BACKWARD=False, enable_fp_fusion=False,
                                 num_warps=warps(2 * width))  # fmt: skip
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        kernel = _kernel()
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        s, b, h, d = grad.shape
        half = cos.shape[-1] // 2
        dt = torch.empty_like(grad)
        width, rest = _blocks(half, d)
        if dt.numel():
            kernel[(s * b * h,)](grad, cos, sin, dt, h, b, b * h * d, h * d, d, d, HALF=half, BLOCK=width, PASS_BLOCK=rest,
                                 DT=tl_dtype(grad.dtype), BACKWARD=True, enable_fp_fusion=False, num_warps=warps(2 * width))  # fmt: skip
        return dt, None, None


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """``_apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)`` (non-interleaved), in one pass each
    way (module docstring; :func:`takes` says which arguments)."""
    cos = (torch.cos(freqs) * mscale).to(t.dtype).reshape(freqs.shape[0], freqs.shape[-1]).contiguous()
    sin = (torch.sin(freqs) * mscale).to(t.dtype).reshape(freqs.shape[0], freqs.shape[-1]).contiguous()
    return _Rope.apply(t, cos, sin)
