"""Load HF weights into a zoo-built model, job-wide (any TP rank / pipeline stage / VPP chunk).

The model's handle says where this rank sits (:class:`~mcore_zoo.placement.Placement`); the
placement is checked against the running parallel state, then every check of
:func:`mcore_zoo.weights.load.plan_load` runs, all before a single weight is read.

Each rank reads only its tensor-parallel chunk of each source
(:func:`~mcore_zoo.weights.load.read_rule_into`). Data-parallel replicas (and context-parallel
ranks, which hold the same weights) do not multiply the storage traffic: with
``replicas="broadcast"`` (default) only the first rank of each data-parallel group reads, and every
parameter is broadcast over that group (NCCL on GPUs; the interconnect is faster than shared
storage). ``replicas="read"`` makes every rank read its own copy (when storage is local and fast,
or no collective may be issued). Pipeline stages and tensor-parallel ranks always read disjoint
parts; the one exception is a tied embedding, which the first and last pipeline stages both read
(both hold it; Megatron keeps the two copies equal in training by all-reducing their gradients
over the embedding group).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..handle import ModelHandle, handle_of
from ..placement import Placement
from ..progress import progress
from ..weights.io import HFCheckpoint
from ..weights.load import (
    DictCheckpoint, LoadReport, absent_tensors, collector_paused, dequantizing_view, finish_reads, open_hf_checkpoint,
    plan_load, queued_reads, read_rule_into, rule_views,
)  # fmt: skip

logger = logging.getLogger(__name__)


def _replica_group(param: torch.Tensor, placement: Placement) -> Optional[Any]:
    """The group of ranks holding identical copies of ``param`` (None when alone)."""
    groups = placement.groups
    group = groups.dp_cp if getattr(param, "allreduce", True) else groups.expert_dp  # expert params: allreduce=False
    return group if group is not None and group.size() > 1 else None


def load_hf_weights(
    model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]],
    checkpoint: Union[str, os.PathLike, HFCheckpoint],
    *,
    allow_torch_load: bool = False,
    replicas: str = "broadcast",
) -> LoadReport:
    """Load an HF checkpoint into ``model`` (a zoo-built GPTModel, its list of VPP chunks, or its
    handle): every chunk this rank holds.

    Every rank of the job calls it. Each tensor-parallel rank reads only its chunks; ``replicas``
    says how data-parallel copies get theirs (module docstring). Raises before writing anything if
    the layout is wrong or the checkpoint and the weight map disagree.
    """
    if replicas not in ("broadcast", "read"):
        raise ValueError(f"replicas={replicas!r}; use 'broadcast' or 'read'")
    handle = handle_of(model)
    handle.check_current()  # before any IO
    with collector_paused():  # no collection of the whole process's objects inside the load (the opening included)
        own = not isinstance(checkpoint, HFCheckpoint)
        quantization = handle.arch_config.checkpoint_quantization
        if own:  # FP8 blocks: dequantized as they are read (mcore_zoo.weights.fp8)
            ckpt = open_hf_checkpoint(checkpoint, handle.arch_config, allow_torch_load=allow_torch_load)
        else:
            ckpt = dequantizing_view(checkpoint, handle.arch_config)
        if quantization is not None and quantization.get("quant_method") == "mxfp4":
            handle.mxfp4_source = ckpt  # which tensors were MXFP4 blocks (export)
        if quantization is not None and quantization.get("quant_method") == "fp8":
            handle.fp8_source = ckpt  # which tensors were quantized, and their scales (export)
        try:
            return _load(handle, ckpt, own, replicas)
        finally:
            if own:
                ckpt.close()


def _load(handle: ModelHandle, ckpt: Any, own: bool, replicas: str) -> LoadReport:
    """:func:`load_hf_weights`' plan and reads, from the opened checkpoint ``ckpt`` (``own``:
    opened by the load from a path)."""
    chunks = [(chunk, handle.rule_steps(chunk)) for chunk in handle.chunks]
    plan, ignored = plan_load(handle.weight_map, ckpt, chunks, [handle.parameter_names(chunk) for chunk, _ in chunks])
    rank = handle.placement.rank
    report = LoadReport(ignored=ignored, absent=absent_tensors(handle.weight_map, ckpt.keys()))
    # every parameter and the views its sources are read into, made before the first read (rule_views)
    targets = [[(step, param, rule_views(step.bound, param, step.ctx)) for step in steps for param in (step.tensor(),)]
               for steps in plan]  # fmt: skip
    with queued_reads(ckpt):  # the next parameter is planned while this one's bytes are copied
        for chunk_targets in targets:
            for step, param, views in progress(chunk_targets, total=len(chunk_targets), desc="loading HF weights",
                                               unit="param", rank=rank):  # fmt: skip
                group = _replica_group(param, handle.placement) if replicas == "broadcast" else None
                source = None if group is None else dist.get_process_group_ranks(group)[0]
                if group is None or rank == source:
                    report.bytes_read += read_rule_into(ckpt, step.bound, param, step.ctx, views)
                    report.tensors_read += len(step.bound.hf)
                if group is not None:
                    finish_reads(ckpt)  # the parameter is complete before it is sent
                    dist.broadcast(param.data, src=source, group=group)
                    if rank != source:
                        report.bytes_received += param.numel() * param.element_size()
                report.parameters += 1
    if own and os.path.isdir(ckpt.path):
        handle.hf_source = os.path.realpath(ckpt.path)  # save_hf_checkpoint copies its tokenizer files
    logger.info("loaded %d parameters from %s (%.1f MB read)", report.parameters, ckpt.path, report.bytes_read / 1e6)
    return report


def load_hf_state_dict(
    model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]], state_dict: dict[str, torch.Tensor]
) -> LoadReport:
    """Load from an in-memory HF state dict (e.g. ``hf_model.state_dict()``), same checks."""
    return load_hf_weights(model, DictCheckpoint(state_dict))


__all__ = ["load_hf_weights", "load_hf_state_dict"]
