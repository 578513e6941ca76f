"""Refit of MoE experts into an inference engine's fused expert layout (vLLM ``FusedMoE``).

vLLM holds each MoE layer's experts as two stacked parameters per rank:

* ``...mlp.experts.w13_weight`` ``[local experts, 2 * I / tp, H]``: per expert, this TP rank's rows
  of the gate projection, then its rows of the up projection;
* ``...mlp.experts.w2_weight`` ``[local experts, H, I / tp]``: this TP rank's columns of the down
  projection.

With expert parallelism an engine rank owns the contiguous experts ``[ep_rank * E / ep, ...)``
(vLLM's default linear placement) and experts are not split over TP inside an EP group (pass
``tp=1``). :func:`iter_fused_experts` gathers the model's experts over EP / expert-TP / PP (through
:func:`mcore_zoo.iter_hf_weights`, so every rank of the job must iterate to the end) and yields,
layer by layer, the fused tensors of one engine rank; every other HF tensor is passed through
under its HF name. Memory: one MoE layer's experts at a time.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional, Sequence, Union

import torch

from ..errors import LayoutError
from ..handle import handle_of
from .export import iter_hf_weights

_EXPERT = re.compile(r"^(?P<prefix>.*\.)experts\.(?P<e>\d+)\.(?P<which>\w+)\.weight$")

#: HF per-expert projection names -> ("gate" | "up" | "down") for the supported families
PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def iter_fused_experts(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    *,
    tp: int = 1,
    ep: int = 1,
    tp_rank: int = 0,
    ep_rank: int = 0,
    dtype: Optional[torch.dtype] = None,
    ranks: Optional[Sequence[int]] = None,
    bucket_size: Union[int, str] = "512MB",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for engine rank ``(ep_rank, tp_rank)`` of an engine at ``tp`` x ``ep``:
    ``<layer>.mlp.experts.w13_weight`` / ``w2_weight`` for MoE layers (module docstring), other
    tensors as :func:`mcore_zoo.iter_hf_weights` yields them (whole; split them for the engine's
    dense TP with :func:`mcore_zoo.iter_hf_shards`)."""
    moe = handle_of(model).arch_config.moe
    if moe is None:
        raise LayoutError("iter_fused_experts needs an MoE model")
    if moe.num_experts % ep or not 0 <= ep_rank < ep or not 0 <= tp_rank < tp:
        raise LayoutError(f"engine layout ep={ep} (rank {ep_rank}), tp={tp} (rank {tp_rank}) does not fit"
                          f" {moe.num_experts} experts")  # fmt: skip
    if moe.expert_ffn_hidden_size % tp:
        raise LayoutError(f"expert FFN size {moe.expert_ffn_hidden_size} is not divisible by engine tp={tp}")
    per_rank = moe.num_experts // ep
    mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in iter_hf_weights(model, dtype=dtype, ranks=ranks, bucket_size=bucket_size):
        match = _EXPERT.match(name)
        if match is None or match.group("which") not in PROJECTIONS:
            yield name, tensor
            continue
        prefix, e, which = match.group("prefix"), int(match.group("e")), PROJECTIONS[match.group("which")]
        layer = pending.setdefault(prefix, {})
        if e in mine:
            axis = 1 if which == "down" else 0
            layer[(e, which)] = torch.chunk(tensor, tp, dim=axis)[tp_rank].clone()
        layer[(-1, f"{e}.{which}")] = torch.empty(0)  # seen (owned or not)
        if sum(1 for k in layer if k[0] == -1) == 3 * moe.num_experts:
            yield from _fused(prefix, pending.pop(prefix), mine)
    if pending:
        raise LayoutError(f"incomplete experts after export: {sorted(pending)[:3]}")


def _fused(prefix: str, layer: dict[tuple[int, str], torch.Tensor], mine: range) -> Iterator[tuple[str, torch.Tensor]]:
    w13 = torch.stack([torch.cat([layer[(e, "gate")], layer[(e, "up")]], dim=0) for e in mine])
    w2 = torch.stack([layer[(e, "down")] for e in mine])
    yield prefix + "experts.w13_weight", w13
    yield prefix + "experts.w2_weight", w2


__all__ = ["iter_fused_experts"]
