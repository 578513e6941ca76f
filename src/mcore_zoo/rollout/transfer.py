"""The transfer plan of a disaggregated refit: which trainer rank sends which engine shard.

A :class:`~mcore_zoo.rollout.plan.RefitPlan` says where every HF tensor piece lands on every engine
tensor-parallel rank (its :class:`~mcore_zoo.rollout.plan.Slot`). With trainer and engine in
different processes, the bytes of a slot can come from any trainer rank that holds them. Each
trainer rank describes what it holds (:func:`holdings_of`: per HF tensor its rule source, the
fused part it is, its tensor-parallel slot and group - metadata only), the ranks exchange the
descriptions once, and :func:`plan_transfer` assigns every ``(engine rank, slot)`` one sender:

* the lowest trainer rank whose own TP chunk contains the slot (:meth:`TPSlice.within_chunk
  <mcore_zoo.weights.rules.TPSlice.within_chunk>`) - a pipeline stage for its own layers, an
  expert-parallel rank for its own experts, a TP rank for the shard it holds: nothing gathered;
* else the lowest rank of the TP group of the lowest holder, which exports the rule gathered over
  that group (every rank of the group takes part): only where the engine's cut spans trainer
  shards (engine TP 1 from trainer TP 2, a vocabulary padded differently, a whole fused tensor).

Data replicas of the trainer (data parallelism, the dense parameters of expert-parallel ranks)
hold the same bytes; only the lowest rank sends them. Each ``(bucket, engine rank, sender)``
with at least one slot is one :class:`Route`: one message (a header, then the slots' bytes packed
in plan order) broadcast from the sender to every DP replica of that engine rank.

Everything here is plain data computed identically on every trainer rank; the engine ranks get
their part (:meth:`TransferPlan.for_engine_rank`) from trainer rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ..errors import ZooError
from ..weights.export import aligned_nbytes
from ..weights.rules import Cut, RuleStep, TPSlice
from .plan import RefitPlan, Slot

#: a rule source's part of a fused HF tensor: ``(axis, start, stop)`` (``Source.select``)
Select = tuple[int, int, int]


@dataclass(frozen=True)
class Holding:
    """One trainer rank's piece of one HF tensor: rule source ``source`` of its export step
    ``step`` (index into the rank's export steps), the part of a fused HF tensor it is
    (``select``), its tensor-parallel slot (``axis``, ``tp_rank``, ``tp_size``) and group
    (``group``: the global ranks of the rule's TP group in TP-rank order). ``gathered_only``: a
    finishing step (a padded vocabulary) makes its rows under TP; only the gathered export has
    them."""

    name: str
    rank: int
    step: int
    source: int
    select: Optional[Select]
    axis: Optional[int]
    tp_rank: int
    tp_size: int
    group: tuple[int, ...]
    gathered_only: bool = False

    def chunk_cuts(self, slot: Slot, planned: Sequence[int]) -> Optional[tuple[Cut, ...]]:
        """The slot's cuts in the coordinates of this rank's chunk of its piece, or ``None`` when
        the slot does not lie inside it (other ranks' rows, another part of a fused tensor)."""
        if self.gathered_only and self.tp_size > 1:
            return None
        shape, cuts = list(planned), slot.cuts
        if self.select is not None:
            axis, start, stop = self.select
            if not cuts or tuple(cuts[0]) != (axis, start, stop - start):
                return None
            shape[axis], cuts = stop - start, cuts[1:]
        held = TPSlice(self.axis, self.tp_rank, self.tp_size).within_chunk(tuple(shape), cuts)
        return None if held is None else held[1]


def holdings_of(steps: Sequence[RuleStep], copies: Mapping[str, Sequence[str]], rank: int,
                group_ranks: Any) -> list[Holding]:  # fmt: skip
    """What this trainer rank's export ``steps`` hold (see :class:`Holding`), the HF ``copies`` of
    a tensor held where it is; ``group_ranks(step)``: the global ranks of a step's TP group."""
    out = []
    for index, step in enumerate(steps):
        b, ctx = step.bound, step.ctx
        group = tuple(group_ranks(step)) if ctx.tp_size > 1 else (rank,)
        finish = getattr(b.transform, "finish", None) is not None
        for k, (name, select, axis) in enumerate(zip(b.hf, b.selects, b.tp_axes)):
            for hf_name in (name, *copies.get(name, ())):
                out.append(Holding(hf_name, rank, index, k, select, axis, ctx.tp_rank, ctx.tp_size, group, finish))
    return out


@dataclass(frozen=True)
class Assignment:
    """How the sender makes one slot: from its chunk of rule source ``source`` of step ``step``
    (``cuts`` in the chunk's coordinates), or - ``cuts`` ``None`` - from the rule's export, gathered
    over its TP group (the slot's own cuts)."""

    sender: int
    step: int
    source: int
    cuts: Optional[tuple[Cut, ...]]


@dataclass(frozen=True)
class Route:
    """One message: bucket ``bucket``'s slots of engine rank ``engine_rank`` that trainer rank
    ``sender`` sends, by position in that rank's slots of the bucket (plan order), and the bytes
    they take packed (each slot aligned: :func:`packed_offsets`)."""

    bucket: int
    engine_rank: int
    sender: int
    positions: tuple[int, ...]
    nbytes: int


@dataclass
class TransferPlan:
    """Who sends what (module docstring).

    Attributes:
        trainers: the trainer world size (refit-group ranks ``0 .. trainers - 1``).
        target_tp: the plan's engine TP size (engine ranks that receive the plan's rank-0 slots
            when 1: an engine format without pre-split shards).
        routes: every message, in send order (bucket, engine rank, sender).
        assignments: ``(bucket, engine rank, position)`` -> its :class:`Assignment`.
        exported: per TP group (its global ranks), the HF tensors whose rule it exports gathered.
        slots: per bucket, per engine rank, the slots in plan order.
    """

    trainers: int
    target_tp: int
    routes: list[Route]
    assignments: dict[tuple[int, int, int], Assignment]
    exported: dict[tuple[int, ...], set[str]]
    slots: list[list[list[Slot]]] = field(default_factory=list)

    def sent_by(self, rank: int) -> list[Route]:
        return [r for r in self.routes if r.sender == rank]

    def received_by(self, engine_rank: int) -> list[Route]:
        return [r for r in self.routes if r.engine_rank == engine_rank]

    def channels(self) -> list[tuple[int, int]]:
        """Every ``(sender, engine rank)`` pair with a message, sorted: one broadcast group each."""
        return sorted({(r.sender, r.engine_rank) for r in self.routes})

    def bytes_per_link(self) -> dict[tuple[int, int], int]:
        """Bytes per ``(sender, engine rank)`` channel per refit (each DP replica gets them all)."""
        out: dict[tuple[int, int], int] = {}
        for r in self.routes:
            out[(r.sender, r.engine_rank)] = out.get((r.sender, r.engine_rank), 0) + r.nbytes
        return out

    def for_engine_rank(self, engine_rank: int) -> "EngineRoutes":
        """What engine rank ``engine_rank`` needs: its routes and its slots per bucket."""
        return EngineRoutes(engine_rank, self.received_by(engine_rank), [per[engine_rank] for per in self.slots],
                            sorted({r.sender for r in self.received_by(engine_rank)}))  # fmt: skip

    def describe(self) -> str:
        senders = sorted({r.sender for r in self.routes})
        total = sum(r.nbytes for r in self.routes)
        gathered = sum(len(v) for v in self.exported.values())
        return (f"{len(self.routes)} message(s) from trainer rank(s) {senders} into {self.target_tp} engine rank(s),"
                f" {total / 2**20:.2f} MiB, {gathered} HF tensor(s) exported gathered")  # fmt: skip


@dataclass(frozen=True)
class EngineRoutes:
    """One engine rank's part of a :class:`TransferPlan` (picklable, no trainer state): its routes
    in receive order, its slots per bucket and the trainer ranks it hears from."""

    engine_rank: int
    routes: list[Route]
    slots: list[list[Slot]]
    senders: list[int]


def packed_offsets(slots: Sequence[Slot]) -> tuple[list[int], int]:
    """Byte offsets of ``slots`` packed one after another in one buffer (each aligned so that it
    can be viewed in its dtype), and the buffer's size."""
    offsets, total = [], 0
    for slot in slots:
        offsets.append(total)
        total += aligned_nbytes(slot.nbytes)
    return offsets, total


def plan_transfer(plan: RefitPlan, holdings: Sequence[Holding], trainers: int) -> TransferPlan:
    """The :class:`TransferPlan` of ``plan`` from the trainer ranks' ``holdings`` (all of them:
    every rank's :func:`holdings_of`, exchanged). Raises :class:`ZooError` naming an HF tensor no
    trainer rank holds."""
    planned = {name: tuple(shape) for name, shape, _ in plan.hf}
    by_name: dict[str, list[Holding]] = {}
    for h in sorted(holdings, key=lambda h: (h.rank, h.step, h.source)):
        by_name.setdefault(h.name, []).append(h)
    missing = sorted(set(planned) - set(by_name))
    if missing:
        raise ZooError(f"disaggregated refit: no trainer rank holds {missing[:8]} (plan made for another model?)")
    assignments: dict[tuple[int, int, int], Assignment] = {}
    exported: dict[tuple[int, ...], set[str]] = {}
    routes: list[Route] = []
    slots = [[[s for name in names for s in plan.slots[name][rank]] for rank in range(plan.target_tp)] for names in plan.buckets]
    chosen: dict[tuple[str, tuple[Cut, ...], Any], Assignment] = {}
    for bucket, per_rank in enumerate(slots):
        for rank, bucket_slots in enumerate(per_rank):
            by_sender: dict[int, list[int]] = {}
            for position, slot in enumerate(bucket_slots):
                key = (slot.hf_name, slot.cuts, slot.expert_slice)
                how = chosen.get(key)
                if how is None:
                    how = chosen[key] = _assign(slot, by_name[slot.hf_name], planned[slot.hf_name], exported)
                assignments[(bucket, rank, position)] = how
                by_sender.setdefault(how.sender, []).append(position)
            for sender in sorted(by_sender):
                positions = tuple(by_sender[sender])
                _, nbytes = packed_offsets([bucket_slots[p] for p in positions])
                routes.append(Route(bucket, rank, sender, positions, nbytes))
    return TransferPlan(trainers, plan.target_tp, routes, assignments, exported, slots)


def _assign(slot: Slot, holders: list[Holding], planned: tuple[int, ...], exported: dict[tuple[int, ...], set[str]]) -> Assignment:
    """The sender of one slot (module docstring): a chunk that holds it, else the gathered export
    of the lowest holder's TP group (recorded in ``exported``)."""
    for h in holders:  # rank order
        cuts = h.chunk_cuts(slot, planned)
        if cuts is not None:
            return Assignment(h.rank, h.step, h.source, cuts)
    first = holders[0]
    exported.setdefault(first.group, set()).add(slot.hf_name)
    sender = min(first.group)
    mine = next((h for h in holders if h.rank == sender), None)
    if mine is None:
        raise ZooError(f"disaggregated refit: {slot.hf_name}: TP group {first.group} exports it, but rank {sender} holds none of it")
    return Assignment(sender, mine.step, mine.source, None)


__all__ = ["Holding", "holdings_of", "Assignment", "Route", "TransferPlan", "EngineRoutes", "plan_transfer", "packed_offsets"]
