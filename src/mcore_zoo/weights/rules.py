"""The declarative HF <-> Megatron-Core weight table.

One :class:`Rule` says: this mcore parameter is made from these HF tensors by this transform, and
each HF tensor is split across tensor-parallel ranks along this axis. Everything else derives from
the rules: loading (any TP rank reads only its chunk of each HF tensor, then fuses), export (split,
then gather each HF piece along its axis), re-sharding for an inference TP size, coverage checks
(every mcore parameter has a source, every checkpoint tensor is consumed or explicitly ignored) and
the round-trip test.

Templates use ``{layer}`` (decoder layer) and ``{expert}`` (MoE expert) placeholders. In mcore names
they are *local* indices (within this pipeline stage / expert-parallel rank), in HF names *global*
ones; :meth:`WeightMap.bind` maps between them from the built model.

Canonical mcore names are those of the ``local`` spec (``input_layernorm.weight``...). Backends
that fuse a norm into the following linear (TE: ``linear_qkv.layer_norm_weight``) are resolved
through :data:`FUSED_NORM_ALIASES`, and Transformer Engine's grouped-GEMM experts
(``mlp.experts.linear_fc1.weight{i}`` for the sequential ``mlp.experts.local_experts.{i}.linear_fc1.weight``)
through :func:`grouped_expert_name`, so one table serves every backend and expert module.

Tensor-parallel chunks of every fused parameter are contiguous per HF source: QKV is interleaved
per query group (rank r owns groups ``[r*G/tp, (r+1)*G/tp)``, i.e. a contiguous block of q, of k and
of v rows), gate/up are split per half before concatenation. So a TP rank reads chunk ``r`` of each
source along its axis and fuses the chunks with the same transform as at TP=1.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..config.arch import ArchConfig
from ..errors import LayoutError, UnsupportedLayoutError, WeightMapError

#: canonical (local-spec) suffix -> alternative suffix used by backends that fuse norms into linears
FUSED_NORM_ALIASES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


#: ``tensor.narrow(axis, start, length)``: one step of a cut
Cut = tuple[int, int, int]


def narrow(tensor: torch.Tensor, cuts: Sequence[Cut]) -> torch.Tensor:
    """``tensor`` with every ``narrow(axis, start, length)`` step of ``cuts`` applied (a view)."""
    for axis, start, length in cuts:
        tensor = tensor.narrow(axis, start, length)
    return tensor


def narrow_view(view: torch.Tensor, shape: tuple[int, ...], cuts: Sequence[Cut]) -> Optional[torch.Tensor]:
    """``cuts`` (``narrow`` steps in the coordinates of a piece of ``shape``) applied to ``view``,
    which holds the piece in row-major order with its first dimension possibly split
    (``[*lead, *shape[1:]]``, ``prod(lead) == shape[0]``: a transform's view, :meth:`Transform.views`).
    ``None`` where that does not hold or a cut of the first dimension does not fall on whole rows of
    ``lead``'s inner part."""
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


def strided_layout(base: torch.Tensor, view: torch.Tensor) -> Optional[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """``(size, stride, storage offset relative to base)`` that ``torch.as_strided`` remakes
    ``view`` of ``base`` from; ``None`` when ``view`` is all of ``base`` (no view to make)."""
    layout = (tuple(view.shape), tuple(view.stride()), view.storage_offset() - base.storage_offset())
    return None if layout == (tuple(base.shape), tuple(base.stride()), 0) else layout


class _computed_once:
    """A read-only attribute computed on first access and kept in the instance's ``__dict__``
    (later reads find it there, not here): ``functools.cached_property`` without its lock, which
    Python 3.11 takes on every first access - thousands per load of an MoE model's bound rules."""

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        self.compute, self.name = compute, compute.__name__
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.compute(instance)
        return value


@dataclass(frozen=True)
class TPSlice:
    """Rank ``rank`` of ``size`` tensor-parallel ranks' share of one rule source: the ``select``
    range of the HF tensor (all of it when ``None``), cut into ``size`` equal chunks along ``axis``
    (``None``: replicated, every rank holds the whole range). The one definition of "rank r's slice
    of source i": loading reads it, export re-splits gathered tensors with it, the refit plan cuts
    engine shards with it and the refit program finds a shard inside a rank's chunk with it."""

    axis: Optional[int] = None
    rank: int = 0
    size: int = 1
    select: Optional[Cut] = None

    def box(self, shape: Sequence[int], what: str = "tensor") -> list[tuple[int, int]]:
        """``[(start, stop)]`` per dimension of ``shape`` that this slice holds. Raises
        :class:`~mcore_zoo.errors.LayoutError` when the select range does not fit ``shape`` or the
        range does not divide into ``size`` chunks."""
        bounds = [(0, n) for n in shape]
        if self.select is not None:
            axis, start, stop = self.select
            if stop > shape[axis]:
                raise LayoutError(f"{what} dim {axis} = {shape[axis]} has no range [{start}, {stop})")
            bounds[axis] = (start, stop)
        if self.axis is not None and self.size > 1:
            lo, hi = bounds[self.axis]
            if (hi - lo) % self.size:
                raise LayoutError(f"{what} dim {self.axis} range {hi - lo} is not divisible into {self.size} chunks")
            step = (hi - lo) // self.size
            bounds[self.axis] = (lo + self.rank * step, lo + (self.rank + 1) * step)
        return bounds

    def cuts(self, shape: Sequence[int], what: str = "tensor") -> tuple[Cut, ...]:
        """:meth:`box` as ``narrow`` steps: the select range (when there is one), then this rank's
        chunk inside it (when split); ``()`` for the whole tensor."""
        box = self.box(shape, what)
        out: list[Cut] = []
        base = 0
        if self.select is not None:
            axis, start, stop = self.select
            out.append((axis, start, stop - start))
            base = start if axis == self.axis else 0
        if self.axis is not None and self.size > 1:
            lo, hi = box[self.axis]
            out.append((self.axis, lo - base, hi - lo))
        return tuple(out)

    def index(self, shape: Sequence[int], what: str = "tensor") -> Optional[tuple[slice, ...]]:
        """:meth:`box` as an index (trailing whole dimensions dropped; ``None``: everything)."""
        index = [slice(lo, hi) for lo, hi in self.box(shape, what)]
        while index and index[-1] == slice(0, shape[len(index) - 1]):
            index.pop()
        return tuple(index) or None

    def cut(self, tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
        """This slice of ``tensor`` (a view)."""
        return narrow(tensor, self.cuts(tuple(tensor.shape), what))

    def within_chunk(self, shape: Sequence[int], cuts: Sequence[Cut]) -> Optional[tuple[tuple[int, ...], tuple[Cut, ...]]]:
        """``cuts`` of a whole (gathered) piece of ``shape``, translated into the coordinates of the
        chunk this slice holds (``select`` is not used: ``shape`` is the piece): ``(chunk shape,
        cuts)``. ``None`` when they do not lie inside that chunk (they need other ranks' rows), cut
        the split axis more than once, or the piece does not split evenly."""
        axis = self.axis
        if axis is None or self.size == 1:
            return tuple(shape), tuple(cuts)
        length, rest = divmod(shape[axis], self.size)
        if rest:
            return None
        chunk = (*shape[:axis], length, *shape[axis + 1 :])
        lo, out, seen = self.rank * length, [], False
        for cut_axis, start, n in cuts:
            if cut_axis != axis:
                out.append((cut_axis, start, n))
                continue
            if seen or start < lo or start + n > lo + length:
                return None
            seen = True
            if n != length:
                out.append((axis, start - lo, n))
        return (chunk, tuple(out)) if seen else None


@dataclass(frozen=True)
class TransformContext:
    """What a transform needs to know: the architecture and this rank's tensor-parallel slot."""

    arch: ArchConfig
    tp_rank: int = 0
    tp_size: int = 1


class Transform:
    """HF pieces <-> one mcore tensor. Works on this rank's TP chunk of every piece."""

    name = "transform"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        raise NotImplementedError

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        raise NotImplementedError

    def mcore_axis(self, source: int, hf_axis: Optional[int]) -> Optional[int]:
        """The axis of the mcore tensor that source ``source``'s tensor-parallel axis ``hf_axis``
        becomes (the same axis unless the transform transposes)."""
        return hf_axis

    def views(self, out: torch.Tensor, ctx: TransformContext) -> Optional[list[torch.Tensor]]:
        """Optional: views of ``out`` such that filling view ``i`` with piece ``i`` (same number of
        elements, row-major order) gives ``fuse(pieces)``. Lets loading read every piece straight
        into the parameter; ``None`` (the default) means pieces are read, fused, then copied."""
        return None

    def __repr__(self) -> str:
        return self.name


class Identity(Transform):
    name = "identity"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        (piece,) = pieces
        return piece

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return [tensor]

    def views(self, out: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return [out]


class FuseQKV(Transform):
    """q, k, v projections (weights ``[rows, in]`` or biases ``[rows]``) -> mcore ``linear_qkv``.

    mcore's layout is interleaved per query group: for each group g, the ``heads_per_group`` query
    heads of g, then g's key head, then g's value head.
    """

    name = "qkv-interleave"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        q, k, v = pieces
        hd = ctx.arch.head_dim
        groups = k.shape[0] // hd
        rest = q.shape[1:]
        q = q.reshape(groups, ctx.arch.heads_per_group * hd, *rest)
        k = k.reshape(groups, hd, *rest)
        v = v.reshape(groups, hd, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        hd = ctx.arch.head_dim
        per_group = (ctx.arch.heads_per_group + 2) * hd
        rest = tensor.shape[1:]
        groups = tensor.shape[0] // per_group
        t = tensor.reshape(groups, per_group, *rest)
        q_rows = ctx.arch.heads_per_group * hd
        q = t[:, :q_rows].reshape(-1, *rest)
        k = t[:, q_rows : q_rows + hd].reshape(-1, *rest)
        v = t[:, q_rows + hd :].reshape(-1, *rest)
        return [q, k, v]

    def views(self, out: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        hd = ctx.arch.head_dim
        q_rows = ctx.arch.heads_per_group * hd
        rest = out.shape[1:]
        t = out.view(-1, q_rows + 2 * hd, *rest)  # [groups, per_group, ...]
        return [t[:, :q_rows], t[:, q_rows : q_rows + hd], t[:, q_rows + hd :]]


class Concat(Transform):
    """Pieces concatenated along dim 0 (gate/up -> ``linear_fc1``)."""

    name = "concat"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        return torch.cat(list(pieces), dim=0)

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return list(torch.chunk(tensor, self.parts, dim=0))

    def views(self, out: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return self.split(out, ctx)

    def __init__(self, parts: int = 2) -> None:
        self.parts = parts


@functools.lru_cache(maxsize=None)
def _views_mean_fuse(cls: type) -> bool:
    """Whether ``cls.views`` is defined where ``cls.fuse`` is, or in a subclass of that class."""

    def owner(attr: str) -> type:
        return next(c for c in cls.__mro__ if attr in c.__dict__)

    return issubclass(owner("views"), owner("fuse"))


def split_shapes(transform: Transform, shape: Sequence[int], ctx: TransformContext,
                 dtype: torch.dtype = torch.float32) -> list[tuple[int, ...]]:  # fmt: skip
    """The shape of each piece ``transform.split`` cuts from an mcore tensor of ``shape`` (this
    rank's chunk of each HF tensor), worked out on a meta tensor: no data is touched."""
    meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
    return [tuple(piece.shape) for piece in transform.split(meta, ctx)]


def direct_views(transform: Transform, out: torch.Tensor, ctx: TransformContext) -> Optional[list[torch.Tensor]]:
    """``transform.views(out, ctx)`` if they can be trusted to mean ``fuse``: a subclass that
    overrides ``fuse`` without overriding ``views`` too gets ``None`` (pieces are then fused)."""
    if not _views_mean_fuse(type(transform)):
        return None
    return transform.views(out, ctx)


class StackedExpert(Transform):
    """One expert's slice ``[1, ...]`` of an HF tensor that stacks every expert (``Source.expert_axis
    = 0``) <-> its mcore tensor: the slice itself (``transpose=False``: biases ``[1, n]`` -> ``[n]``)
    or, for a weight stored ``[in, out]`` as ``x @ w`` reads it, its transpose (``[1, I, H]`` ->
    ``linear_fc2.weight [H, I]``)."""

    def __init__(self, transpose: bool = False) -> None:
        self.transpose = transpose
        self.name = "expert-slice" + ("-transposed" if transpose else "")

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        (piece,) = pieces
        piece = piece[0]
        return piece.t() if self.transpose and piece.dim() == 2 else piece

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        piece = tensor.t() if self.transpose and tensor.dim() == 2 else tensor
        return [piece.contiguous().unsqueeze(0)]

    def mcore_axis(self, source: int, hf_axis: Optional[int]) -> Optional[int]:
        if hf_axis is None:
            return None
        return (1 - (hf_axis - 1)) if self.transpose else hf_axis - 1


def interleave_halves(tensor: torch.Tensor) -> torch.Tensor:
    """``[a; b]`` rows (``[2n, ...]``) -> alternating ``a_0, b_0, a_1, b_1, ...`` rows (a copy):
    Megatron-Core's ``[gate; up]`` in transformers' gpt-oss order."""
    half = tensor.shape[0] // 2
    return tensor.reshape(2, half, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


class StackedGateUpColumns(Transform):
    """One expert's slice of transformers' stacked ``gate_up_proj [E, H, 2I]`` (gate and up in
    alternating columns: ``x @ w`` gives ``gate_0, up_0, gate_1, ...``) or ``gate_up_proj_bias
    [E, 2I]`` <-> Megatron-Core's ``linear_fc1.weight [2I, H]`` / ``.bias [2I]`` (gate rows, then
    up rows). A tensor-parallel rank's chunk of the columns is contiguous (its gate and up columns
    alternate within it) and de-interleaves into its ``[gate_r; up_r]``."""

    name = "stacked-gate-up-columns"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        (piece,) = pieces
        rows = piece[0].t() if piece.dim() == 3 else piece[0]  # [2I, H] / [2I], alternating rows
        return torch.cat([rows[0::2], rows[1::2]], dim=0)

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        rows = interleave_halves(tensor)
        piece = rows.t() if rows.dim() == 2 else rows
        return [piece.contiguous().unsqueeze(0)]

    def mcore_axis(self, source: int, hf_axis: Optional[int]) -> Optional[int]:
        return None if hf_axis is None else 0


class StackedGateUpHalves(Transform):
    """One expert's slice of a stacked ``gate_up_proj [E, H, 2I]`` read as ``x @ w`` with gate and
    up in contiguous halves of the columns (Qwen3-VL-MoE's checkpoints) <-> Megatron-Core's
    ``linear_fc1.weight [2I, H]`` (its transpose: gate rows, then up rows). A tensor-parallel
    rank's contiguous chunk of the columns is not its ``[gate_r; up_r]``, so expert tensor
    parallelism is refused by name."""

    name = "stacked-gate-up-halves-transposed"

    @staticmethod
    def _whole(ctx: TransformContext) -> None:
        if ctx.tp_size > 1:
            raise UnsupportedLayoutError(f"{ctx.arch.architecture}: stacked gate / up halves are not split over expert tensor"
                           f" parallelism (expert TP size {ctx.tp_size}); use expert TP 1")  # fmt: skip

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        self._whole(ctx)
        (piece,) = pieces
        return piece[0].t()

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        self._whole(ctx)
        return [tensor.t().contiguous().unsqueeze(0)]

    def mcore_axis(self, source: int, hf_axis: Optional[int]) -> Optional[int]:
        return None if hf_axis is None else 0


IDENTITY = Identity()
QKV = FuseQKV()
GATE_UP = Concat(2)
STACKED_GATE_UP = StackedGateUpColumns()
STACKED_EXPERT = StackedExpert()
STACKED_EXPERT_T = StackedExpert(transpose=True)
STACKED_GATE_UP_HALVES = StackedGateUpHalves()


@dataclass(frozen=True)
class Source:
    """One HF tensor (or a contiguous part of one) feeding a rule.

    Attributes:
        hf: HF tensor name template.
        tp_axis: axis split across tensor-parallel ranks (``None`` = replicated).
        select: ``(axis, start, stop)``: only this range of the HF tensor (fused HF tensors such as
            Phi-3's ``qkv_proj``: q, k and v are three sources selecting three row ranges). TP
            chunks are taken within the range. All parts of one HF tensor must belong to one rule,
            and together they must cover it.
        expert_axis: the HF tensor stacks every routed expert along this axis (transformers'
            ``experts.gate_up_proj [E, ...]``); the source is the bound expert's slice
            ``(expert_axis, e, e + 1)`` (:attr:`BoundRule.selects`). Loading reads only that
            slice; export stacks the experts' slices back into the whole tensor.
    """

    hf: str
    tp_axis: Optional[int] = None
    select: Optional[tuple[int, int, int]] = None
    expert_axis: Optional[int] = None


@dataclass(frozen=True)
class Rule:
    """mcore parameter <- HF tensors.

    Attributes:
        mcore: canonical mcore parameter name template.
        sources: the HF tensors, in the order ``transform`` takes them.
        transform: pieces <-> mcore tensor.
        export: emit the sources on export (``False`` for a tied output layer whose source is the
            embedding, already exported by the embedding rule).
        layer_kind: for ``{layer}`` rules of MoE models: ``"all"`` layers, only ``"dense"`` ones or
            only ``"moe"`` ones (``ArchConfig.moe.layer_pattern`` decides which is which); of models
            with gated DeltaNet layers: only ``"full_attention"`` or only ``"linear_attention"``
            ones (``ArchConfig.gated_deltanet.layer_types``).
        note: shown by ``mcore-zoo show``.
        absent: when set, the sources may be missing from a checkpoint: the load then leaves the
            parameter as built (an explicit initialisation, e.g. a value head's
            ``value_head_init``) and reports it with this reason. Export still emits the sources.
    """

    mcore: str
    sources: tuple[Source, ...]
    transform: Transform = IDENTITY
    export: bool = True
    layer_kind: str = "all"
    note: str = ""
    absent: str = ""

    @_computed_once
    def tp_axes(self) -> tuple[Optional[int], ...]:
        return tuple(s.tp_axis for s in self.sources)

    @_computed_once
    def selects(self) -> tuple[Optional[tuple[int, int, int]], ...]:
        """Per source, its ``Source.select`` range (a bound expert's slice of a stacked-experts
        tensor: :attr:`BoundRule.selects`)."""
        return tuple(s.select for s in self.sources)

    @_computed_once
    def stacked(self) -> tuple[bool, ...]:
        """Per source, whether it is one expert's slice of a stacked-experts HF tensor."""
        return tuple(s.expert_axis is not None for s in self.sources)


def rule(
    mcore: str,
    hf: str | Sequence[str],
    *,
    tp_axis: Optional[int] = None,
    transform: Transform = IDENTITY,
    export: bool = True,
    layer_kind: str = "all",
    note: str = "",
) -> Rule:
    """Shorthand: every source shares ``tp_axis``."""
    names = [hf] if isinstance(hf, str) else list(hf)
    return Rule(mcore, tuple(Source(n, tp_axis) for n in names), transform, export, layer_kind, note)


def replicated(mcore: str, hf: str, *, note: str = "", layer_kind: str = "all") -> Rule:
    """A parameter every tensor-parallel rank holds whole (norms, row-parallel biases)."""
    return rule(mcore, hf, note=note, layer_kind=layer_kind)


def column_parallel(mcore: str, hf: str, *, note: str = "", layer_kind: str = "all") -> Rule:
    """A column-parallel weight (or bias, or the vocabulary): rows split across TP ranks."""
    return rule(mcore, hf, tp_axis=0, note=note, layer_kind=layer_kind)


def row_parallel(mcore: str, hf: str, *, note: str = "", layer_kind: str = "all") -> Rule:
    """A row-parallel weight: input columns split across TP ranks."""
    return rule(mcore, hf, tp_axis=1, note=note, layer_kind=layer_kind)


def fused_qkv(mcore: str, *, q: str, k: str, v: str, note: str = "", layer_kind: str = "all",
              transform: Transform = QKV) -> Rule:  # fmt: skip
    """mcore ``linear_qkv`` (weight or bias) from separate q / k / v projections, interleaved per
    query group (``transform``; a gated attention's q rows carry its gates too), column-parallel."""
    return rule(mcore, [q, k, v], tp_axis=0, transform=transform, note=note, layer_kind=layer_kind)


def fused_gate_up(mcore: str, *, gate: str, up: str, note: str = "", layer_kind: str = "all") -> Rule:
    """mcore ``linear_fc1`` (weight or bias) of a gated MLP from separate gate / up projections,
    column-parallel (each TP rank holds its share of gate, then of up)."""
    return rule(mcore, [gate, up], tp_axis=0, transform=GATE_UP, note=note, layer_kind=layer_kind)


def split_rows(hf: str, sizes: Sequence[int], *, tp_axis: Optional[int] = 0, axis: int = 0) -> tuple[Source, ...]:
    """Sources for consecutive parts of one fused HF tensor (e.g. ``qkv_proj`` -> q, k, v rows)."""
    sources, start = [], 0
    for size in sizes:
        sources.append(Source(hf, tp_axis, (axis, start, start + size)))
        start += size
    return tuple(sources)


_PLACEHOLDER = re.compile(r"\{(layer|expert)\}")


def _fill(template: str, **values: int) -> str:
    """``template`` with its ``{layer}`` / ``{expert}`` placeholders filled from ``values``;
    ``KeyError`` naming a placeholder that has no value. (String replacement: a model with
    thousands of expert tensors fills their names at every first load and export.)"""
    if "{" not in template:
        return template
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    missing = _PLACEHOLDER.search(template)
    if missing is not None:
        raise KeyError(missing.group(1))
    return template


def _check_placeholders(hf: Sequence[str], has_layer: bool, has_expert: bool) -> None:
    """``KeyError`` naming a placeholder of a rule's HF names that its mcore name lacks
    (``has_layer`` / ``has_expert``: the expansion would have no value for it), as :func:`_fill`
    raises."""
    for template in hf:
        for match in _PLACEHOLDER.finditer(template):
            if not (has_layer if match.group(1) == "layer" else has_expert):
                raise KeyError(match.group(1))


@dataclass(frozen=True)
class BoundRule:
    """A rule with its placeholders filled: one concrete mcore parameter and its HF tensors."""

    rule: Rule
    mcore: str
    hf: tuple[str, ...]
    layer: Optional[int] = None  # global decoder layer (0-based), for {layer} rules
    expert: Optional[int] = None  # global expert index, for {expert} rules

    @property
    def is_expert(self) -> bool:
        """An expert-parallel parameter: sharded over EP (and expert TP, not dense TP)."""
        return "{expert}" in self.rule.mcore

    def for_expert(self, expert: int) -> "BoundRule":
        """The same rule for global expert ``expert`` (HF names re-filled; the mcore name is kept:
        export uses it to name another EP rank's copy of this local expert)."""
        values = {"layer": self.layer, "expert": expert}
        hf = tuple(_fill(s.hf, **{k: v for k, v in values.items() if v is not None}) for s in self.rule.sources)
        return BoundRule(self.rule, self.mcore, hf, self.layer, expert)

    @property
    def transform(self) -> Transform:
        return self.rule.transform

    @property
    def tp_axes(self) -> tuple[Optional[int], ...]:
        return self.rule.tp_axes

    # computed once per bound rule (a load asks several times per parameter; the dataclass is
    # frozen, its fields never change) - the rule's own unless a source stacks the experts
    @_computed_once
    def selects(self) -> tuple[Optional[tuple[int, int, int]], ...]:
        """Per source, its range of the HF tensor: ``Source.select``, or the bound expert's slice
        of a stacked-experts tensor (``Source.expert_axis``)."""
        if self.expert is None or not any(self.rule.stacked):
            return self.rule.selects
        return tuple(
            (s.expert_axis, self.expert, self.expert + 1) if s.expert_axis is not None else s.select
            for s in self.rule.sources
        )  # fmt: skip

    @property
    def stacked(self) -> tuple[bool, ...]:
        """Per source, whether it is one expert's slice of a stacked-experts HF tensor."""
        return self.rule.stacked

    def tp_slice(self, source: int, rank: int = 0, size: int = 1) -> TPSlice:
        """Rank ``rank`` of ``size``'s slice of source ``source`` (its TP axis and select range)."""
        return TPSlice(self.rule.sources[source].tp_axis, rank, size, self.selects[source])

    def tp_slices(self, ctx: TransformContext) -> list[TPSlice]:
        """The slice of every source that the TP rank of ``ctx`` holds, in source order."""
        return [self.tp_slice(k, ctx.tp_rank, ctx.tp_size) for k in range(len(self.rule.sources))]


@dataclass
class WeightMap:
    """All rules of one architecture instance, plus HF tensors to ignore on load.

    Attributes:
        arch: the converted architecture.
        rules: the rules (layer rules use ``{layer}``; expert rules ``{expert}`` too).
        ignored: ``(regex, reason)`` for checkpoint tensors that are deliberately not loaded
            (e.g. rotary ``inv_freq`` buffers saved by old transformers).
        copies: ``(copy, source)`` HF names: checkpoint tensors that repeat another tensor (an MTP
            layer's ``embed_tokens`` / ``shared_head.head``). A copy is not loaded; when the
            checkpoint has it, loading checks it bitwise equal to ``source``
            (:func:`mcore_zoo.weights.tied.check_copies`); export writes it next to ``source``.
    """

    arch: ArchConfig
    rules: list[Rule]
    ignored: list[tuple[str, str]] = field(default_factory=list)
    copies: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: dict[str, Rule] = {}
        owner: dict[str, str] = {}
        for r in self.rules:
            if r.mcore in seen:
                raise ValueError(f"{self.arch.architecture}: two rules for mcore {r.mcore!r}")
            seen[r.mcore] = r
            for s in r.sources:
                if s.select is None:
                    continue
                if owner.setdefault(s.hf, r.mcore) != r.mcore:
                    raise ValueError(f"{self.arch.architecture}: parts of {s.hf!r} are split over several rules")
            for name in {s.hf for s in r.sources if s.select is not None}:
                parts = sorted(s.select for s in r.sources if s.hf == name)
                if parts[0][1] != 0 or any(a[2] != b[1] or a[0] != b[0] for a, b in zip(parts, parts[1:])):
                    raise ValueError(f"{self.arch.architecture}: parts of {name!r} are not contiguous: {parts}")
        self._ignored = [(re.compile(p), reason) for p, reason in self.ignored]
        self._ignored += [(re.compile(re.escape(c)), f"a copy of {src!r}: checked bitwise equal to it on load,"
                           " written back on export") for c, src in self.copies]  # fmt: skip

    # ------------------------------------------------------------------ expansion
    def expand_full(self) -> list[BoundRule]:
        """Every bound rule of the whole model (global indices on both sides). Expanded once per
        rule list (a load asks several times: coverage, optional names, the plan; a model with
        thousands of expert tensors spends tens of milliseconds per expansion)."""
        key = (id(self.rules), len(self.rules), id(self.arch))
        cached = self.__dict__.get("_expanded")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_expanded"] = (key, tuple(self._expand(range(self.arch.num_layers), None)))
        return list(cached[1])

    def _expand(self, layers: Iterable[int], layer_to_global: Optional[Mapping[int, int]], experts: Optional[Mapping[int, int]] = None) -> Iterable[BoundRule]:
        """The bound rules of local ``layers`` (global index ``layer_to_global[i]``, or ``i``) and
        local ``experts`` (``{local: global}``, default every expert). Names are filled by string
        replacement, the layer's index once per rule and layer, then the expert's (a model with
        thousands of expert tensors expands them at every first load)."""
        layers = list(layers)
        num_experts = self.arch.moe.num_experts if self.arch.moe else 0
        expert_items = list((experts if experts is not None else {e: e for e in range(num_experts)}).items())
        for r in self.rules:
            has_layer = "{layer}" in r.mcore
            has_expert = "{expert}" in r.mcore
            templates = tuple(s.hf for s in r.sources)
            _check_placeholders(templates, has_layer, has_expert)
            kind = "moe" if has_expert else r.layer_kind
            for local_layer in layers if has_layer else [None]:
                if local_layer is None:
                    global_layer, mcore, hf = None, r.mcore, templates
                else:
                    global_layer = layer_to_global[local_layer] if layer_to_global is not None else local_layer
                    if not self._layer_is(kind, global_layer):
                        continue
                    mcore = r.mcore.replace("{layer}", str(local_layer))
                    hf = tuple(t.replace("{layer}", str(global_layer)) for t in templates)
                if not has_expert:
                    yield BoundRule(r, mcore, hf, global_layer, None)
                    continue
                for local_e, global_e in expert_items:
                    yield BoundRule(r, mcore.replace("{expert}", str(local_e)),
                                    tuple(t.replace("{expert}", str(global_e)) for t in hf), global_layer, global_e)  # fmt: skip

    def _layer_is(self, kind: str, global_layer: Optional[int]) -> bool:
        """Whether a rule of ``layer_kind`` ``kind`` applies to global layer ``global_layer``: the MLP
        kinds ``dense`` / ``moe`` by ``arch.moe``, the token-mixer kinds ``full_attention`` /
        ``linear_attention`` by ``arch.gated_deltanet``."""
        if kind == "all":
            return True
        if kind in ("full_attention", "linear_attention"):
            linear = self.arch.gated_deltanet is not None and self.arch.gated_deltanet.is_linear_layer(global_layer)
            return (kind == "linear_attention") == linear
        return (kind == "moe") == self._layer_has_experts(global_layer)

    def _layer_has_experts(self, global_layer: Optional[int]) -> bool:
        moe = self.arch.moe
        if moe is None or global_layer is None:
            return False
        if moe.layer_pattern is None:
            return True
        return bool(moe.layer_pattern[global_layer])

    def hf_names(self) -> set[str]:
        """Every HF tensor name the whole model's rules consume."""
        return {name for b in self.expand_full() for name in b.hf}

    def export_names(self) -> set[str]:
        """Every HF tensor an export writes: :meth:`hf_names` and the copies."""
        return self.hf_names() | {c for c, _ in self.copies}

    def hf_parts(self) -> dict[str, list[tuple[BoundRule, int]]]:
        """HF name -> the exported ``(bound rule, source index)`` pairs that make it, over the whole
        model, parts of a fused HF tensor in the order of their ``select`` ranges (a tied output
        layer's rule is left out: the embedding rule exports its source)."""
        parts: dict[str, list[tuple[BoundRule, int]]] = {}
        for b in self.expand_full():
            if b.rule.export:
                for k, name in enumerate(b.hf):
                    parts.setdefault(name, []).append((b, k))
        for items in parts.values():
            items.sort(key=lambda item: -1 if item[0].selects[item[1]] is None else item[0].selects[item[1]][1])
        return parts

    def expert_roles(self) -> dict[str, str]:
        """HF projection name -> role (``gate`` / ``up`` / ``down``) of routed experts, read off the
        expert rules (``linear_fc1`` <- [gate, up], ``linear_fc2`` <- down)."""
        roles: dict[str, str] = {}
        for r in self.rules:
            if "{expert}" not in r.mcore:
                continue
            names = [s.hf.rsplit(".", 2)[-2] for s in r.sources]
            if r.mcore.endswith("linear_fc1.weight") and len(names) == 2:
                roles.update({names[0]: "gate", names[1]: "up"})
            elif r.mcore.endswith("linear_fc2.weight") and len(names) == 1:
                roles[names[0]] = "down"
        return roles

    def copies_of(self, hf_name: str) -> list[str]:
        """The copies export writes next to ``hf_name``."""
        return [c for c, src in self.copies if src == hf_name]

    def optional_hf_names(self) -> dict[str, str]:
        """HF tensors a checkpoint may lack (rules with ``absent``): ``{name: reason}``."""
        return {name: b.rule.absent for b in self.expand_full() if b.rule.absent for name in b.hf}

    def is_ignored(self, hf_name: str) -> Optional[str]:
        for pattern, reason in self._ignored:
            if pattern.fullmatch(hf_name):
                return reason
        return None

    # ------------------------------------------------------------------ binding to a model
    def bind(self, module: torch.nn.Module, *, expert_offset: int = 0, num_local_experts: Optional[int] = None,
             check: bool = False, tensors: Optional[Mapping[str, torch.Tensor]] = None) -> list[BoundRule]:  # fmt: skip
        """Bound rules for the parameters that exist in ``module`` (one GPTModel chunk).

        Local layer ``i`` maps to the global HF layer ``decoder.layers[i].layer_number - 1``. Rules
        whose mcore parameter does not exist in this chunk (other pipeline stages; the output
        layer under tied embeddings) are dropped; mcore names are resolved through
        :data:`FUSED_NORM_ALIASES` when the backend fuses norms. ``check``: each rule's TP axes
        are checked against its parameter's ``partition_dim`` (:func:`check_partition_dim`).
        ``tensors``: :func:`model_tensors` of ``module``, when the caller has it already.
        """
        params = model_tensors(module) if tensors is None else tensors
        names = set(params)
        layers = _decoder_layers(module)
        layer_map = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
        experts = None
        if self.arch.moe is not None:
            local = num_local_experts if num_local_experts is not None else self.arch.moe.num_experts
            experts = {e: expert_offset + e for e in range(local)}
        bound = []
        for b in self._expand(layer_map.keys(), layer_map, experts):
            name = resolve_mcore_name(b.mcore, names)
            if name is None:
                continue
            bound.append(b if name == b.mcore else BoundRule(b.rule, name, b.hf, b.layer, b.expert))
        for b in bound if check else ():
            check_partition_dim(b, params[b.mcore])
        return bound


def check_partition_dim(b: BoundRule, param: torch.Tensor) -> None:
    """The rule's declared TP axes must be the parameter's ``partition_dim`` (split parameters) or
    ``None`` (replicated ones). Raises :class:`WeightMapError` naming the parameter."""
    if not hasattr(param, "tensor_model_parallel"):
        return  # a module that does not declare its split (never the case for mcore / TE layers)
    split = bool(param.tensor_model_parallel)
    want = getattr(param, "partition_dim", None) if split else None
    if split and want is None:
        return
    bad = [axis for k, axis in enumerate(b.tp_axes) if b.transform.mcore_axis(k, axis) != want]
    if bad:
        raise WeightMapError(
            f"rule for {b.mcore!r} declares tensor-parallel axes {list(b.tp_axes)}, but Megatron-Core"
            + (f" splits the parameter along dim {want}" if split else " replicates the parameter")
        )


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a rule may target: every parameter, and the buffers that hold checkpoint state (MoE
    routers' ``expert_bias``, HF ``e_score_correction_bias``). Only parameters must have a rule.
    The parameters first, then the buffers (:func:`parameters_and_state_buffers`)."""
    parameters, buffers = parameters_and_state_buffers(module)
    parameters.update(buffers)
    return parameters


def parameters_and_state_buffers(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(parameters, buffers)`` of :func:`model_tensors`, apart: the names and order of
    ``named_parameters()`` (a tensor reached under two names counted once, under its first), and
    the checkpoint-state buffers, from one walk of the module tree instead of one per kind (a
    model with thousands of expert modules walks them at every first load)."""
    parameters: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen_modules: set[int] = set()
    seen_tensors: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    while stack:  # pre-order, children in registration order: named_modules()'s order
        prefix, current = stack.pop()
        if id(current) in seen_modules:
            continue
        seen_modules.add(id(current))
        dot = prefix + "." if prefix else ""
        for name, param in current._parameters.items():
            if param is not None and id(param) not in seen_tensors:
                seen_tensors.add(id(param))
                parameters[dot + name] = param
        buffer = current._buffers.get("expert_bias") if prefix else None
        if buffer is not None and id(buffer) not in seen_tensors:
            seen_tensors.add(id(buffer))
            buffers[dot + "expert_bias"] = buffer
        stack.extend((dot + name, child) for name, child in reversed(current._modules.items()) if child is not None)
    return parameters, buffers


class TensorRef:
    """One entry of :func:`model_tensors` by its dotted name, for repeated reads without a module walk.

    :meth:`get` re-resolves the name on every call with dict lookups along the module path
    (``_modules``, then ``_parameters`` / ``_buffers`` of the owner) - what ``named_parameters``
    would find under that name now, at a few dict lookups instead of a walk of the whole model.
    A parameter or module replaced since the last call is followed; one that is gone raises
    :class:`KeyError` naming it.
    """

    __slots__ = ("name", "_path", "_leaf")

    def __init__(self, name: str) -> None:
        *path, leaf = name.split(".")
        self.name, self._path, self._leaf = name, tuple(path), leaf

    def get(self, root: torch.nn.Module) -> torch.Tensor:
        module = root
        try:
            for part in self._path:
                module = module._modules[part]  # type: ignore[assignment]
        except KeyError:
            raise KeyError(f"{self.name!r}: the model has no module {'.'.join(self._path)!r} any more") from None
        tensor = module._parameters.get(self._leaf)
        if tensor is None:
            tensor = module._buffers.get(self._leaf)
        if tensor is None:
            raise KeyError(f"{self.name!r}: the model has no such parameter or buffer any more")
        return tensor

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r})"


@dataclass(frozen=True, eq=False)
class RuleStep:
    """One rule bound to one chunk's tensor, with everything reading or writing it needs, as plain
    values: the bound rule, a reference to its mcore tensor (re-resolved on every read, so a
    replaced parameter is followed), its transform context (this rank's TP slot for the rule:
    expert TP for expert rules, dense TP otherwise), the chunk and its virtual-pipeline stage, the
    process group its tensor-parallel pieces are gathered over and, for a local expert under
    expert parallelism, the rule of every EP rank's copy of it (EP rank order: global experts). The model handle makes them
    once (:meth:`~mcore_zoo.handle.ModelHandle.rule_steps`); loading and export take them."""

    bound: BoundRule
    ref: "TensorRef"
    ctx: TransformContext
    chunk: Any = None
    stage: int = 0
    tp_group: Any = None
    ep_rules: tuple[BoundRule, ...] = ()

    def tensor(self) -> torch.Tensor:
        """The mcore tensor, read by its module path now."""
        return self.ref.get(self.chunk)


def bind_steps(bound: Sequence[BoundRule], chunk: torch.nn.Module, stage: int,
               splits: Mapping[bool, tuple[TransformContext, Any]], *, ep: int = 1, ep_rank: int = 0,
               per_rank: int = 0) -> list[RuleStep]:  # fmt: skip
    """``bound`` (the rules bound to ``chunk``, virtual stage ``stage``) as :class:`RuleStep` values;
    ``splits[is_expert]``: the transform context and TP group of the rule's tensor-parallel split;
    ``ep`` / ``ep_rank`` / ``per_rank``: this rank's expert-parallel slot and the experts each EP
    rank holds."""
    steps = []
    for b in bound:
        ctx, group = splits[b.is_expert]
        ep_rules: tuple[BoundRule, ...] = ()
        if b.is_expert and ep > 1:
            local = b.expert - ep_rank * per_rank  # type: ignore[operator]
            ep_rules = tuple(b.for_expert(r * per_rank + local) for r in range(ep))
        steps.append(RuleStep(b, TensorRef(b.mcore), ctx, chunk, stage, group, ep_rules))
    return steps


#: canonical (Megatron-Core 0.16) infix -> the name 0.19 gives the MTP layer's decoder layer
MTP_LAYER_ALIASES: dict[str, str] = {".transformer_layer.": ".mtp_model_layer."}

_SEQUENTIAL_EXPERT = re.compile(r"(?P<experts>(?:.*\.)?experts\.)local_experts\.(?P<i>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)")


def grouped_expert_name(name: str) -> Optional[str]:
    """The name of a sequential expert's parameter in Megatron-Core's grouped experts
    (``TEGroupedMLP``: one Transformer Engine ``GroupedLinear`` per projection, local expert ``i``
    in its parameters ``weight{i}`` / ``bias{i}``, same shape and layout as the sequential expert's
    ``linear_fc{1,2}.weight`` / ``.bias`` on the same expert-TP rank):
    ``...experts.local_experts.{i}.linear_fc1.weight`` -> ``...experts.linear_fc1.weight{i}``.
    ``None`` for any other name."""
    m = _SEQUENTIAL_EXPERT.fullmatch(name)
    if m is None:
        return None
    return f"{m.group('experts')}{m.group('fc')}.{m.group('kind')}{m.group('i')}"


def resolve_mcore_name(name: str, existing: set[str]) -> Optional[str]:
    """``name`` if the model has it, else its fused-norm alias (and / or its MTP-layer alias, or its
    grouped-experts name) if the model has that, else None."""
    if name in existing:  # (the first candidate below: most names are the model's own)
        return name
    candidates = [name]
    for canonical, alias in MTP_LAYER_ALIASES.items():
        if name.startswith("mtp.") and canonical in name:
            candidates.append(name.replace(canonical, alias, 1))
    candidates += [g for g in map(grouped_expert_name, candidates) if g is not None]
    for candidate in candidates:
        if candidate in existing:
            return candidate
        for canonical, alias in FUSED_NORM_ALIASES.items():
            if candidate.endswith(canonical):
                fused = candidate[: -len(canonical)] + alias
                if fused in existing:
                    return fused
    return None


def _decoder_layers(module: torch.nn.Module) -> Sequence[Any]:
    decoder = getattr(module, "decoder", None)
    if decoder is None:
        return []
    return list(decoder.layers)
