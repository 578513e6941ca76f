"""Planning a load of HF weights into a zoo-built model: pure, single-rank mapping math.

Fail closed, and before a single weight is read (:func:`plan_load`):

1. every HF tensor the whole model needs is in the checkpoint (else :class:`MissingTensorsError`);
2. every checkpoint tensor is consumed by a rule or explicitly ignored (else
   :class:`UnexpectedTensorsError`);
3. every parameter of every local chunk has a rule (else :class:`UnmappedParametersError`);
4. every HF tensor has the shape the rule and the model imply (else :class:`ShapeMismatchError`):
   expected HF shapes come from running the rule's inverse transform on the parameter's shape.

:func:`read_rule_into` then fills one parameter from this rank's tensor-parallel chunks of its
sources: straight into the parameter when the rule's transform can say where each piece goes
(:meth:`Transform.views`: QKV groups, gate/up halves), else into a temporary that is fused and
copied. The job-wide load (which rank reads, broadcasts to data-parallel replicas) is
:func:`mcore_zoo.distributed.load.load_hf_weights`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from ..errors import MissingTensorsError, ShapeMismatchError, UnexpectedTensorsError, UnmappedParametersError
from .io import HFCheckpoint, copy_into
from .rules import BoundRule, RuleStep, TPSlice, TransformContext, WeightMap, direct_views, split_shapes
from .tied import check_copies, check_tied_output


@dataclass
class LoadReport:
    """What a load did on this rank: parameters written, HF tensors and bytes read from storage,
    bytes received by broadcast from a data-parallel replica, ignored checkpoint tensors."""

    parameters: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    ignored: dict[str, str] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)  # HF tensors not in the checkpoint, by request


def expected_hf_shapes(bound: BoundRule, param_shape: Sequence[int], ctx: TransformContext) -> list[tuple[int, ...]]:
    """Per source, the shape (all TP ranks together) of what it reads from the HF tensor, for an
    mcore parameter of ``param_shape``: the whole tensor, or its ``select`` range."""
    if getattr(bound.transform, "reads_whole", False):  # e.g. a padded vocabulary: whole HF tensors
        return [tuple(bound.transform.hf_shape(param_shape, ctx))] * len(bound.hf)
    shapes = []
    for piece, axis in zip(split_shapes(bound.transform, param_shape, ctx), bound.tp_axes):
        shape = list(piece)
        if axis is not None:
            shape[axis] *= ctx.tp_size
        shapes.append(tuple(shape))
    return shapes


def _region_shape(full: Sequence[int], select: Optional[tuple[int, int, int]]) -> tuple[int, ...]:
    shape = list(full)
    if select is not None:
        axis, start, stop = select
        shape[axis] = min(stop, shape[axis]) - start
    return tuple(shape)


def _check_bound_shapes(bound: BoundRule, param_shape: Sequence[int], ctx: TransformContext, shape_of: Any,
                        expected_cache: dict) -> None:  # fmt: skip
    """Raise unless the rule's HF sources have the shapes ``param_shape`` needs. ``expected_cache``:
    :func:`expected_hf_shapes` kept per (transform, context, shape, TP axes) object identities -
    many rules share them (an MoE model's experts: one transform and context for all of them) - for
    as long as those objects are alive (one :func:`plan_load`)."""
    key = (id(bound.transform), id(ctx), tuple(param_shape), tuple(bound.tp_axes), len(bound.hf))
    expected = expected_cache.get(key)
    if expected is None:
        expected = expected_cache[key] = expected_hf_shapes(bound, param_shape, ctx)
    extent: dict[str, int] = {}
    for name, want, select, stacked in zip(bound.hf, expected, bound.selects, bound.stacked):
        got = tuple(shape_of(name))
        region = _region_shape(got, select)
        if region != tuple(want):
            what = name if select is None else f"{name}[{select[1]}:{select[2]} along dim {select[0]}]"
            raise ShapeMismatchError(
                what, want, region, context=f"feeds mcore {bound.mcore!r} {tuple(param_shape)} via {bound.transform}"
            )
        if stacked:  # one expert's slice: the tensor stacks all of them
            experts = ctx.arch.moe.num_experts if ctx.arch.moe is not None else 0
            if got[select[0]] != experts:
                raise ShapeMismatchError(name, (experts,), (got[select[0]],),
                                         context=f"dim {select[0]} stacks the model's {experts} experts")  # fmt: skip
        elif select is not None:
            extent[name] = max(extent.get(name, 0), select[2])
    for name, stop in extent.items():
        axis = next(s[0] for n, s in zip(bound.hf, bound.selects) if n == name)
        if shape_of(name)[axis] != stop:
            raise ShapeMismatchError(
                name, (stop,), (shape_of(name)[axis],), context=f"dim {axis}: the rule's parts cover {stop} of it"
            )


def check_coverage(wmap: WeightMap, names: set[str], source: str) -> dict[str, str]:
    """Raise for missing / unconsumed HF tensors; return ``{ignored name: reason}``. Tensors of
    rules with ``absent`` may be missing (see :func:`absent_tensors`)."""
    needed = wmap.hf_names()
    missing = sorted(needed - names - set(wmap.optional_hf_names()))
    if missing:
        raise MissingTensorsError(missing, source=source)
    ignored = {}
    unexpected = []
    for name in sorted(names - needed):
        reason = wmap.is_ignored(name)
        if reason is None:
            unexpected.append(name)
        else:
            ignored[name] = reason
    if unexpected:
        raise UnexpectedTensorsError(unexpected, source=source)
    return ignored


def absent_tensors(wmap: WeightMap, names: set[str]) -> dict[str, str]:
    """``{HF name: reason}`` of the optional tensors (rules with ``absent``) a checkpoint lacks."""
    return {n: reason for n, reason in wmap.optional_hf_names().items() if n not in names}


def plan_load(weight_map: WeightMap, checkpoint: HFCheckpoint, chunks: Sequence[tuple[torch.nn.Module, Sequence[RuleStep]]],
              parameter_names: Optional[Sequence[Sequence[str]]] = None) -> tuple[list[list[RuleStep]], dict[str, str]]:  # fmt: skip
    """All checks of the module docstring, for each chunk and its rule steps (every bound rule of
    it: :meth:`~mcore_zoo.handle.ModelHandle.rule_steps`); returns the steps to read, per chunk, and
    the ignored tensors. Rules whose sources are absent by request (``Rule.absent``) are left out
    of the plan: their parameters keep their explicit initialisation. ``parameter_names``: per
    chunk, the names of its parameters when the caller has them
    (:meth:`~mcore_zoo.handle.ModelHandle.parameter_names`), else read off ``named_parameters()``."""
    ignored = check_coverage(weight_map, checkpoint.keys(), str(checkpoint.path))
    absent = absent_tensors(weight_map, checkpoint.keys())
    check_tied_output(weight_map, checkpoint)
    check_copies(weight_map, checkpoint)
    plan = []
    unmapped: list[str] = []
    expected: dict = {}  # the steps (and their transforms and contexts) are alive throughout
    for index, (chunk, steps) in enumerate(chunks):
        covered = {s.bound.mcore for s in steps}
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        names = parameter_names[index] if parameter_names is not None else [n for n, _ in chunk.named_parameters()]
        unmapped += [prefix + n for n in names if n not in covered]
        steps = [s for s in steps if not any(n in absent for n in s.bound.hf)]
        for s in steps:
            _check_bound_shapes(s.bound, s.tensor().shape, s.ctx, checkpoint.shape, expected)
        plan.append(steps)
    if unmapped:
        raise UnmappedParametersError(unmapped)
    return plan, ignored


def rule_views(b: BoundRule, param: torch.Tensor, ctx: TransformContext) -> Optional[list[torch.Tensor]]:
    """The views of ``param`` that :func:`read_rule_into` reads the rule's sources straight into
    (:func:`~mcore_zoo.weights.rules.direct_views`), or ``None`` when its pieces are fused first.
    :func:`~mcore_zoo.distributed.load.load_hf_weights` makes them for every parameter before its
    first read: making a view releases the interpreter lock, which the read threads then hold
    while reads run, so the loading thread waits to get it back."""
    return direct_views(b.transform, param.data, ctx)


_MAKE_VIEWS: Any = object()  # read_rule_into's default: make the views when called


def read_rule_into(ckpt: HFCheckpoint, b: BoundRule, param: torch.Tensor, ctx: TransformContext,
                   views: Optional[list[torch.Tensor]] = _MAKE_VIEWS) -> int:  # fmt: skip
    """Fill ``param`` (a parameter or any tensor of its shape) from the rule's HF sources - this
    TP rank's chunks - and return the bytes read. Inside :func:`queued_reads` the bytes may land
    after it returns (when the block exits, or at :func:`finish_reads`). ``views``: what
    :func:`rule_views` returns for this parameter, made beforehand (default: made here)."""
    tp_rank, tp_size = ctx.tp_rank, ctx.tp_size
    if getattr(b.transform, "reads_whole", False):  # the transform takes this rank's part itself
        tp_rank, tp_size = 0, 1
    if views is _MAKE_VIEWS:
        views = rule_views(b, param, ctx)
    if views is not None:
        return sum(
            ckpt.read_into(n, view, axis=a, rank=tp_rank, size=tp_size, select=sel)
            for n, a, sel, view in zip(b.hf, b.tp_axes, b.selects, views)
        )
    pieces = [ckpt.read(n, axis=a, rank=tp_rank, size=tp_size, select=sel) for n, a, sel in zip(b.hf, b.tp_axes, b.selects)]
    tensor = b.transform.fuse(pieces, ctx)
    if tuple(tensor.shape) != tuple(param.shape):  # guarded by plan_load; kept as a last line
        raise ShapeMismatchError(b.mcore, param.shape, tensor.shape, context="after fusing")
    with torch.no_grad():
        param.copy_(tensor)
    return sum(p.numel() * p.element_size() for p in pieces)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A block in which Python's cyclic garbage collector does not run - process-wide, as Python
    has one collector - switched back on when the block exits if it was on. A full collection
    that the model's construction made due would otherwise run inside the load, at one of the
    load's own allocations, walking every object of the process with the interpreter lock held
    while the read threads wait for it: on the 2-core CPU machine the first load of a Qwen3-MoE
    model (4 x 128 experts) after building it paid one of 0.41 - 0.55 s in a 0.80 - 1.01 s load
    (``bench/first_load.py``, docs/benchmarks.md). Objects freed by reference counting - nearly
    all a load makes - are freed as before; the due collection runs later, at an allocation after
    the block."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def queued_reads(ckpt: Any) -> Any:
    """A block in which :func:`read_rule_into` may return before its parameter holds the bytes
    (:meth:`~mcore_zoo.weights.io.HFCheckpoint.queued_reads`): all are written, or the first
    read's error raised, when the block exits. A checkpoint object without queued reads reads as
    it is called."""
    queued = getattr(ckpt, "queued_reads", None)
    return queued() if queued is not None else contextlib.nullcontext()


def finish_reads(ckpt: Any) -> None:
    """Inside :func:`queued_reads`: return once every parameter read so far holds its bytes."""
    finish = getattr(ckpt, "finish_reads", None)
    if finish is not None:
        finish()


class DictCheckpoint(HFCheckpoint):
    """An :class:`HFCheckpoint` view of an in-memory state dict."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:  # noqa: D401 - no file IO
        self.path = "<state_dict>"  # type: ignore[assignment]
        self._state = state_dict

    def keys(self) -> set[str]:
        return set(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._state:
            raise MissingTensorsError([name], source="state dict")
        return tuple(self._state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._state:
            raise MissingTensorsError([name], source="state dict")
        return self._state[name].dtype

    def read(self, name: str, *, axis: Optional[int] = None, rank: int = 0, size: int = 1, select: Any = None) -> torch.Tensor:
        tensor = self._state[name]
        index = TPSlice(axis, rank, size, select).index(tuple(tensor.shape), f"tensor {name!r}")
        return tensor if index is None else tensor[index]

    def read_into(self, name: str, out: torch.Tensor, **kwargs: Any) -> int:
        tensor = self.read(name, **kwargs)
        copy_into(name, out, tensor)
        return tensor.numel() * tensor.element_size()

    @contextlib.contextmanager
    def queued_reads(self) -> Iterator[None]:
        yield  # copies from memory: nothing to queue

    def finish_reads(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_hf_checkpoint(checkpoint: Any, arch_config: Any, *, allow_torch_load: bool = False) -> Any:
    """The HF checkpoint ``checkpoint`` (a path) opened for ``arch_config``: an
    :class:`~mcore_zoo.weights.io.HFCheckpoint`, behind a dequantizing view when the config
    declares a quantized checkpoint (:func:`dequantizing_view`). Every reader of an HF checkpoint
    for a model (``load_hf_weights``, ``convert --hf``) opens it here, so they accept the same
    checkpoints."""
    from .io import HFCheckpoint

    quantization = getattr(arch_config, "checkpoint_quantization", None)
    fp8 = quantization is not None and quantization.get("quant_method") == "fp8"
    ckpt = HFCheckpoint(checkpoint, allow_torch_load=allow_torch_load, allow_fp8=fp8)
    try:
        return dequantizing_view(ckpt, arch_config)
    except BaseException:
        ckpt.close()
        raise


def dequantizing_view(ckpt: Any, arch_config: Any) -> Any:
    """``ckpt`` (an opened checkpoint) read as ``arch_config``'s ``checkpoint_quantization`` says:
    FP8 blocks (DeepSeek-V3 / Kimi-K2 as published, :class:`~mcore_zoo.weights.fp8.Fp8Checkpoint`),
    MXFP4 experts (gpt-oss as published, :class:`~mcore_zoo.weights.mxfp4.Mxfp4Checkpoint`), both
    dequantized as read; ``ckpt`` itself when unquantized."""
    quantization = getattr(arch_config, "checkpoint_quantization", None)
    if quantization is None:
        return ckpt
    if quantization.get("quant_method") == "mxfp4":
        from .mxfp4 import Mxfp4Checkpoint

        return Mxfp4Checkpoint(ckpt)
    from .fp8 import Fp8BlockFormat, Fp8Checkpoint

    return Fp8Checkpoint(ckpt, Fp8BlockFormat.from_hf(quantization, architecture=arch_config.architecture))
