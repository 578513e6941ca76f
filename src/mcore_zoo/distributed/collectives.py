"""Autograd-aware collectives used inside model modules (the zoo's own attention kernels, the
``vllm-exact`` row-parallel sum in NCCL's tree order), and a vote that keeps a per-rank decision
the same on every rank of a group.

Kept here so that :mod:`mcore_zoo.distributed` stays the one package that issues collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..placement import group_rank, group_size, process_rank


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
        return grad[group_rank(ctx.group)], None



def all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``[n, ...]`` on each rank of ``group`` -> ``[group size, n, ...]``, differentiable."""
    return AllGatherRows.apply(tensor, group)


def chain_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum ``partials`` (``[n, ...]``) over dim 0 as NCCL's tree all-reduce adds them on one node:
    the ranks form a chain ``0 -> 1 -> ... -> n-1`` rooted at 0; the last rank sends its partial
    up, each rank adds what it receives to its own and sends the sum on, and the root's sum is the
    result::

        p[0] + (p[1] + (... + (p[n-2] + p[n-1])))

    Each addition rounds to the partials' dtype (NCCL reduces in the buffer's dtype on every hop).
    For two partials this is ``p[0] + p[1]``, which every order gives; from three on, the
    association decides the last bits."""
    total = partials[-1]
    for part in reversed(partials[:-1].unbind(0)):
        total = part + total
    return total


class ChainAllReduce(torch.autograd.Function):
    """All-reduce of ``tensor`` over ``group`` in NCCL's tree order (:func:`chain_sum` of the
    partials all-gathered in group-rank order): every rank gets the same bits whatever algorithm,
    protocol and channel count the communicator would have picked for an all-reduce. The backward
    passes the gradient through unchanged, as Megatron-Core's
    ``reduce_from_tensor_model_parallel_region``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = tensor.contiguous()
        gathered = tensor.new_empty((group_size(group), *tensor.shape))
        dist.all_gather(list(gathered.unbind(0)), tensor, group=group)
        return chain_sum(gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def chain_all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group``, added in NCCL's tree order
    (:class:`ChainAllReduce`), differentiable. A group of one returns ``tensor``."""
    if group is None or group_size(group) == 1:
        return tensor
    return ChainAllReduce.apply(tensor, group)


def tree_order_all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``group`` with the bits of NCCL's tree all-reduce on
    one node (``p0 + (p1 + (... + p[n-1]))``, rounding on each hop), differentiable with
    Megatron-Core's ``reduce_from_tensor_model_parallel_region`` backward (the gradient passes
    unchanged). Two ranks: Megatron-Core's all-reduce (two partials add the same in any order);
    from three on: :func:`chain_all_reduce`. A group of one returns ``tensor``."""
    size = 1 if group is None else group_size(group)
    if size == 1:
        return tensor
    if size == 2:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(tensor, group=group)
    return ChainAllReduce.apply(tensor, group)


def all_true(flags: list[bool], group: Any) -> list[bool]:
    """Element-wise AND of ``flags`` over the ranks of ``group`` (every rank passes a list of the
    same length; each gets the same answer). A decision that must be the same on every rank - which
    collectives a refit issues - is made with it. NCCL groups reduce on the current CUDA device."""
    if group is None or group_size(group) == 1 or not flags:
        return list(flags)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    votes = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in votes.tolist()]


def broadcast_text(text: str, src: int, group: Any = None) -> str:
    """``text`` of global rank ``src`` on every rank of ``group`` (default: the world), as bytes in
    tensors - no pickle. A per-rank argument whose value decides which collectives follow (the
    refit's engine format and TP, known only where the engine is) is shared with it. NCCL groups
    broadcast on the current CUDA device."""
    if not dist.is_available() or not dist.is_initialized() or group_size(group) == 1:
        return text
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    rank = process_rank()
    data = text.encode("utf-8") if rank == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if rank == src and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.cpu().tolist()).decode("utf-8")
