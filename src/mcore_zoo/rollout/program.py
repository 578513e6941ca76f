"""The receiving rank's data path for one plan on one model: :class:`RefitProgram`, bound once.

A :class:`~mcore_zoo.rollout.plan.RefitPlan` says where every HF tensor goes; the program says how a
refit gets each engine shard, with everything that does not depend on the weights' values worked
out when it is bound (on the first refit of a plan, then cached on the model's handle:
:func:`program_for`): which parameter each shard comes from, how its view is cut, the order of
the shards in each bucket, the bytes per bucket. A steady-state refit then does per tensor only
the gather (TP / EP > 1), the cut into the engine's layout and the engine's copy.

Two sources of shards:

* ``"local"`` - this rank's export needs no collective (TP, expert TP, EP and PP all 1): every
  shard is a view of the parameter that holds it. How to cut it (``torch.as_strided`` size,
  stride and storage offset relative to the parameter, or "the whole parameter") is worked out
  once per parameter layout, through the transform's views (:func:`~mcore_zoo.weights.export.export_views`)
  and the slot's cuts; a refit reads each parameter by its module path (a replaced parameter is
  followed), checks its dtype, shape and stride (a change re-derives its recipes) and makes each
  view with one call. Each parameter is read when the first bucket that needs it is due, so
  the engine starts copying the first bucket while the later ones' parameters are read. No view
  is kept between refits: a parameter the trainer moves (offloading
  between rollouts) is not held in memory by a refit. An adapter with ``raw_shards`` (the vLLM
  adapter in direct mode) receives the views as they are - q, k and v rows of mcore's per-group
  interleaved ``linear_qkv`` as ``[groups, rows, hidden]`` views - in the parameter's dtype, and
  its engine copies each one straight into its rows of the engine tensor: one copy per shard,
  nothing copied on the trainer side. Other adapters get every shard in the slot's shape and
  dtype: the same view where it has that shape and dtype, else a reshaped / cast copy made per
  refit (q, k, v; a ``dtype`` cast). Rules whose transform has no trusted views (a padded
  vocabulary, a plugin transform) are exported per refit, rule by rule.
* ``"tp-local"`` - every trainer rank feeds its own engine rank (``receiver="all"``), trainer TP
  equals engine TP and the adapter names its engine rank (``adapter.engine_rank``), with PP, VPP
  and EP 1 (:func:`tp_local_source`): each column / row-parallel tensor's engine shard on that
  rank is exactly this trainer rank's TP chunk of it (q / k / v by query group, gate / up, o /
  down, expert projections under expert TP), so it is cut from a view of the local parameter as
  above, with no collective; the cuts are translated from the gathered tensor's coordinates to the
  chunk's (:meth:`~mcore_zoo.weights.rules.TPSlice.within_chunk`). Rules whose engine shard is not this rank's chunk (a vocabulary
  that the trainer and the engine pad differently, a finishing step, a slot needing a whole fused
  tensor) are exported per refit with the TP all-gather, every rank taking part in the same order:
  which rules those are is voted once, when the program is bound, so that every rank issues the
  same gathers. Items go to this rank's engine rank only.
* ``"stream"`` - otherwise: the job-wide export (:func:`~mcore_zoo.distributed.export.iter_hf_weights`:
  gathers over TP / EP, buckets moved over PP). Each HF tensor it yields is checked against the
  plan (name, shape) and cut into its shards (views) with cuts computed once.

Either way each bucket is handed to the adapter as a :class:`~mcore_zoo.rollout.adapter.RefitBucket`
in plan order, so bucketing, the adapter interface and its completeness checks are unchanged.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..distributed.collectives import all_true
from ..distributed.export import tp_gather
from ..errors import ZooError
from ..handle import ModelHandle
from ..weights.export import export_rule, export_views, hf_copies
from ..weights.rules import Cut, RuleStep, TPSlice, narrow
from .plan import RefitPlan, Slot

#: a shard made per refit (a copy, or an export of a rule without trusted views)
_Dynamic = Callable[[], torch.Tensor]
#: one bucket: per engine rank, ``[(slot, shard)]`` in plan order
_Items = list[list[tuple[Slot, torch.Tensor]]]
#: a rule source's part of a fused HF tensor: ``(axis, start, stop)`` (``Source.select``)
_Select = tuple[int, int, int]


def local_source(handle: ModelHandle) -> bool:
    """Whether this rank exports without any collective (TP, expert TP, EP, PP all 1): the
    ``"local"`` source of :class:`RefitProgram`."""
    p = handle.placement
    return p.tp == 1 and p.etp == 1 and p.ep == 1 and p.pp == 1 and p.vpp == 1


def tp_local_source(handle: ModelHandle, target_tp: int, engine_rank: Optional[int]) -> bool:
    """Whether this rank can feed engine rank ``engine_rank`` of a ``target_tp``-way engine from
    its own TP chunks (the ``"tp-local"`` source): trainer TP > 1 equal to ``target_tp``, the same
    rank, PP / VPP / EP 1, expert TP 1 or the dense TP. This rank's answer only: the ranks of a TP
    group must agree before using it (:func:`mcore_zoo.refit` votes)."""
    p = handle.placement
    return (engine_rank is not None and p.tp > 1 and target_tp == p.tp and engine_rank == p.tp_rank
            and p.pp == 1 and p.vpp == 1 and p.ep == 1 and p.etp in (1, p.tp))  # fmt: skip


def program_for(handle: ModelHandle, plan: RefitPlan, *, raw_shards: bool, source: str,
                engine_rank: Optional[int] = None) -> "RefitProgram":  # fmt: skip
    """The :class:`RefitProgram` of ``plan`` on this model for an adapter with (or without)
    ``raw_shards``, from ``source`` (``"local"``: :func:`local_source`; ``"tp-local"``:
    :func:`tp_local_source`, feeding ``engine_rank``; ``"stream"``): bound on first use, cached on
    the handle while the plan lives (the programs of a plan that was garbage-collected are dropped
    at the next binding). Binding a ``"tp-local"`` program is collective over the TP group."""
    programs: dict[tuple[int, bool, str, Optional[int]], RefitProgram] = handle.derived("refit_programs", dict)
    key = (id(plan), raw_shards, source, engine_rank)
    program = programs.get(key)
    if program is None or program.plan_ref() is not plan:
        for k in [k for k, p in programs.items() if p.plan_ref() is None]:
            del programs[k]
        program = programs[key] = RefitProgram(plan, handle.export_steps(), copies=hf_copies(handle.weight_map),
                                               tp_group=handle.placement.groups.tp, raw_shards=raw_shards,
                                               source=source, engine_rank=engine_rank)  # fmt: skip
    return program


class RefitProgram:
    """See the module docstring. :meth:`buckets` runs one refit's data path (the receiving rank)."""

    def __init__(self, plan: RefitPlan, steps: Sequence[RuleStep], *, copies: Mapping[str, Sequence[str]],
                 tp_group: Any, raw_shards: bool, source: str, engine_rank: Optional[int] = None) -> None:  # fmt: skip
        """Bind ``plan`` to the rule steps this rank exports (the model handle's
        :meth:`~mcore_zoo.handle.ModelHandle.export_steps`, what every export reads) and their HF
        ``copies``; ``tp_group``: the group a ``"tp-local"`` program votes over."""
        if source not in ("local", "tp-local", "stream"):
            raise ValueError(f"refit program source {source!r}")
        self.plan_ref = weakref.ref(plan)
        self.raw_shards = raw_shards
        self.source = source
        self.target_tp = plan.target_tp
        #: the one engine rank this program feeds (the adapter's ``engine_rank``), else ``None``:
        #: every engine rank (``"tp-local"`` always has one)
        self.engine_rank = engine_rank
        if source == "tp-local" and engine_rank is None:
            raise ValueError("a 'tp-local' refit program feeds one engine rank")
        #: per bucket: the bytes of the shards this program sends (its engine ranks')
        self.nbytes = [sum(s.nbytes for name in names for r in self._ranks for s in plan.slots[name][r])
                       for names in plan.buckets]  # fmt: skip
        self.tensors = [len(names) for names in plan.buckets]
        #: per bucket, per engine rank: the slots in plan order (what each shard is)
        self.slots = [[[s for name in names for s in plan.slots[name][rank]] for rank in range(plan.target_tp)]
                      for names in plan.buckets]  # fmt: skip
        if self.source == "stream":
            shapes = {name: tuple(shape) for name, shape, _ in plan.hf}
            #: per bucket: what each HF tensor of the export stream is cut into
            self._stream_ops = [
                [_StreamOp(name, shapes[name], [(r, s.cuts) for r in self._ranks for s in plan.slots[name][r]]) for name in names]
                for names in plan.buckets
            ]
        else:
            self._bind_local(steps, copies, plan, tp_group)

    @property
    def _ranks(self) -> list[int]:
        """The engine ranks this program makes shards for."""
        return list(range(self.target_tp)) if self.engine_rank is None else [self.engine_rank]

    # ------------------------------------------------------------------ one refit
    def buckets(self, stream: Optional[Iterator[tuple[str, torch.Tensor]]]) -> Iterator[tuple[int, _Items]]:
        """``(bucket index, items)`` per bucket in plan order, ``items[rank]`` = ``[(slot, shard)]``
        (what :class:`~mcore_zoo.rollout.adapter.RefitBucket` carries). ``stream``: the export
        (``"stream"`` source; ``None`` for ``"local"``). Release each bucket's items before asking
        for the next (they may hold copies: memory stays bounded by one bucket)."""
        if self.source == "stream":
            assert stream is not None
            for index, ops in enumerate(self._stream_ops):
                yield index, self._stream_bucket(index, ops, stream)
            extra = next(stream, None)
            if extra is not None:
                raise ZooError(f"refit: the export has {extra[0]!r}, which the plan does not list")
            return
        try:
            self._bases = [None] * len(self._params)  # type: ignore[list-item]
            self._offsets = [0] * len(self._params)
            for index in range(len(self.slots)):
                # each parameter is read when its first bucket is due, so that the first bucket's
                # copies start while the host reads the parameters of the later ones
                self._refresh(self._first_needed[index])
                self._gather_bucket(index)
                yield index, self._local_bucket(index)
        finally:
            self._bases, self._offsets = [], []  # hold no parameter between refits
            self._memo.clear()

    def _stream_bucket(self, index: int, ops: list["_StreamOp"], stream: Iterator[tuple[str, torch.Tensor]]) -> _Items:
        pieces: list[list[torch.Tensor]] = [[] for _ in self.slots[index]]
        for op in ops:
            name, shape = op.name, op.shape
            got = next(stream, None)
            if got is None:
                raise ZooError(f"refit: the model's export ended before {name!r} (plan made for another model?)")
            got_name, tensor = got
            if got_name != name:
                raise ZooError(f"refit: plan out of step: planned {name!r}, export gave {got_name!r}")
            if tensor.shape != shape:
                raise ZooError(f"refit: {name}: planned shape {shape}, export gave {tuple(tensor.shape)}"
                               " (plan made for another model?)")  # fmt: skip
            for rank, cuts in op.cuts:
                pieces[rank].append(narrow(tensor, cuts))
        return [list(zip(slots, shards)) for slots, shards in zip(self.slots[index], pieces)]  # no shards: no items

    # ------------------------------------------------------------------ the local source
    def _bind_local(self, steps: Sequence[RuleStep], copies: Mapping[str, Sequence[str]], plan: RefitPlan,
                    tp_group: Any) -> None:  # fmt: skip
        """Which parameter (and which of its rule's HF pieces) every shard comes from, with the
        slot's cuts in the coordinates of the piece this rank holds (the whole piece at TP 1, its TP
        chunk for ``"tp-local"``); how it is cut out of the parameter is worked out by
        :meth:`_refresh` (per parameter layout). ``"tp-local"``: the rules some rank cannot serve
        from its chunk are voted over the TP group here and exported gathered on every rank."""
        # a finishing step (a padded vocabulary) works on the gathered tensor only: its rank's
        # rows are not a chunk of the HF tensor
        self._params = [_Param(step, gathered=step.ctx.tp_size > 1 and getattr(step.bound.transform, "finish", None) is not None)
                        for step in steps]  # fmt: skip
        owner = _owners(self._params)
        planned = _check_exports(owner, copies, plan)
        for param in self._params:
            param.planned = {name: planned[name] for name in param.step.bound.hf}
        self._recipes: list[list[list[_Recipe]]] = [[[_NO_RECIPE] * len(s) for s in per] for per in self.slots]
        self._place_uses(plan, owner, planned)
        if self.source == "tp-local":  # the same gathers on every rank: a rule one rank needs gathered, all gather
            served = all_true([not p.gathered for p in self._params], tp_group)
            for param, ok in zip(self._params, served):
                param.gathered = not ok
        #: per bucket: the parameters exported gathered before its shards (every rank, this order;
        #: only ``"tp-local"`` has any)
        self._gathers = [[i for i in dict.fromkeys(owner[name].param for name in names) if self._params[i].gathered]
                         for names in plan.buckets]  # fmt: skip
        #: per bucket: the parameters whose first use (a shard or a gather) is in it
        self._first_needed = _first_needed(self._params, self._gathers)
        self._memo: dict[int, dict[str, torch.Tensor]] = {}
        self._bases: list[torch.Tensor] = []
        self._offsets: list[int] = []

    def _place_uses(self, plan: RefitPlan, owner: dict[str, "_Owner"], planned: dict[str, tuple[int, ...]]) -> None:
        """Every slot of this program's engine ranks as a :class:`_Use` of the parameter that
        exports its HF tensor, at its bucket and position."""
        for bucket, names in enumerate(plan.buckets):
            positions = [0] * plan.target_tp
            for name in names:
                param = self._params[owner[name].param]
                for rank in self._ranks:
                    for slot in plan.slots[name][rank]:
                        param.uses.append(_use_of(param, slot, owner[name].sources, planned[name], bucket, rank, positions[rank]))
                        positions[rank] += 1

    def _refresh(self, indices: list[int]) -> None:
        """This refit's parameters ``indices`` (each read by its module path: a replaced parameter
        is followed), and new recipes for any whose layout (dtype, shape, stride) changed since the
        last refit - none, in a steady state. Recipes do not depend on where the storage is, so a
        parameter moved (offloaded and back) needs none."""
        for index in indices:
            param = self._params[index]
            base = self._bases[index] = param.step.tensor().detach()
            self._offsets[index] = base.storage_offset()
            layout = (base.dtype, base.shape, base.stride())
            if layout != param.layout:
                self._rebind(index, param, base)
                param.layout = layout

    def _rebind(self, index: int, param: _Param, base: torch.Tensor) -> None:
        step = param.step
        meta = torch.empty(base.shape, dtype=base.dtype, device="meta")
        if self.source == "local":
            pieces = export_rule(step.bound, meta, step.ctx)
            shapes = {name: tuple(piece.shape) for name, piece in pieces}
            wanted = param.planned
        else:  # this rank's chunks, before any gather
            shapes = {k: tuple(piece.shape) for k, piece in enumerate(step.bound.transform.split(meta, step.ctx))}
            wanted = {k: shape for k, shape in param.chunk_shapes.items() if not param.gathered}
        for key, shape in wanted.items():
            what = key if isinstance(key, str) else f"{step.bound.hf[key]} (this rank's chunk)"
            _check_planned(what, shape, shapes.get(key))
        views = None if param.gathered else export_views(step.bound, base, step.ctx, chunk=self.source == "tp-local")
        for use in param.uses:
            view = None
            if views is not None and use.source is not None:
                view = _cut_view(views[use.source][2], use.shape, use.cuts)
            recipe = _MadeRecipe(index, self._computed(index, use)) if view is None else self._view_recipe(index, base, view, use.slot)
            self._recipes[use.bucket][use.rank][use.position] = recipe

    def _view_recipe(self, index: int, base: torch.Tensor, view: torch.Tensor, slot: Slot) -> _Recipe:
        """The recipe of a shard that is ``view`` of parameter ``index`` (``base``): the whole
        parameter, or a strided view of it; reshaped / cast per refit unless the adapter takes raw
        shards or the view already has the slot's shape and dtype."""
        exact = self.raw_shards or (tuple(view.shape) == slot.shape and view.dtype == slot.dtype)
        make = None if exact else _reshaped(slot)
        offset = view.storage_offset() - base.storage_offset()
        if (tuple(view.shape), view.stride(), offset) == (tuple(base.shape), base.stride(), 0):
            return _WholeRecipe(index, make)  # the whole parameter: no view to make
        return _ViewRecipe(index, tuple(view.shape), view.stride(), offset, make)

    def _computed(self, index: int, use: _Use) -> _Dynamic:
        """A shard made per refit, cut by the slot from: the rule's gathered HF tensors (a gathered
        ``"tp-local"`` rule: exported by :meth:`_gather_bucket` before the bucket); this rank's
        chunk of its piece (another ``"tp-local"`` rule without views); or the rule's HF tensors
        exported from this rank's tensor once per bucket (the rest: whole tensors here)."""
        raw = self.raw_shards
        param = self._params[index]
        if param.gathered:

            def gathered_shard() -> torch.Tensor:
                hf = self._memo.get(index)
                if hf is None:  # _gather_bucket runs the bucket's gathers first: a bug if not
                    raise ZooError(f"refit: {use.name}: gathered export missing for bucket {use.bucket}")
                piece = use.slot.cut(hf[use.name])
                return piece if raw else piece.to(use.slot.dtype)

            return gathered_shard
        if self.source == "tp-local" and use.source is not None:

            def chunk_shard() -> torch.Tensor:
                step = param.step
                piece = narrow(step.bound.transform.split(self._bases[index], step.ctx)[use.source], use.cuts)
                return piece if raw else piece.reshape(use.slot.shape).to(use.slot.dtype)

            return chunk_shard

        def shard() -> torch.Tensor:
            hf = self._memo.get(index)
            if hf is None:
                step = param.step
                hf = self._memo[index] = dict(export_rule(step.bound, self._bases[index], step.ctx))
            piece = use.slot.cut(hf[use.name])
            return piece if raw else piece.to(use.slot.dtype)

        return shard

    def _gather_bucket(self, index: int) -> None:
        """``"tp-local"``: export the bucket's gathered rules (all-gathered over their TP group; every
        rank of the group runs the same list in the same order), checked against the plan."""
        for i in self._gathers[index]:
            step = self._params[i].step
            hf = dict(export_rule(step.bound, self._bases[i], step.ctx, gather=tp_gather(step)))
            for name, tensor in hf.items():
                _check_planned(name, self._params[i].planned[name], tuple(tensor.shape))
            self._memo[i] = hf

    def _local_bucket(self, index: int) -> _Items:
        bases, offsets = self._bases, self._offsets
        items: _Items = [[] for _ in range(self.target_tp)]
        for rank in self._ranks:
            shards = [recipe.shard(bases, offsets) for recipe in self._recipes[index][rank]]
            items[rank] = list(zip(self.slots[index][rank], shards))
        self._memo.clear()
        return items


