"""The refit plan: where every exported HF tensor lands in a running inference engine.

:func:`plan_refit` is computed once per (model, engine format, engine TP size, dtype, bucket size)
and reused every step. It combines

* the model's export plan (:func:`mcore_zoo.distributed.export.export_plan`: every HF tensor in
  export order, with its gathered shape and dtype - a collective over the pipeline group), and
* the zoo's weight rules (which axis each HF tensor is split along for tensor parallelism, which
  rows of a fused HF tensor are q, k or v) - the same rules that load and export the model, and
* the engine's :class:`~mcore_zoo.rollout.engine_format.EngineFormat` (its fusion map),

into one :class:`Slot` per (HF tensor piece, engine TP rank): the engine tensor's name, the expert
index for stacked experts, the row offset inside the engine's fused tensor, the shard's shape and
the cuts that take it out of the gathered HF tensor. Buckets group consecutive HF tensors up to
``bucket_size`` bytes (what one engine call receives, all engine ranks' shards counted).

Nothing here moves data or talks to an engine; :func:`mcore_zoo.rollout.refit` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from ..errors import LayoutError, ZooError
from ..handle import ModelHandle
from ..weights.io import parse_size
from ..weights.rules import STACKED_GATE_UP_HALVES, Cut, TPSlice, narrow
from .engine_format import EngineFormat, StackedExpertLayout, expert_owner

#: mcore parameters whose rows are the vocabulary (the engine may pad them)
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")



@dataclass(frozen=True)
class Slot:
    """One piece of one engine tensor on one engine tensor-parallel rank.

    Attributes:
        name: the engine tensor (``model.layers.0.self_attn.qkv_proj.weight``).
        hf_name: the HF tensor it is cut from.
        expert: index into dim 0 of a stacked-experts engine tensor (``w13_weight[expert]``), else
            ``None``.
        offset: first row (dim 0 of the engine tensor, or of ``tensor[expert]``) this piece fills.
        shape: the piece's shape.
        dtype: the piece's dtype.
        cuts: ``narrow(axis, start, length)`` steps that take the piece out of the gathered HF
            tensor (a fused HF tensor's part, then the tensor-parallel shard).
        pad: zero rows that follow the piece (the engine's vocabulary padding).
        rows: the engine tensor's rows on this rank (dim 0, per expert for stacked experts).
        expert_slice: the cuts leave one expert's slice ``[1, ...]`` of an HF tensor that stacks
            every expert of a layer; the piece is that slice without its expert axis, a 2-D one
            transposed (:class:`~mcore_zoo.rollout.engine_format.StackedExpertLayout`).
    """

    name: str
    hf_name: str
    expert: Optional[int]
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuts: tuple[Cut, ...] = ()
    pad: int = 0
    rows: int = 0
    expert_slice: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of the gathered HF tensor (a view)."""
        return expert_piece(narrow(tensor, self.cuts)) if self.expert_slice else narrow(tensor, self.cuts)


def expert_piece(piece: torch.Tensor) -> torch.Tensor:
    """One expert's slice ``[1, ...]`` of a stacked-experts HF tensor as the engine stores it: the
    expert axis dropped, a 2-D slice transposed (``[1, H, n]`` -> ``[n, H]``, ``[1, n]`` -> ``[n]``;
    a view)."""
    piece = piece[0]
    return piece.t() if piece.dim() == 2 else piece


@dataclass(frozen=True)
class EngineTensor:
    """An engine tensor as the plan fills it on one rank: ``shape`` (experts stacked in front)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class RefitPlan:
    """Every HF tensor's engine slots, and the buckets (see module docstring).

    Attributes:
        architecture: the HF architecture (plans are refused for another model).
        engine_format: the engine format.
        target_tp: the engine's tensor-parallel size.
        dtype: the dtype tensors are sent in.
        bucket_size: bytes per bucket (all engine ranks' shards counted; a larger tensor is a
            bucket of its own).
        hf: ``(name, shape, dtype)`` of every HF tensor in export order.
        slots: HF name -> ``slots[name][rank]``: that tensor's pieces on engine rank ``rank``.
        buckets: HF names per bucket, in export order.
        engine_tensors: per engine rank, every engine tensor the plan fills completely.
    """

    architecture: str
    engine_format: EngineFormat
    target_tp: int
    dtype: Optional[torch.dtype]
    bucket_size: int
    hf: list[tuple[str, tuple[int, ...], torch.dtype]]
    slots: dict[str, list[list[Slot]]]
    buckets: list[list[str]]
    engine_tensors: list[list[EngineTensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes sent per refit (all engine ranks)."""
        return sum(s.nbytes for per_rank in self.slots.values() for slots in per_rank for s in slots)

    def manifest(self, rank: int) -> list[tuple[str, Optional[int], int, tuple[int, ...], str, int, int]]:
        """Engine rank ``rank``'s slots as plain tuples ``(name, expert, offset, shape, dtype, pad,
        rows)``, in plan order: what the engine side checks up front (picklable, no torch types)."""
        return [
            (s.name, s.expert, s.offset, s.shape, str(s.dtype).replace("torch.", ""), s.pad, s.rows)
            for names in self.buckets
            for name in names
            for s in self.slots[name][rank]
        ]

    def bucket_counts(self, rank: int) -> list[int]:
        """How :meth:`manifest` of engine rank ``rank`` splits into buckets: that rank's slots in
        each bucket, in bucket order (the engine side binds shards to slots by position)."""
        return [sum(len(self.slots[name][rank]) for name in names) for names in self.buckets]

    def describe(self) -> str:
        tensors = len(self.engine_tensors[0]) if self.engine_tensors else 0
        return (f"{self.architecture} -> {self.engine_format.name} TP{self.target_tp}: {len(self.hf)} HF tensors, "
                f"{tensors} engine tensors per rank, {len(self.buckets)} bucket(s), {self.nbytes / 2**30:.3f} GiB")  # fmt: skip


def stacked_expert_tensors(handle: ModelHandle) -> frozenset[str]:
    """The model's HF tensors that stack every routed expert of a layer (``Source.expert_axis``:
    gpt-oss's ``mlp.experts.gate_up_proj [E, H, 2I]``): each is assembled from one parameter per
    expert, so a refit cuts it from the export stream (computed once per model structure)."""

    def find() -> frozenset[str]:
        specs = handle.weight_map.hf_parts()
        return frozenset(name for name, items in specs.items() if any(b.stacked[k] for b, k in items))

    return handle.derived("stacked_expert_tensors", find)


def _refuse_stacked_experts(architecture: str, engine_format: EngineFormat, stacked: frozenset[str]) -> None:
    """Refuse, naming the tensor, stacked-experts HF tensors that the engine format cannot place:
    a pre-split format without a :class:`~mcore_zoo.rollout.engine_format.StackedExpertLayout`
    for them (an MXFP4 engine's ``*_blocks`` / ``*_scales`` are not refit tensors either: the
    export is bf16)."""
    if not engine_format.presplit:
        return
    for name in sorted(stacked):
        if engine_format.stacked_expert_name(name) is None:
            raise ZooError(f"refit: {architecture}'s {name!r} stacks every routed expert of a layer, and the"
                           f" {engine_format.name!r} engine format has no layout for stacked experts (export the"
                           " model with save_hf_checkpoint and load it in the engine)")  # fmt: skip


def _refuse_split_gate_up_halves(architecture: str, engine_format: EngineFormat, specs: dict, stacked: frozenset[str],
                                 tp: int) -> None:  # fmt: skip
    """Refuse, naming the tensor, stacked experts whose gate and up sit in contiguous halves
    (Qwen3-VL-MoE's ``experts.gate_up_proj``) for a pre-split engine above TP 1: the engine's
    ``w13_weight`` rank holds ``[gate_r; up_r]``, two runs of the HF tensor, where the stacked
    layout cuts one run (gpt-oss's interleaved gate / up columns)."""
    if not engine_format.presplit or tp == 1:
        return
    for name in sorted(stacked):
        if any(b.rule.transform is STACKED_GATE_UP_HALVES for b, _ in specs[name]):
            raise ZooError(f"refit: {architecture}'s {name!r} holds gate and up in contiguous halves, which the"
                           f" {engine_format.name!r} engine format places at engine TP 1 only (engine TP {tp} asked:"
                           " export the model with save_hf_checkpoint and load it in the engine)")  # fmt: skip


def _stacked_expert_cuts(layout: StackedExpertLayout, shape: Sequence[int], part: TPSlice, tp: int, rank: int,
                         what: str) -> tuple[tuple[Cut, ...], int]:  # fmt: skip
    """Rank ``rank``'s cuts of one expert's slice (``part.select``) of a stacked-experts HF tensor
    and the zero rows after it: split along the rule's axis, or - a tensor the rule does not split,
    ``layout.unsplit_on_first_rank`` - whole on rank 0 and all zero rows on the others."""
    if part.axis is not None or not layout.unsplit_on_first_rank or rank == 0:
        return TPSlice(part.axis, rank, tp, part.select).cuts(shape, what), 0
    row_axis = len(shape) - 1 if len(shape) == 3 else 1  # the engine's rows, after the slice is transposed
    return (*TPSlice(select=part.select).cuts(shape, what), (row_axis, 0, 0)), shape[row_axis]


def _routed_experts(architecture: str, engine_format: EngineFormat, hf_names: set[str], roles: dict[str, str],
                    stacked: frozenset[str], tp: int) -> dict[str, int]:  # fmt: skip
    """For an engine format with expert parallelism: the routed experts of each stacked engine
    tensor (before renames; empty otherwise). Refuses, naming the tensor or layer, what it cannot
    place: HF tensors that stack every expert of a layer, and a layer with fewer experts than engine
    ranks."""
    if not (engine_format.presplit and engine_format.expert_parallel):
        return {}
    if stacked:
        raise ZooError(f"refit: {architecture}'s {sorted(stacked)[0]!r} stacks every routed expert of a layer; the"
                       f" {engine_format.name!r} engine format (expert parallelism) places per-expert tensors only")  # fmt: skip
    counts: dict[str, int] = {}
    for name in hf_names:
        hit = engine_format.expert_for(name, roles)
        if hit is not None:
            counts[hit[0]] = max(counts.get(hit[0], 0), hit[1] + 1)
    few = sorted(target for target, n in counts.items() if n < tp)
    if few:
        raise LayoutError(f"refit: {few[0]!r} has {counts[few[0]]} routed experts, fewer than the engine's {tp} expert-parallel ranks")
    return counts


def plan_refit(
    handle: ModelHandle,
    engine_format: EngineFormat,
    *,
    target_tp: int = 1,
    dtype: Optional[torch.dtype] = None,
    bucket_size: Union[int, str] = "1GB",
    entries: Optional[Sequence[Any]] = None,
) -> RefitPlan:
    """The :class:`RefitPlan` of a zoo-built model for an engine (see module docstring).

    Collective over the pipeline group (it runs :func:`~mcore_zoo.distributed.export.export_plan`)
    unless ``entries`` (that export plan) is given. Raises :class:`LayoutError` when the engine's
    TP size does not divide a tensor it splits."""
    from ..config.transformer import default_expert_tp, validate_layout
    from ..distributed.export import export_plan
    from ..placement import Parallelism

    tp = target_tp if engine_format.presplit else 1
    if tp < 1:
        raise LayoutError(f"target_tp must be >= 1, got {target_tp}")
    if entries is None:
        entries = export_plan(handle, dtype=dtype)
    specs = handle.weight_map.hf_parts()
    stacked = stacked_expert_tensors(handle)
    _refuse_stacked_experts(handle.arch_config.architecture, engine_format, stacked)
    _refuse_split_gate_up_halves(handle.arch_config.architecture, engine_format, specs, stacked, tp)
    roles = handle.weight_map.expert_roles()
    needed = set(handle.weight_map.export_names())
    if engine_format.presplit and tp > 1:  # before any data moves (the engine splits experts with biases itself)
        engine = Parallelism(tp=tp, etp=1) if engine_format.expert_parallel else Parallelism(tp=tp)  # EP: experts whole
        validate_layout(handle.arch_config, default_expert_tp(handle.arch_config, engine))
    vocab = {name for name, items in specs.items() if any(b.rule.mcore in VOCAB_PARAMETERS for b, _ in items)}
    hf = [(e.name, tuple(e.shape), e.dtype) for e in entries]
    hf_names = {name for name, _, _ in hf}
    if len(hf_names) != len(hf):
        twice = sorted({name for name, _, _ in hf if sum(n == name for n, _, _ in hf) > 1})
        raise ZooError(f"refit plan: HF tensor(s) named twice in the export plan: {twice[:8]}")
    if hf_names != needed:
        raise ZooError(f"refit plan: the export plan misses {sorted(needed - hf_names)[:8]} and has no rule for"
                       f" {sorted(hf_names - needed)[:8]}")  # fmt: skip

    renamed = engine_format.prefixes_for(handle.arch_config.architecture, hf_names) if engine_format.presplit else ()
    layer_experts = _routed_experts(handle.arch_config.architecture, engine_format, hf_names, roles, stacked, tp)
    substrings = engine_format.renames_for(handle.arch_config.architecture) if engine_format.presplit else ()
    # 1. every HF piece: (engine name, expert, shard id, order) and its cuts per rank
    pieces: dict[str, list[list[tuple[str, Optional[int], Any, tuple[Any, ...], tuple[Cut, ...], tuple[int, ...], int, int]]]] = {}
    for name, shape, dt in hf:
        if name not in specs:
            raise ZooError(f"refit plan: HF tensor {name!r} has no weight rule")
        per_rank: list[list[Any]] = [[] for _ in range(tp)]
        target, expert, shard, order = name, None, None, (None,)
        in_stack = engine_format.presplit and name in stacked
        owner: Optional[tuple[int, int]] = None  # engine expert parallelism: (rank, local index) of a routed expert
        if in_stack:
            target = engine_format.stacked_expert_name(name)  # type: ignore[assignment]
        elif engine_format.presplit:
            hit = engine_format.expert_for(name, roles)
            if hit is not None:
                target, expert, shard, order = hit
                if engine_format.expert_parallel:
                    owner = expert_owner(expert, layer_experts[target], tp, engine_format.expert_parallel)
            else:
                fused = engine_format.fusion_for(name, hf_names)
                if fused is not None:
                    target, f = fused
                    shard, order = f.shard, f.order
        if engine_format.presplit:
            target = engine_format.engine_name(target, renamed, substrings)
        if not engine_format.presplit:  # whole HF tensors: the engine splits and fuses
            parts = [TPSlice()]
        elif engine_format.replicates(name):  # whole on every engine rank, however the trainer splits it
            parts = [TPSlice(select=b.selects[k]) for b, k in specs[name]]
        elif in_stack:  # one part per expert, in expert order
            parts = sorted((b.tp_slice(k) for b, k in specs[name]), key=lambda p: p.select[1])  # type: ignore[index]
        else:
            parts = [b.tp_slice(k) for b, k in specs[name]]
        padding = engine_format.vocab_padding if name in vocab and engine_format.presplit else 0
        for rank in range(tp):
            if owner is not None and rank != owner[0]:  # an expert lives whole on one engine rank
                continue
            for k, part in enumerate(parts):
                what = name if part.select is None else f"{name}[{part.select[1]}:{part.select[2]}]"
                if padding:
                    cuts, pad = _padded_vocab_cuts(shape, part, padding, tp, rank)
                elif in_stack:
                    cuts, pad = _stacked_expert_cuts(engine_format.stacked_experts, shape, part, tp, rank, what)  # type: ignore[arg-type]
                elif owner is not None:
                    cuts, pad, expert = TPSlice(part.axis, 0, 1, part.select).cuts(shape, what), 0, owner[1]
                else:
                    cuts, pad = TPSlice(part.axis, rank, tp, part.select).cuts(shape, what), 0
                piece = narrow(torch.empty(shape, device="meta"), cuts)
                part_shape = tuple((expert_piece(piece) if in_stack else piece).shape)
                # a fused HF tensor's parts keep their order inside the engine tensor
                key = (order.index(shard) if shard in order else 0, k)
                if in_stack:  # each expert's slice is a row block of its own: engine tensor[expert]
                    expert, key = part.select[1], (0, 0)  # type: ignore[index]
                per_rank[rank].append((target, expert, key, cuts, part_shape, pad, dt))
        pieces[name] = per_rank

    # 2. row offsets inside each engine tensor, per rank (shard order of the engine's fusion)
    slots: dict[str, list[list[Slot]]] = {name: [[] for _ in range(tp)] for name, _, _ in hf}
    engine_tensors: list[list[EngineTensor]] = []
    for rank in range(tp):
        groups: dict[tuple[str, Optional[int]], list[tuple[Any, str, Any]]] = {}
        for name, _, _ in hf:
            for item in pieces[name][rank]:
                groups.setdefault((item[0], item[1]), []).append((item[2], name, item))
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype, set[int]]] = {}
        for (target, expert), items in groups.items():
            items.sort(key=lambda i: i[0])
            keys = [i[0] for i in items]
            if len(set(keys)) != len(keys):
                raise ZooError(f"refit plan: two HF tensors fill the same part of engine tensor {target!r} (expert {expert})")
            rest = items[0][2][4][1:]
            total = sum(i[2][4][0] + i[2][5] for i in items)
            offset = 0
            for _, name, (tgt, exp, _, cuts, shape, pad, dt) in items:
                if tuple(shape[1:]) != tuple(rest):
                    raise ZooError(f"refit plan: parts of engine tensor {target!r} disagree on trailing shape: {shape} vs {rest}")
                slots[name][rank].append(Slot(tgt, name, exp, offset, shape, dt, cuts, pad, total, name in stacked and engine_format.presplit))
                offset += shape[0] + pad
            full = (total, *rest)
            prev = shapes.get(target)
            experts = prev[2] if prev else set()
            if expert is not None:
                experts.add(expert)
            if prev is not None and prev[0] != full:
                raise ZooError(f"refit plan: experts of engine tensor {target!r} disagree on shape: {prev[0]} vs {full}")
            shapes[target] = (full, items[0][2][6], experts)
        tensors = []
        for target, (full, dt, experts) in shapes.items():
            if experts:
                if experts != set(range(len(experts))):
                    raise ZooError(f"refit plan: engine tensor {target!r} gets experts {sorted(experts)}, not 0..{len(experts) - 1}")
                full = (len(experts), *full)
            tensors.append(EngineTensor(target, full, dt))
        engine_tensors.append(tensors)

    # 3. buckets: consecutive HF tensors up to bucket_size bytes (all ranks' shards)
    limit = parse_size(bucket_size)
    buckets: list[list[str]] = []
    used = 0
    for name, _, _ in hf:
        size = sum(s.nbytes for per in slots[name] for s in per)
        if buckets and used + size <= limit:
            buckets[-1].append(name)
            used += size
        else:
            buckets.append([name])
            used = size
    plan = RefitPlan(handle.arch_config.architecture, engine_format, tp, dtype, limit, hf, slots, buckets, engine_tensors)
    _check_tiling(plan)
    return plan


