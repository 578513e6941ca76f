"""Copy one model's weights into another of the same architecture at any other layout.

The actor's weights go into the reference (or an EMA / old-policy copy) after an update, each at
its own layout (:mod:`mcore_zoo.model_groups`). :func:`copy_weights` streams the source's export
(:func:`~mcore_zoo.distributed.export.iter_hf_buckets`: gathered over the source's TP and PP, at
most ``bucket_size`` bytes at a time) to every rank, and each rank fills its own chunks of the
target from each bucket as it arrives - the target's rule table reading its TP slice of each
tensor, as loading does - keeping a tensor only until every rule that reads it has. No rank
holds the whole model; no file is written. The weights arrive bit for bit (the same rules split
what the source's rules gathered).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import NotOnThisRankError, ZooError
from ..handle import handle_of
from ..placement import process_count
from ..weights.load import DictCheckpoint, read_rule_into
from .export import iter_hf_buckets


@dataclass
class CopyReport:
    """What :func:`copy_weights` moved on this rank: the target parameters filled, the bytes of the
    source's buckets received and the wall time."""

    parameters: int = 0
    bytes_received: int = 0
    buckets: int = 0
    seconds: float = 0.0


def copy_weights(source: Any, target: Any, *, bucket_size: Union[int, str] = "512MB") -> CopyReport:
    """Copy every weight of ``source`` into ``target`` (two zoo-built models of one architecture,
    each at any layout; each given as this rank's chunks, wrapped or not, or its handle). Every rank
    of the job calls it (the source's export issues collectives); a rank holding no part of the
    target (placed on other ranks: ``build_model(..., ranks=...)``) still takes part in the
    source's gathers, and only the target's ranks receive the buckets. A source placed on part of
    the job copies into a target on those ranks only (a :class:`~mcore_zoo.errors.NotOnThisRankError`
    on every rank otherwise); the ranks holding neither return at once."""
    src, dst = handle_of(source), handle_of(target)
    if src.weight_map.hf_names() != dst.weight_map.hf_names() or src.arch_config != dst.arch_config:
        raise ZooError(f"copy_weights: {src.arch_config.architecture} into {dst.arch_config.architecture}: the two models"
                       " differ in their configuration or HF tensors; a copy needs the same architecture and config")  # fmt: skip
    if src.placement.ranks is not None:
        outside = sorted(set(dst.placement.ranks or range(process_count())) - set(src.placement.ranks))
        if outside:
            raise NotOnThisRankError(f"copy_weights: the source is placed on ranks {list(src.placement.ranks)}, the"
                                     f" target also on {outside}: the source's buckets reach its own ranks only")  # fmt: skip
        if not src.placement.holds_model:
            return CopyReport()
    receivers = None if dst.placement.ranks is None else list(dst.placement.ranks)
    if dst.placement.holds_model:
        dst.check_current()
    start = time.perf_counter()
    steps = [s for chunk in dst.chunks for s in dst.rule_steps(chunk)]
    readers: dict[str, int] = {}
    for s in steps:
        for name in s.bound.hf:
            readers[name] = readers.get(name, 0) + 1
    pending = list(steps)
    held: dict[str, torch.Tensor] = {}
    report = CopyReport()
    for bucket in iter_hf_buckets(src, bucket_size=bucket_size, ranks=receivers):
        report.buckets += 1
        for name, tensor in bucket:
            report.bytes_received += tensor.numel() * tensor.element_size()
            if name in readers:
                held[name] = tensor
        ready = [s for s in pending if all(n in held for n in s.bound.hf)]
        if not ready:
            continue
        view = DictCheckpoint(held)
        for s in ready:
            read_rule_into(view, s.bound, s.tensor(), s.ctx)
            report.parameters += 1
            for name in s.bound.hf:
                readers[name] -= 1
                if not readers[name]:
                    del held[name]
        ready_ids = {id(s) for s in ready}
        pending = [s for s in pending if id(s) not in ready_ids]
    if pending:
        missing = sorted({n for s in pending for n in s.bound.hf if n not in held})
        raise ZooError(f"copy_weights: the source exported no {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["CopyReport", "copy_weights"]