@dataclass(frozen=True)
class _StreamOp:
    """One HF tensor of the export stream: its name, planned shape and, per shard in slot order,
    ``(engine rank, cuts)``."""

    name: str
    shape: tuple[int, ...]
    cuts: list[tuple[int, tuple[Cut, ...]]]


@dataclass(eq=False)
class _Param:
    """One exported mcore tensor of the local sources: its rule step (rule, tensor reference,
    transform context with this rank's TP slot), the shards it feeds, the planned shape of each
    of its HF tensors, the shape of this rank's chunk of each source piece they use, the layout its
    recipes were made for, and whether it is exported gathered (``"tp-local"``)."""

    step: RuleStep
    uses: list["_Use"] = field(default_factory=list)
    planned: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunk_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    layout: Any = None
    gathered: bool = False

    @property
    def tp_size(self) -> int:
        return self.step.ctx.tp_size

    def chunk_slice(self, source: int) -> TPSlice:
        """This rank's TP slice of rule source ``source`` (its whole piece: no select)."""
        return TPSlice(self.step.bound.tp_axes[source], self.step.ctx.tp_rank, self.step.ctx.tp_size)


@dataclass(frozen=True)
class _Use:
    """One shard of a parameter: where it sits (bucket, engine rank, position), its slot and HF
    name, the rule source it is cut from (``None``: export the rule), that source's piece shape
    and the cuts left (in the piece's coordinates)."""

    bucket: int
    rank: int
    position: int
    slot: Slot
    name: str
    source: Optional[int]
    shape: tuple[int, ...]
    cuts: tuple[Cut, ...]


