"""Autograd-aware collectives used inside model modules (the zoo's own attention kernels).

Kept here so that :mod:`mcore_zoo.distributed` stays the one package that issues collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class AllGatherRows(torch.autograd.Function):
    """``[n, ...]`` on each rank of ``group`` -> ``[size, n, ...]``; backward sums the gradient over
    the group and keeps this rank's rows (all-reduce: works on every backend, gloo included)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.new_empty((group.size(), *tensor.shape))
        dist.all_gather(list(out.unbind(0)), tensor, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()], None



def all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``[n, ...]`` on each rank of ``group`` -> ``[group size, n, ...]``, differentiable."""
    return AllGatherRows.apply(tensor, group)