def _padded_vocab_cuts(shape: Sequence[int], part: TPSlice, padding: int, tp: int, rank: int) -> tuple[tuple[Cut, ...], int]:
    """A vocabulary the engine pads to a multiple of ``padding`` rows before splitting it over
    ``tp`` ranks: the cuts of rank ``rank``'s real rows (after the part's select range) and the zero
    rows that follow them."""
    cuts = part.cuts(shape)  # the select range only: the vocabulary is split below
    rows = narrow(torch.empty(shape, device="meta"), cuts).shape[0]
    padded = -(-rows // padding) * padding
    per = padded // tp
    start = min(rank * per, rows)
    real = max(0, min(per, rows - start))
    return (*cuts, (0, start, real)), per - real


def _check_tiling(plan: RefitPlan) -> None:
    """Every engine tensor of every rank is filled by the plan's slots exactly once, row by row
    (:class:`~mcore_zoo.rollout.adapter.RegionCoverage`), and every HF tensor is in one bucket."""
    in_buckets = [name for names in plan.buckets for name in names]
    if sorted(in_buckets) != sorted(name for name, _, _ in plan.hf):
        raise ZooError("refit plan: the buckets do not hold every HF tensor exactly once")
    for rank in range(plan.target_tp):
        coverage = RegionCoverage()
        for per_rank in plan.slots.values():
            for slot in per_rank[rank]:
                coverage.add((rank, slot.name, slot.expert), *slot_rows(slot.offset, slot.shape, slot.pad))
        problems = coverage.problems(planned_regions(plan, rank))
        if problems:
            raise ZooError("refit plan: engine tensors not tiled by the slots: " + "; ".join(problems[:8]))


class RegionCoverage:
    """Which rows of which engine tensors were written, as row intervals: per ``(rank, tensor,
    expert)`` key the ``[start, stop)`` spans (dim 0 of the tensor, or of ``tensor[expert]``).

    Completeness counted in elements passes a refit that writes one slot twice and another never;
    spans do not: :meth:`add` refuses a span that overlaps one already written, and :meth:`gaps`
    names what was left. Every adapter checks its refit with it."""

    def __init__(self) -> None:
        self._spans: dict[Any, list[tuple[int, int]]] = {}

    def add(self, key: Any, start: int, stop: int) -> None:
        """Record rows ``start .. stop`` of ``key``; raises :class:`ZooError` if any of them was
        written already."""
        spans = self._spans.setdefault(key, [])
        for a, b in spans:
            if start < b and a < stop:
                raise ZooError(f"refit writes rows {start}..{stop} of {_key_name(key)} twice (rows {a}..{b} already written)")
        spans.append((start, stop))

    def gaps(self, key: Any, rows: int) -> list[tuple[int, int]]:
        """The row spans of ``key`` (``rows`` rows) nothing wrote."""
        out, at = [], 0
        for a, b in sorted(self._spans.get(key, [])):
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < rows:
            out.append((at, rows))
        return out

    def problems(self, expected: Any) -> list[str]:
        """For every ``(key, rows)`` of ``expected``: the rows left unwritten (and any key written
        that is not expected)."""
        expected = dict(expected)
        found = []
        for key, rows in expected.items():
            missing = self.gaps(key, rows)
            if missing:
                shown = ", ".join(f"{a}..{b}" for a, b in missing[:4])
                found.append(f"{_key_name(key)}: rows {shown} of {rows} never written")
        found += [f"{_key_name(key)}: written, but the plan has no such tensor" for key in self._spans if key not in expected]
        return found


def _key_name(key: Any) -> str:
    rank, name, expert = key
    return f"rank {rank}: {name}" + ("" if expert is None else f"[expert {expert}]")


def planned_regions(plan: RefitPlan, rank: int) -> dict[tuple[int, str, Optional[int]], int]:
    """Engine rank ``rank``'s tensors as :class:`RegionCoverage` keys and their rows: one key per
    tensor, or per expert of a stacked-experts tensor (0-dim tensors count as one row)."""
    stacked = {s.name for per in plan.slots.values() for s in per[rank] if s.expert is not None}
    regions: dict[tuple[int, str, Optional[int]], int] = {}
    for t in plan.engine_tensors[rank]:
        if t.name in stacked:
            for expert in range(t.shape[0]):
                regions[(rank, t.name, expert)] = t.shape[1] if len(t.shape) > 1 else 1
        else:
            regions[(rank, t.name, None)] = t.shape[0] if t.shape else 1
    return regions


def slot_rows(slot_offset: int, shape: Sequence[int], pad: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` a slot fills: its piece and the zero rows after it."""
    rows = shape[0] if len(shape) else 1
    return slot_offset, slot_offset + rows + pad


__all__ = ["Slot", "EngineTensor", "RefitPlan", "plan_refit", "stacked_expert_tensors", "expert_piece", "VOCAB_PARAMETERS", "RegionCoverage", "planned_regions", "slot_rows"]