@dataclass(frozen=True)
class _Owner:
    """The parameter that exports an HF tensor and its rule sources for it: ``(source index,
    select)`` (``select``: the source's part of a fused HF tensor, ``None``: all of it)."""

    param: int
    sources: list[tuple[int, Optional[_Select]]]


@dataclass(frozen=True)
class _Recipe:
    """How a refit makes one shard from the bases (the parameters as read for this refit)."""

    param: int

    def shard(self, bases: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class _WholeRecipe(_Recipe):
    """The whole parameter, through ``make`` (a reshape / cast; ``None``: as it is)."""

    make: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
        base = bases[self.param]
        return base if self.make is None else self.make(base)


@dataclass(frozen=True)
class _ViewRecipe(_Recipe):
    """A view of the parameter (``torch.as_strided``: ``size``, ``stride``, storage ``offset``
    relative to the parameter's), through ``make`` (``None``: as it is)."""

    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0
    make: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
        view = torch.as_strided(bases[self.param], self.size, self.stride, offsets[self.param] + self.offset)
        return view if self.make is None else self.make(view)


@dataclass(frozen=True)
class _MadeRecipe(_Recipe):
    """A shard made per refit by ``make()`` (an export of the rule, a cut of its gathered tensors)."""

    make: Optional[_Dynamic] = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int]) -> torch.Tensor:
        return self.make()  # type: ignore[misc]


