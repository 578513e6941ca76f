"""Checks of :func:`mcore_zoo.kernels.hf_rmsnorm.hf_rms_norm` against transformers' op order, shared by
the CPU test (Triton's interpreter) and the GPU test."""

from __future__ import annotations

import torch

from ..kernels.hf_rmsnorm import hf_rms_norm, transformers_rms_norm


def check_hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, grad_seed: int = 0) -> dict[str, float]:
    """Assert that ``hf_rms_norm`` gives transformers' output bit for bit and gradients (``x`` and
    ``weight``) within 1.5x autograd's distance to a float64 gradient (plus 1e-6 of its largest
    entry); returns each gradient's ratio of the two distances."""
    ours, theirs = hf_rms_norm(x, weight, eps), transformers_rms_norm(x, weight, eps)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (x.dtype, weight.dtype, tuple(x.shape))
    gen = torch.Generator(device=x.device).manual_seed(grad_seed)
    g = torch.randn(ours.shape, generator=gen, device=x.device).to(ours.dtype)
    xa, wa = x.clone().requires_grad_(), weight.clone().requires_grad_()
    hf_rms_norm(xa, wa, eps).backward(g)
    xb, wb = x.clone().requires_grad_(), weight.clone().requires_grad_()
    transformers_rms_norm(xb, wb, eps).backward(g)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    (w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))).backward(g.double())
    ratios = {}
    for name, a, b, truth in (("dx", xa.grad, xb.grad, x64.grad), ("dw", wa.grad, wb.grad, w64.grad)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        ours_err = (a.double() - truth).abs().max().item()
        autograd_err = (b.double() - truth).abs().max().item()
        assert ours_err <= 1.5 * autograd_err + 1e-6 * truth.abs().max().item(), (name, x.dtype, ours_err, autograd_err)
        ratios[name] = ours_err / max(autograd_err, 1e-30)
    return ratios
