"""The engine side of a refit: the :class:`EngineAdapter` interface and what a bucket carries.

An adapter is the only code that knows how to reach an inference engine. :func:`mcore_zoo.refit`
calls, on the receiving rank::

    adapter.begin(plan)            # once per refit: the plan (engine names, shapes, offsets)
    adapter.load_bucket(bucket)    # per bucket, in plan order
    adapter.end()                  # once: the adapter checks that the engine got everything

and reads two attributes to plan the refit: ``adapter.engine_format`` (an
:class:`~mcore_zoo.rollout.engine_format.EngineFormat`: how the engine names and fuses tensors) and
``adapter.tp_size`` (the engine's tensor-parallel size; shards are cut for every engine rank), and
one to choose the shards' form: ``adapter.raw_shards`` (below). An adapter that feeds a single
engine rank - one engine rank per trainer rank, ``refit(..., receiver="all")`` - may say which in
``adapter.engine_rank``: a trainer whose TP matches the engine's then sends that rank's shards only
(``bucket.items[r]`` is empty for every other ``r``), cut from its own TP chunks.

A :class:`RefitBucket` holds, per engine TP rank, ``(slot, tensor)`` pairs: the tensor is that
rank's shard (a view of the gathered HF tensor, or of the trainer's parameter - read it, do not
modify or keep it past ``load_bucket``), the :class:`~mcore_zoo.rollout.plan.Slot` says where it
goes (engine name, expert, row offset, zero padding). By default (``raw_shards = False``) a shard
has exactly the slot's shape and dtype. ``bucket.named(rank)`` gives plain ``[(name, tensor)]``
for engines that take names only (an engine format without fusion: whole HF tensors under HF
names).

``raw_shards = True`` is for adapters that copy each shard into a region of an engine tensor
themselves (:class:`~mcore_zoo.rollout.vllm.VLLMAdapter` in direct mode): the shard may then also
be a view of the trainer's parameter that holds the slot's elements in row-major order in a shape
that splits the slot's first dimension (mcore's per-group q rows ``[groups, rows, hidden]`` for a
slot of ``[groups * rows, hidden]``), in the parameter's dtype rather than the slot's. Such an
adapter writes it as ``region.view(shard.shape).copy_(shard)`` - after ``shard.to(slot.dtype)``
where the engine tensor's dtype is not the slot's, so that values are rounded as the planned cast
would round them. This spares the trainer-side copy that reshaping or casting would make (see
:mod:`mcore_zoo.rollout.program`: shards come as raw views only from a trainer whose export needs
no collective).

Adapters that ship: :class:`~mcore_zoo.rollout.vllm.VLLMAdapter` (an in-process ``vllm.LLM``) and
:class:`~mcore_zoo.rollout.sglang.SGLangAdapter` (SGLang's
``update_weights_from_tensor``). :class:`DictAdapter` keeps engine tensors in a dict (tests, and a
reference for adapter authors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..errors import ZooError
from .engine_format import VLLM, EngineFormat
from .plan import RegionCoverage, planned_regions, slot_rows

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan, Slot


@dataclass
class RefitBucket:
    """One bucket: ``items[rank]`` = ``[(slot, shard), ...]`` for engine TP rank ``rank``."""

    index: int
    items: list[list[tuple["Slot", torch.Tensor]]]

    def named(self, rank: int = 0) -> list[tuple[str, torch.Tensor]]:
        """``[(engine_name, tensor)]`` of one rank (for name-only engines)."""
        return [(slot.name, tensor) for slot, tensor in self.items[rank]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for per in self.items for _, t in per)


class EngineAdapter:
    """How :func:`mcore_zoo.refit` reaches an inference engine (see module docstring).

    Subclasses set ``engine_format`` and ``tp_size`` (and ``raw_shards`` if they accept raw views,
    ``engine_rank`` if they feed one engine rank only; see the module docstring) and implement the
    three calls. ``begin`` may check the plan against the engine (names, shapes) and refuse it;
    ``end`` must raise when the engine did not receive every tensor of the plan.
    """

    engine_format: EngineFormat = VLLM
    tp_size: int = 1
    raw_shards: bool = False
    engine_rank: Optional[int] = None

    def begin(self, plan: "RefitPlan") -> None:
        raise NotImplementedError

    def load_bucket(self, bucket: RefitBucket) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError


def write_slot(target: torch.Tensor, slot_expert: Optional[int], offset: int, rows_pad: int, tensor: torch.Tensor) -> int:
    """Write one shard into an engine tensor in place: ``target[expert]`` rows ``offset ..`` get
    ``tensor``, the ``rows_pad`` rows after it zeros. Returns the elements written (coverage)."""
    dest = target if slot_expert is None else target[slot_expert]
    rows = tensor.shape[0] if tensor.dim() else 1
    if tensor.dim() == 0:
        dest.copy_(tensor)
        return 1
    dest.narrow(0, offset, rows).copy_(tensor)
    written = tensor.numel()
    if rows_pad:
        pad = dest.narrow(0, offset + rows, rows_pad)
        pad.zero_()
        written += pad.numel()
    return written


class DictAdapter(EngineAdapter):
    """Engine tensors in a dict per rank, allocated from the plan (``tensors[rank][name]``).

    The reference adapter: writes every slot in place (:func:`write_slot`) and, at ``end``, raises
    when any engine tensor was not completely written. ``tensors`` may be given (an engine's own
    parameters, e.g. to test a refit over stale values); missing ones are allocated (NaN-filled, so
    a row never written cannot pass as data).
    """

    def __init__(self, tp_size: int = 1, engine_format: EngineFormat = VLLM,
                 tensors: Optional[list[dict[str, torch.Tensor]]] = None, device: str = "cpu",
                 engine_rank: Optional[int] = None) -> None:  # fmt: skip
        self.tp_size = tp_size
        #: the one engine rank this adapter holds (``None``: all of them); only its tensors are
        #: allocated, written and checked
        self.engine_rank = engine_rank
        self.engine_format = engine_format
        self.tensors = tensors if tensors is not None else [{} for _ in range(tp_size if engine_format.presplit else 1)]
        self.device = device
        self.calls: list[str] = []
        self._written: list[dict[str, int]] = []

    def begin(self, plan: "RefitPlan") -> None:
        self.calls.append("begin")
        if plan.target_tp != (self.tp_size if self.engine_format.presplit else 1):
            raise ZooError(f"plan for tp={plan.target_tp}, engine tp={self.tp_size}")
        for rank, tensors in enumerate(plan.engine_tensors):
            if not self._holds(rank):
                continue
            have = self.tensors[rank]
            for t in tensors:
                if t.name not in have:
                    have[t.name] = torch.full(t.shape, float("nan"), dtype=t.dtype, device=self.device)
                elif tuple(have[t.name].shape) != t.shape:
                    raise ZooError(f"engine tensor {t.name!r} is {tuple(have[t.name].shape)}, the plan fills {t.shape}")
        self._coverage = RegionCoverage()
        self._plan = plan

    def load_bucket(self, bucket: RefitBucket) -> None:
        self.calls.append(f"bucket {bucket.index}")
        for rank, items in enumerate(bucket.items):
            if items and not self._holds(rank):
                raise ZooError(f"bucket {bucket.index} has shards for engine rank {rank};"
                               f" this adapter holds rank {self.engine_rank}")  # fmt: skip
            for slot, tensor in items:
                self._coverage.add((rank, slot.name, slot.expert), *slot_rows(slot.offset, tuple(tensor.shape), slot.pad))
                write_slot(self.tensors[rank][slot.name], slot.expert, slot.offset, slot.pad, tensor)

    def end(self) -> None:
        self.calls.append("end")
        expected: dict[Any, int] = {}
        for rank in range(len(self._plan.engine_tensors)):
            if self._holds(rank):
                expected.update(planned_regions(self._plan, rank))
        missing = self._coverage.problems(expected)
        if missing:
            raise ZooError(f"refit incomplete: {len(missing)} engine tensor region(s) not written: " + "; ".join(missing[:8]))

    def _holds(self, rank: int) -> bool:
        return self.engine_rank is None or rank == self.engine_rank


__all__ = ["EngineAdapter", "RefitBucket", "DictAdapter", "write_slot"]