#: a slot no recipe was bound for yet (every slot of a bound program has one)
_NO_RECIPE = _Recipe(-1)


def _owners(params: list[_Param]) -> dict[str, _Owner]:
    """HF name -> the parameter exporting it and the rule sources that make it."""
    owner: dict[str, _Owner] = {}
    for index, param in enumerate(params):
        bound = param.step.bound
        for k, (name, select) in enumerate(zip(bound.hf, bound.selects)):
            owner.setdefault(name, _Owner(index, [])).sources.append((k, select))
    return owner


def _check_exports(owner: dict[str, _Owner], copies: Mapping[str, Sequence[str]], plan: RefitPlan) -> dict[str, tuple[int, ...]]:
    """The plan's HF tensors and what this model exports must be the same; returns their planned
    shapes."""
    exported = set(owner) | {c for name in owner for c in copies.get(name, ())}
    planned = {name: tuple(shape) for name, shape, _ in plan.hf}
    for name in planned:
        if name not in owner:
            raise ZooError(f"refit: plan lists {name!r}, which this model does not export (plan made for another model?)")
    extra = sorted(exported - set(planned))
    if extra:
        raise ZooError(f"refit: the export has {extra[0]!r}, which the plan does not list")
    return planned


def _use_of(param: _Param, slot: Slot, sources: list[tuple[int, Optional[_Select]]], planned: tuple[int, ...],
            bucket: int, rank: int, position: int) -> _Use:  # fmt: skip
    """The use of ``param`` by ``slot``: cut from this rank's chunk of one rule source where the
    slot lies inside it, else (``source`` ``None``) from the rule's export - gathered under TP
    (the parameter is then marked ``gathered``); at TP 1 (a slot of a whole fused HF tensor)
    this rank's export has it all."""
    source, part, cuts = _piece_of(slot, sources)
    shape = list(planned)  # the source's piece of the HF tensor, gathered
    if part is not None:
        shape[part[0]] = part[2]
    held = None if source is None else param.chunk_slice(source).within_chunk(tuple(shape), cuts)
    if held is None:  # the slot needs more than this rank's piece
        param.gathered = param.gathered or param.tp_size > 1
        return _Use(bucket, rank, position, slot, slot.hf_name, None, tuple(shape), cuts)
    param.chunk_shapes[source] = held[0]  # type: ignore[index]
    return _Use(bucket, rank, position, slot, slot.hf_name, source, *held)


