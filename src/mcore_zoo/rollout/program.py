"""The receiving rank's data path for one plan on one model: :class:`RefitProgram`, bound once.

A :class:`~mcore_zoo.rollout.plan.RefitPlan` says where every HF tensor goes; the program says how a
refit gets each engine shard, with everything that does not depend on the weights' values worked
out when it is bound (on the first refit of a plan, then cached on the model's handle:
:func:`program_for`): which parameter each shard comes from, how its view is cut, the order of
the shards in each bucket, the bytes per bucket. The program is bound to the rule steps the
handle hands every export (:meth:`~mcore_zoo.handle.ModelHandle.export_steps`); each shard's
recipe is a small dataclass (the whole parameter, a strided view of it, a cut of the rule's export
or of its gathered export, a cut of this rank's chunk). A steady-state refit then does per tensor
only the gather (TP / EP > 1), the cut into the engine's layout and the engine's copy.

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
  chunk's (:meth:`~mcore_zoo.weights.rules.TPSlice.within_chunk`). Rules whose engine shard is not
  this rank's chunk (a vocabulary that the trainer and the engine pad differently, a finishing
  step, a slot needing a whole fused tensor) are exported per refit with the TP all-gather, every rank taking part in the same order:
  which rules those are is voted once, when the program is bound, so that every rank issues the
  same gathers. Items go to this rank's engine rank only.
* ``"stream"`` - otherwise: the job-wide export of the same steps
  (:func:`~mcore_zoo.distributed.export.hf_items`: gathers over TP / EP, buckets moved over PP). Each HF tensor it yields is checked against the
  plan (name, shape) and cut into its shards (views) with cuts computed once.

Either way each bucket is handed to the adapter as a :class:`~mcore_zoo.rollout.adapter.RefitBucket`
in plan order, so bucketing, the adapter interface and its completeness checks are unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from ..distributed.collectives import all_true
from ..distributed.export import tp_gather
from ..errors import ZooError
from ..handle import ModelHandle
from ..weights.export import check_planned_shape, export_rule, export_views
from ..weights.rules import Cut, RuleStep, TPSlice, narrow, narrow_view, split_shapes, strided_layout
from .plan import RefitPlan, Slot, stacked_expert_tensors

#: one bucket: per engine rank, ``[(slot, shard)]`` in plan order
_Items = list[list[tuple[Slot, torch.Tensor]]]
#: a rule source's part of a fused HF tensor: ``(axis, start, stop)`` (``Source.select``)
_Select = tuple[int, int, int]


def local_source(handle: ModelHandle) -> bool:
    """Whether this rank exports without any collective (TP, expert TP, EP, PP all 1): the
    ``"local"`` source of :class:`RefitProgram`. Never for a model with stacked-experts HF tensors
    (:func:`~mcore_zoo.rollout.plan.stacked_expert_tensors`: one HF tensor from one parameter per
    expert, assembled by the export stream)."""
    p = handle.placement
    return not stacked_expert_tensors(handle) and p.tp == 1 and p.etp == 1 and p.ep == 1 and p.pp == 1 and p.vpp == 1


def tp_local_source(handle: ModelHandle, target_tp: int, engine_rank: Optional[int]) -> bool:
    """Whether this rank can feed engine rank ``engine_rank`` of a ``target_tp``-way engine from
    its own TP chunks (the ``"tp-local"`` source): trainer TP > 1 equal to ``target_tp``, the same
    rank, PP / VPP / EP 1, expert TP 1 or the dense TP, no stacked-experts HF tensors. This rank's
    answer only: the ranks of a TP group must agree before using it (:func:`mcore_zoo.refit` votes)."""
    p = handle.placement
    return (engine_rank is not None and not stacked_expert_tensors(handle) and p.tp > 1 and target_tp == p.tp and engine_rank == p.tp_rank
            and p.pp == 1 and p.vpp == 1 and p.ep == 1 and p.etp in (1, p.tp))  # fmt: skip


def program_for(handle: ModelHandle, plan: RefitPlan, steps: Sequence[RuleStep], copies: Mapping[str, Sequence[str]], *,
                raw_shards: bool, source: str, engine_rank: Optional[int] = None) -> "RefitProgram":  # fmt: skip
    """The :class:`RefitProgram` of ``plan`` on this model - its export ``steps`` and HF ``copies``
    (the handle's :meth:`~mcore_zoo.handle.ModelHandle.export_steps`, what every export reads) -
    for an adapter with (or without) ``raw_shards``, from ``source`` (``"local"``:
    :func:`local_source`; ``"tp-local"``: :func:`tp_local_source`, feeding ``engine_rank``;
    ``"stream"``): bound on first use, cached on the handle while the plan lives (the programs of a
    plan that was garbage-collected are dropped at the next binding; all of them when a chunk is
    attached). Binding a ``"tp-local"`` program is collective over the TP group."""
    programs: dict[tuple[int, bool, str, Optional[int]], RefitProgram] = handle.derived("refit_programs", dict)
    key = (id(plan), raw_shards, source, engine_rank)
    program = programs.get(key)
    if program is None or program.plan_ref() is not plan:
        for k in [k for k, p in programs.items() if p.plan_ref() is None]:
            del programs[k]
        program = programs[key] = RefitProgram(plan, steps, copies=copies, tp_group=handle.placement.groups.tp,
                                               raw_shards=raw_shards, source=source, engine_rank=engine_rank)  # fmt: skip
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
        if source != "stream" and any(s.expert_slice for per in plan.slots.values() for slots in per for s in slots):
            raise ValueError("a plan with stacked-experts slots is cut from the export stream (source 'stream')")
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
                [_StreamOp(name, shapes[name], [(r, s) for r in self._ranks for s in plan.slots[name][r]]) for name in names]
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
        (``"stream"`` source; ``None`` for the local ones). Release each bucket's items before
        asking for the next (they may hold copies: memory stays bounded by one bucket)."""
        if self.source != "stream":
            try:
                self._bases = [None] * len(self._params)  # type: ignore[list-item]
                self._offsets = [0] * len(self._params)
                for index in range(len(self.slots)):
                    yield index, self._local_bucket(index)
            finally:
                self._bases, self._offsets = [], []  # hold no parameter between refits
                self._memo.clear()
            return
        assert stream is not None
        for index, ops in enumerate(self._stream_ops):
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
                for rank, slot in op.cuts:
                    pieces[rank].append(slot.cut(tensor))
            yield index, [list(zip(slots, shards)) for slots, shards in zip(self.slots[index], pieces)]  # no shards: no items
        extra = next(stream, None)
        if extra is not None:
            raise ZooError(f"refit: the export has {extra[0]!r}, which the plan does not list")

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
        #: per bucket: the parameters whose first use (a shard or a gather) is in it - the first
        #: bucket with one of their HF tensors (every HF tensor has a slot on every engine rank)
        self._first_needed = _first_needed(len(self._params), [[owner[name].param for name in names] for names in plan.buckets])
        self._recipes: list[list[list[_Recipe]]] = [[[_NO_RECIPE] * len(s) for s in per] for per in self.slots]
        self._place_uses(plan, owner, planned)
        if self.source == "tp-local":  # the same gathers on every rank: a rule one rank needs gathered, all gather
            served = all_true([not p.gathered for p in self._params], tp_group)
            for param, ok in zip(self._params, served):
                param.gathered = not ok
        #: per bucket: the parameters exported gathered before its shards, with their TP gathers
        #: (every rank, this order; only ``"tp-local"`` has any)
        self._gathers = [[(i, tp_gather(self._params[i].step))
                          for i in dict.fromkeys(owner[name].param for name in names) if self._params[i].gathered]
                         for names in plan.buckets]  # fmt: skip
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

    def _local_bucket(self, index: int) -> _Items:
        """Bucket ``index`` from the local source: the parameters it is the first to need read
        (:meth:`_refresh`), so that the first bucket's copies start while the host reads the
        parameters of the later ones; its gathered rules exported (``"tp-local"``: all-gathered over
        their TP group, every rank of the group in the same order, checked against the plan); then
        every shard made by its recipe."""
        for i in self._first_needed[index]:
            self._refresh(i)
        bases, offsets, memo = self._bases, self._offsets, self._memo
        for i, gather in self._gathers[index]:
            step = self._params[i].step
            hf = memo[i] = dict(export_rule(step.bound, bases[i], step.ctx, gather=gather))
            for name, tensor in hf.items():
                check_planned_shape(name, self._params[i].planned[name], tuple(tensor.shape))
        items: _Items = [[] for _ in range(self.target_tp)]
        for rank in self._ranks:
            shards = [recipe.shard(bases, offsets, memo) for recipe in self._recipes[index][rank]]
            items[rank] = list(zip(self.slots[index][rank], shards))
        memo.clear()
        return items

    def _refresh(self, index: int) -> None:
        """This refit's parameter ``index`` (read by its module path: a replaced parameter is
        followed), and new recipes for its shards if its layout (dtype, shape, stride) changed since
        the last refit - never, in a steady state. Recipes do not depend on where the storage is, so
        a parameter moved (offloaded and back) needs none. Shards are views of the parameter where
        the rule's transform gives trusted views of its HF pieces, else made per refit."""
        param = self._params[index]
        step = param.step
        base = self._bases[index] = step.tensor().detach()
        self._offsets[index] = base.storage_offset()
        layout = (base.dtype, base.shape, base.stride())
        if layout == param.layout:
            return
        if self.source == "local":
            pieces = export_rule(step.bound, torch.empty(base.shape, dtype=base.dtype, device="meta"), step.ctx)
            shapes = {name: tuple(piece.shape) for name, piece in pieces}
            wanted = param.planned
        else:  # this rank's chunks, before any gather
            shapes = dict(enumerate(split_shapes(step.bound.transform, base.shape, step.ctx, base.dtype)))
            wanted = {k: shape for k, shape in param.chunk_shapes.items() if not param.gathered}
        for key, shape in wanted.items():
            what = key if isinstance(key, str) else f"{step.bound.hf[key]} (this rank's chunk)"
            check_planned_shape(what, shape, shapes.get(key))
        views = None if param.gathered else export_views(step.bound, base, step.ctx, chunk=self.source == "tp-local")
        for use in param.uses:
            view = None
            if views is not None and use.source is not None:
                view = narrow_view(views[use.source][2], use.shape, use.cuts)
            slot, dtype = use.slot, None if self.raw_shards else use.slot.dtype
            recipe: _Recipe
            if view is not None:
                exact = self.raw_shards or (tuple(view.shape) == slot.shape and view.dtype == slot.dtype)
                cast = None if exact else (slot.shape, slot.dtype)  # a copy, made per refit
                layout_of_view = strided_layout(base, view)
                recipe = _WholeRecipe(index, cast) if layout_of_view is None else _ViewRecipe(index, cast, *layout_of_view)
            elif param.gathered:  # exported gathered before the bucket (the bucket's gathers)
                recipe = _GatheredRecipe(index, use.name, slot.cuts, dtype, use.bucket)
            elif self.source == "tp-local" and use.source is not None:  # this rank's chunk of its piece
                recipe = _ChunkRecipe(index, step, use.source, use.cuts, None if self.raw_shards else (slot.shape, slot.dtype))
            else:  # the rule's HF tensors, exported from this rank's tensor once per bucket
                recipe = _ExportRecipe(index, step, use.name, slot.cuts, dtype)
            self._recipes[use.bucket][use.rank][use.position] = recipe
        param.layout = layout


@dataclass(frozen=True)
class _StreamOp:
    """One HF tensor of the export stream: its name, planned shape and, per shard in slot order,
    ``(engine rank, slot)`` (:meth:`~mcore_zoo.rollout.plan.Slot.cut` takes the shard out)."""

    name: str
    shape: tuple[int, ...]
    cuts: list[tuple[int, Slot]]


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
    """How a refit makes one shard of parameter ``param``, from the bases (the parameters as read
    for this refit), their storage offsets and the bucket's exported HF tensors per parameter."""

    param: int

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        raise NotImplementedError


#: reshape and cast a shard to the slot's ``(shape, dtype)`` (a copy per refit); ``None``: as it is
_Cast = Optional[tuple[tuple[int, ...], torch.dtype]]


def _cast(tensor: torch.Tensor, cast: _Cast) -> torch.Tensor:
    return tensor if cast is None else tensor.reshape(cast[0]).to(cast[1])


@dataclass(frozen=True)
class _WholeRecipe(_Recipe):
    """The whole parameter."""

    cast: _Cast = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        return _cast(bases[self.param], self.cast)


@dataclass(frozen=True)
class _ViewRecipe(_Recipe):
    """A view of the parameter (``torch.as_strided``: ``size``, ``stride``, storage ``offset``
    relative to the parameter's)."""

    cast: _Cast = None
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        view = torch.as_strided(bases[self.param], self.size, self.stride, offsets[self.param] + self.offset)
        return _cast(view, self.cast)


@dataclass(frozen=True)
class _ExportRecipe(_Recipe):
    """The slot's cuts of HF tensor ``name``, exported from this rank's tensor (once per bucket, for
    all the shards of the rule), cast to ``dtype`` (``None``: as it is)."""

    step: Optional[RuleStep] = None
    name: str = ""
    cuts: tuple[Cut, ...] = ()
    dtype: Optional[torch.dtype] = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        hf = memo.get(self.param)
        if hf is None:
            step = self.step
            hf = memo[self.param] = dict(export_rule(step.bound, bases[self.param], step.ctx))  # type: ignore[union-attr]
        piece = narrow(hf[self.name], self.cuts)
        return piece if self.dtype is None else piece.to(self.dtype)


@dataclass(frozen=True)
class _GatheredRecipe(_Recipe):
    """The slot's cuts of HF tensor ``name`` exported gathered before bucket ``bucket`` (its
    ``"tp-local"`` gathers), cast to ``dtype`` (``None``: as it is)."""

    name: str = ""
    cuts: tuple[Cut, ...] = ()
    dtype: Optional[torch.dtype] = None
    bucket: int = 0

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        hf = memo.get(self.param)
        if hf is None:  # the bucket's gathers run first: a bug if not
            raise ZooError(f"refit: {self.name}: gathered export missing for bucket {self.bucket}")
        piece = narrow(hf[self.name], self.cuts)
        return piece if self.dtype is None else piece.to(self.dtype)


@dataclass(frozen=True)
class _ChunkRecipe(_Recipe):
    """The ``cuts`` of this rank's chunk of rule source ``source`` (``"tp-local"``, a transform
    without trusted views)."""

    step: Optional[RuleStep] = None
    source: int = 0
    cuts: tuple[Cut, ...] = ()
    cast: _Cast = None

    def shard(self, bases: list[torch.Tensor], offsets: list[int], memo: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        step = self.step
        piece = narrow(step.bound.transform.split(bases[self.param], step.ctx)[self.source], self.cuts)  # type: ignore[union-attr]
        return _cast(piece, self.cast)


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


def _first_needed(params: int, owners: list[list[int]]) -> list[list[int]]:
    """Per bucket, the parameters (of ``params``) whose first bucket it is; ``owners``: per bucket,
    the parameters owning its HF tensors."""
    first: dict[int, int] = {}
    for b, indices in enumerate(owners):
        for i in indices:
            first.setdefault(i, b)
    out: list[list[int]] = [[] for _ in owners]
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


__all__ = ["RefitProgram", "program_for", "local_source", "tp_local_source"]
