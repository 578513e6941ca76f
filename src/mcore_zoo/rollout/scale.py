"""A model of the disaggregated refit's time at scale, from a published config.

:func:`refit_time_at_scale` counts the bytes the :mod:`~mcore_zoo.rollout.transfer` rules put on
every link, without building the model: the checkpoint's HF tensors (names and shapes of the
transformers model built on the ``meta`` device from the config), placed as a trainer layout places
them - layer ``i`` on pipeline stage ``i * pp // layers`` (the embedding on the first, the final
norm and the output layer on the last, MTP layers on the last), routed expert ``j`` on
expert-parallel rank ``j * ep // experts``, a split tensor's 1/tp on each trainer TP rank - and
sent as the transfer plan sends them:

* each tensor is sent once, by the lowest trainer rank holding it (a stage's dense tensors by its
  first expert-parallel rank, an expert by its EP rank); each engine TP rank gets its 1/``engine_tp``
  of a tensor of two or more dimensions and the whole of a 1-D one (norms, biases, router biases:
  replicated by the engine);
* the engine's DP replicas get every byte through one broadcast per (sender, engine rank): a sender
  puts its bytes on its link once, each engine GPU takes its shard once.

Every GPU has a link of ``link_gbps`` (GB/s; on H100 nodes, one 400 Gb/s NIC per GPU gives about
45-48 GB/s in NCCL, NVLink within a node several times that), so the refit takes about
``max(the busiest sender's bytes, an engine rank's bytes) / link_gbps``: the model is a lower bound
that assumes the links run at that bandwidth concurrently and ignores per-bucket latency.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

#: a decoder layer's tensors (``model.layers.3.``)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: routed experts: stacked per layer (``mlp.experts.gate_up_proj [E, ...]``) or one tensor per expert
_EXPERTS = re.compile(r"\.experts\.(?:(\d+)\.)?")


@dataclass(frozen=True)
class ScaleEstimate:
    """What :func:`refit_time_at_scale` found (bytes in the sent dtype)."""

    name: str
    trainer: str
    engine: str
    total_bytes: int
    busiest_sender_bytes: int
    engine_rank_bytes: int
    senders: int
    link_gbps: float

    @property
    def seconds(self) -> float:
        return max(self.busiest_sender_bytes, self.engine_rank_bytes) / (self.link_gbps * 1e9)

    def describe(self) -> str:
        return (f"{self.name}: {self.trainer} -> {self.engine}: {self.total_bytes / 1e9:.0f} GB per replica,"
                f" busiest sender {self.busiest_sender_bytes / 1e9:.2f} GB, each engine rank {self.engine_rank_bytes / 1e9:.2f} GB,"
                f" {self.senders} sending trainer ranks; at {self.link_gbps:g} GB/s per link: {self.seconds:.2f} s")  # fmt: skip


def hf_tensor_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the checkpoint ``config`` describes (the transformers
    model built on the ``meta`` device: no memory, no weights)."""
    import torch
    import transformers

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def refit_time_at_scale(config: Mapping[str, Any], *, trainer_pp: int = 1, trainer_ep: int = 1, trainer_tp: int = 1,
                        engine_tp: int = 1, engine_dp: int = 1, link_gbps: float = 45.0, dtype_bytes: int = 2,
                        name: str = "", shapes: Any = None) -> ScaleEstimate:  # fmt: skip
    """The refit time of the model ``config`` describes from a trainer layout to an engine layout
    (module docstring); ``shapes``: :func:`hf_tensor_shapes` of it, if already known."""
    shapes = hf_tensor_shapes(config) if shapes is None else shapes
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 1)
    sent: dict[tuple[int, int, int], int] = {}  # (stage, ep rank, tp rank) -> bytes sent
    engine_rank = total = 0
    for tensor_name, shape in shapes:
        nbytes = math.prod(shape) * dtype_bytes
        total += nbytes
        split = len(shape) >= 2
        engine_rank += nbytes // engine_tp if split else nbytes
        stage = _stage(tensor_name, layers, trainer_pp)
        expert = _EXPERTS.search(tensor_name)
        tp_ranks = trainer_tp if split else 1  # a replicated tensor: the first TP rank sends it
        if expert is None:
            holders = [(0, nbytes)]
        elif expert.group(1) is not None:  # one tensor per expert
            holders = [(int(expert.group(1)) * trainer_ep // experts, nbytes)]
        else:  # stacked [E, ...]: each EP rank its experts
            per = nbytes // shape[0]
            holders = [(r, per * sum(1 for j in range(shape[0]) if j * trainer_ep // shape[0] == r)) for r in range(trainer_ep)]
        for ep_rank, held in holders:
            for tp_rank in range(tp_ranks):
                key = (stage, ep_rank, tp_rank)
                sent[key] = sent.get(key, 0) + (held // tp_ranks if split else held * engine_tp)
    trainer = f"trainer TP{trainer_tp} x PP{trainer_pp} x EP{trainer_ep}"
    return ScaleEstimate(name or str(config.get("architectures", ["model"])[0]), trainer, f"engine TP{engine_tp} x DP{engine_dp}",
                         total, max(sent.values()), engine_rank, len(sent), link_gbps)  # fmt: skip


def _stage(tensor_name: str, layers: int, pp: int) -> int:
    """The pipeline stage holding a tensor: its layer's (MTP layers, past the decoder's: the last),
    the embedding on the first, everything else (final norm, output layer) on the last."""
    found = _LAYER.search(tensor_name)
    if found is not None:
        layer = int(found.group(1))
        return pp - 1 if layer >= layers else layer * pp // layers
    return 0 if "embed" in tensor_name else pp - 1


__all__ = ["ScaleEstimate", "refit_time_at_scale", "hf_tensor_shapes"]