def _first_needed(params: list[_Param], gathers: list[list[int]]) -> list[list[int]]:
    """Per bucket, the parameters whose first use (a shard or a gather) is in it."""
    first: dict[int, int] = {}
    for b, indices in enumerate(gathers):
        for i in indices:
            first.setdefault(i, b)
    for i, param in enumerate(params):
        for use in param.uses:
            first[i] = min(first.get(i, use.bucket), use.bucket)
    out: list[list[int]] = [[] for _ in gathers]
    for i, b in sorted(first.items()):
        out[b].append(i)
    return out


def _piece_of(slot: Slot, sources: list[tuple[int, Optional[_Select]]]) -> tuple[Optional[int], Optional[Cut], tuple[Cut, ...]]:
    """Which of its rule's sources a slot is cut from, that source's part of the HF tensor (its
    ``select`` as a cut, ``None``: all of it) and the cuts left; source ``None`` when the slot
    needs the whole fused HF tensor."""
    if len(sources) == 1 and sources[0][1] is None:
        return sources[0][0], None, slot.cuts
    if slot.cuts:
        first = slot.cuts[0]
        for source, select in sources:
            if select is not None and (select[0], select[1], select[2] - select[1]) == first:
                return source, first, slot.cuts[1:]
    return None, None, slot.cuts


