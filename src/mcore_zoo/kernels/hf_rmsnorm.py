"""RMSNorm in transformers' op order with fewer passes: the same forward bits, a fused backward.

transformers' ``LlamaRMSNorm`` (and the Mistral / Qwen2 / Qwen3 copies) computes, op by op::

    xf = x.to(float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    out = weight * y

Six kernels and four full-size temporaries forward (about 40 bytes of memory traffic per element
for bf16), and autograd's backward through each op. :func:`hf_rms_norm` gives the same output bit
for bit with three passes and no full-size temporary but the squares:

* the squares ``xf * xf`` in one Triton pass (what ``pow(2)`` computes: ``x * x``, exact in fp32),
  then **torch's own** ``mean(-1, keepdim=True)`` and ``rsqrt(variance + eps)`` on them - the
  reduction is transformers' (same input values, shape and layout), so the variance and its
  reciprocal root are the same bits;
* one Triton pass per row: ``(xf * r)`` rounded to ``x.dtype``, then ``weight * y`` as torch's
  mixed-dtype multiply computes it (both operands in fp32, one rounding to the promoted dtype).

The backward is one Triton pass over the rows (plus a sum of per-program partials for the weight
gradient): the gradient of the same function with the forward's roundings taken as identities (as
autograd takes them), accumulated in fp32 without the intermediate roundings autograd's op chain
adds. Its first step keeps autograd's rounding of ``grad * weight`` to the output dtype and then
to ``x.dtype``; the row sums are Triton's order, not torch's, so the gradients are not bitwise
autograd's (``tests/unit/test_hf_rmsnorm.py`` bounds their distance to a float64 gradient by
autograd's own).

Contract: ``x [..., hidden]`` contiguous (another layout takes transformers' ops as they are, and
autograd), float dtype; ``weight [hidden]``; CUDA tensors, or CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton is imported; the CPU tests use it). Output
``[..., hidden]`` of ``torch.promote_types(weight.dtype, x.dtype)``, as transformers' multiply.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .logprob_rows import available  # noqa: F401 - one answer for every Triton kernel of the package
from .triton_rows import block, cdiv, runs_on, tl_dtype, warps  # noqa: F401 - runs_on: where the kernels run

#: rows of the backward one program walks (its weight-gradient partial sums them)
ROWS_PER_PROGRAM = 64

@functools.lru_cache(maxsize=None)
def _kernels():  # type: ignore[no-untyped-def]
    from . import _hf_rmsnorm_triton as k

    return k.square_kernel, k.normalize_kernel, k.backward_kernel


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, r)``: the norm's output and each row's ``rsqrt(variance + eps)`` ``[rows]`` fp32."""
    square, normalize, _ = _kernels()
    n_cols = x.shape[-1]
    squares = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    square[(cdiv(n, 4096),)](x, squares, n, BLOCK=4096)
    r = torch.rsqrt(squares.mean(-1, keepdim=True) + eps)  # transformers' reduction and rsqrt
    del squares
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = n // n_cols if n_cols else 0
    if rows:
        width = block(n_cols)
        normalize[(rows,)](x, r, weight, out, n_cols, BLOCK=width, MID=tl_dtype(x.dtype), OUT=tl_dtype(out_dtype),
                           num_warps=warps(width))  # fmt: skip
    return out, r.reshape(rows)


class _HFRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        out, r = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        ctx.out_dtype = out.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, r = ctx.saved_tensors
        _, _, backward = _kernels()
        grad = grad.contiguous()
        n_cols = x.shape[-1]
        rows = x.numel() // n_cols if n_cols else 0
        dx = torch.empty_like(x)
        programs = max(1, cdiv(rows, ROWS_PER_PROGRAM))
        partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x.device)
        if rows:
            width = block(n_cols)
            backward[(programs,)](x, r, weight, grad, dx, partial, rows, n_cols, 1.0 / n_cols, ROWS=ROWS_PER_PROGRAM,
                                  BLOCK=width, MID=tl_dtype(x.dtype), OUT=tl_dtype(ctx.out_dtype), num_warps=warps(width))  # fmt: skip
        dw = partial.sum(0).to(weight.dtype)
        return dx, dw, None


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op (torch's kernels, autograd's backward):
    what :class:`~mcore_zoo.specs.norms.HFRMSNorm` computes and :func:`hf_rms_norm` reproduces."""
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` (module docstring): the same output bits; the fused backward
    where ``x`` is contiguous, :func:`transformers_rms_norm` otherwise."""
    if not x.is_contiguous() or x.numel() == 0:
        return transformers_rms_norm(x, weight, eps)
    return _HFRMSNorm.apply(x, weight.contiguous(), eps)