def _check_planned(what: str, planned: tuple[int, ...], got: Optional[tuple[int, ...]]) -> None:
    """Raise unless the model's piece ``what`` has the shape the plan was made for."""
    if got != planned:
        raise ZooError(f"refit: {what}: planned shape {planned}, the model's is {got} (plan made for another model?)")


def _cut_view(view: torch.Tensor, shape: tuple[int, ...], cuts: tuple[Cut, ...]) -> Optional[torch.Tensor]:
    """``cuts`` (``narrow`` steps in the HF piece's coordinates, ``shape``) applied to ``view``,
    which holds the piece in row-major order with its first dimension possibly split
    (``[*lead, *shape[1:]]``, ``prod(lead) == shape[0]``). ``None`` where that does not hold or a
    cut of the first dimension does not fall on whole rows of ``lead``'s inner part."""
    if not shape:
        return view if view.dim() == 0 and not cuts else None
    extra = view.dim() - len(shape)
    if extra < 0 or tuple(view.shape[extra + 1 :]) != tuple(shape[1:]) or math.prod(view.shape[: extra + 1]) != shape[0]:
        return None
    inner = math.prod(view.shape[1 : extra + 1])
    for axis, start, length in cuts:
        if axis:
            view = view.narrow(axis + extra, start, length)
        elif start % inner or length % inner:
            return None
        else:
            view = view.narrow(0, start // inner, length // inner)
    return view


def _reshaped(slot: Slot) -> Callable[[torch.Tensor], torch.Tensor]:
    """A view in the slot's shape and dtype (a copy, made per refit, unless both already fit)."""
    return lambda view: view.reshape(slot.shape).to(slot.dtype)


__all__ = ["RefitProgram", "program_for", "local_source", "tp_local_source"]
