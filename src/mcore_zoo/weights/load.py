"""Load HF weights into a zoo-built model (any TP rank / pipeline stage / VPP chunk).

Fail closed, and before a single weight is read:

1. every HF tensor the whole model needs is in the checkpoint (else :class:`MissingTensorsError`);
2. every checkpoint tensor is consumed by a rule or explicitly ignored (else
   :class:`UnexpectedTensorsError`);
3. every parameter of every local chunk has a rule (else :class:`UnmappedParametersError`);
4. every HF tensor has the shape the rule and the model imply (else :class:`ShapeMismatchError`):
   expected HF shapes come from running the rule's inverse transform on the parameter's shape.

The layout is checked first (:func:`mcore_zoo.distributed.layout.current_layout`: the model was
built for the running parallel state and the layout divides the model), so a bad layout fails
before the checkpoint is even opened.

Then each rank reads only its tensor-parallel chunk of each source
(:meth:`~mcore_zoo.weights.io.HFCheckpoint.read_into`): straight into the parameter when the
rule's transform can say where each piece goes (:meth:`Transform.views`: QKV groups, gate/up
halves), else into a temporary that is fused and copied - one rule's tensors at a time.

Data-parallel replicas (and context-parallel ranks, which hold the same weights) do not multiply
the storage traffic: with ``replicas="broadcast"`` (default) only the first rank of each
data-parallel group reads, and every parameter is broadcast over that group (NCCL on GPUs; the
interconnect is faster than shared storage). ``replicas="read"`` makes every rank read its own
copy (when storage is local and fast, or no collective may be issued). Pipeline stages and tensor-
parallel ranks always read disjoint parts; the one exception is a tied embedding, which the first
and last pipeline stages both read (both hold it; Megatron keeps the two copies equal in training
by all-reducing their gradients over the embedding group).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from ..build import as_chunks, model_info
from ..errors import MissingTensorsError, ShapeMismatchError, UnexpectedTensorsError, UnmappedParametersError
from .io import HFCheckpoint, chunk_index
from .rules import BoundRule, TransformContext, WeightMap, direct_views
from ..hf_assets import remember_source
from ..progress import progress
from .tied import check_tied_output

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What a load did on this rank: parameters written, HF tensors and bytes read from storage,
    bytes received by broadcast from a data-parallel replica, ignored checkpoint tensors."""

    parameters: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    ignored: dict[str, str] = field(default_factory=dict)


def expected_hf_shapes(bound: BoundRule, param_shape: Sequence[int], ctx: TransformContext) -> list[tuple[int, ...]]:
    """Per source, the shape (all TP ranks together) of what it reads from the HF tensor, for an
    mcore parameter of ``param_shape``: the whole tensor, or its ``select`` range."""
    if getattr(bound.transform, "reads_whole", False):  # e.g. a padded vocabulary: whole HF tensors
        return [tuple(bound.transform.hf_shape(param_shape, ctx))] * len(bound.hf)
    meta = torch.empty(tuple(param_shape), device="meta")
    pieces = bound.transform.split(meta, ctx)
    shapes = []
    for piece, axis in zip(pieces, bound.tp_axes):
        shape = list(piece.shape)
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


def _check_bound_shapes(bound: BoundRule, param_shape: Sequence[int], ctx: TransformContext, shape_of: Any) -> None:
    expected = expected_hf_shapes(bound, param_shape, ctx)
    extent: dict[str, int] = {}
    for name, want, select in zip(bound.hf, expected, bound.selects):
        got = tuple(shape_of(name))
        region = _region_shape(got, select)
        if region != tuple(want):
            what = name if select is None else f"{name}[{select[1]}:{select[2]} along dim {select[0]}]"
            raise ShapeMismatchError(
                what, want, region, context=f"feeds mcore {bound.mcore!r} {tuple(param_shape)} via {bound.transform}"
            )
        if select is not None:
            extent[name] = max(extent.get(name, 0), select[2])
    for name, stop in extent.items():
        axis = next(s[0] for n, s in zip(bound.hf, bound.selects) if n == name)
        if shape_of(name)[axis] != stop:
            raise ShapeMismatchError(
                name, (stop,), (shape_of(name)[axis],), context=f"dim {axis}: the rule's parts cover {stop} of it"
            )


def check_coverage(wmap: WeightMap, names: set[str], source: str) -> dict[str, str]:
    """Raise for missing / unconsumed HF tensors; return ``{ignored name: reason}``."""
    needed = wmap.hf_names()
    missing = sorted(needed - names)
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


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _expert_slot() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def bind_chunk(wmap: WeightMap, chunk: torch.nn.Module) -> list[BoundRule]:
    """Bound rules of one chunk, with expert-parallel offsets applied."""
    if wmap.arch.moe is None:
        return wmap.bind(chunk)
    ep_rank, ep_size = _expert_slot()
    local = wmap.arch.moe.num_experts // ep_size
    return wmap.bind(chunk, expert_offset=ep_rank * local, num_local_experts=local)


def plan_load(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], checkpoint: HFCheckpoint) -> tuple[list[tuple[torch.nn.Module, list[BoundRule]]], dict[str, str]]:
    """All checks of the module docstring; returns the per-chunk bound rules and ignored tensors."""
    chunks = as_chunks(model)
    info = model_info(chunks[0])
    wmap = info.weight_map
    ignored = check_coverage(wmap, checkpoint.keys(), str(checkpoint.path))
    check_tied_output(wmap, checkpoint)
    tp_rank, tp_size, _ = _tp()
    ctx = TransformContext(info.arch, tp_rank, tp_size)
    plan = []
    unmapped: list[str] = []
    for index, chunk in enumerate(chunks):
        params = dict(chunk.named_parameters())
        bound = bind_chunk(wmap, chunk)
        covered = {b.mcore for b in bound}
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        unmapped += [prefix + n for n in params if n not in covered]
        for b in bound:
            _check_bound_shapes(b, params[b.mcore].shape, ctx, checkpoint.shape)
        plan.append((chunk, bound))
    if unmapped:
        raise UnmappedParametersError(unmapped)
    return plan, ignored


def _replica_group(param: torch.Tensor) -> Any:
    """The group of ranks holding identical copies of ``param`` (None when alone)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    if getattr(param, "allreduce", True):
        group = ps.get_data_parallel_group(with_context_parallel=True)
    else:  # expert parameters
        group = ps.get_expert_data_parallel_group()
    return group if group is not None and group.size() > 1 else None


def load_hf_weights(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    checkpoint: Union[str, os.PathLike, HFCheckpoint],
    *,
    allow_torch_load: bool = False,
    replicas: str = "broadcast",
) -> LoadReport:
    """Load an HF checkpoint into ``model`` (a zoo-built GPTModel, or its list of VPP chunks).

    Every rank of the job calls it with its own chunks. Each tensor-parallel rank reads only its
    chunks; ``replicas`` says how data-parallel copies get theirs (module docstring). Raises before
    writing anything if the layout is wrong or the checkpoint and the weight map disagree.
    """
    import torch.distributed as dist

    from ..distributed.layout import current_layout

    if replicas not in ("broadcast", "read"):
        raise ValueError(f"replicas={replicas!r}; use 'broadcast' or 'read'")
    current_layout(model, all_chunks=False)  # before any IO
    own = not isinstance(checkpoint, HFCheckpoint)
    ckpt = HFCheckpoint(checkpoint, allow_torch_load=allow_torch_load) if own else checkpoint
    try:
        plan, ignored = plan_load(model, ckpt)
        info = model_info(as_chunks(model)[0])
        tp_rank, tp_size, _ = _tp()
        ctx = TransformContext(info.arch, tp_rank, tp_size)
        report = LoadReport(ignored=ignored)
        for chunk, bound in plan:
            params = dict(chunk.named_parameters())
            for b in progress(bound, total=len(bound), desc="loading HF weights", unit="param"):
                param = params[b.mcore]
                group = _replica_group(param) if replicas == "broadcast" else None
                source = None if group is None else dist.get_process_group_ranks(group)[0]
                if group is None or dist.get_rank() == source:
                    report.bytes_read += read_rule_into(ckpt, b, param, ctx)
                    report.tensors_read += len(b.hf)
                if group is not None:
                    dist.broadcast(param.data, src=source, group=group)
                    if dist.get_rank() != source:
                        report.bytes_received += param.numel() * param.element_size()
                report.parameters += 1
        if own:
            remember_source(model, ckpt.path)  # save_hf_checkpoint copies its tokenizer files
        logger.info("loaded %d parameters from %s (%.1f MB read)", report.parameters, ckpt.path, report.bytes_read / 1e6)
        return report
    finally:
        if own:
            ckpt.close()


def read_rule_into(ckpt: HFCheckpoint, b: BoundRule, param: torch.Tensor, ctx: TransformContext) -> int:
    """Fill ``param`` (a parameter or any tensor of its shape) from the rule's HF sources - this
    TP rank's chunks - and return the bytes read."""
    tp_rank, tp_size = ctx.tp_rank, ctx.tp_size
    if getattr(b.transform, "reads_whole", False):  # the transform takes this rank's part itself
        tp_rank, tp_size = 0, 1
    views = direct_views(b.transform, param.data, ctx)
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


def load_hf_state_dict(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]], state_dict: dict[str, torch.Tensor]
) -> LoadReport:
    """Load from an in-memory HF state dict (e.g. ``hf_model.state_dict()``), same checks."""
    return load_hf_weights(model, _DictCheckpoint(state_dict))  # type: ignore[arg-type]


class _DictCheckpoint(HFCheckpoint):
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

    def read(self, name: str, *, axis: Optional[int] = None, rank: int = 0, size: int = 1, select: Any = None) -> torch.Tensor:
        tensor = self._state[name]
        index = chunk_index(name, tuple(tensor.shape), axis=axis, rank=rank, size=size, select=select)
        return tensor if index is None else tensor[index]

    def read_into(self, name: str, out: torch.Tensor, **kwargs: Any) -> int:
        tensor = self.read(name, **kwargs)
        if out.numel() != tensor.numel():
            raise ShapeMismatchError(name, tuple(out.shape), tuple(tensor.shape), context="destination of read_into")
        with torch.no_grad():
            out.copy_(tensor.reshape(out.shape))
        return tensor.numel() * tensor.element_size()

    def close(self) -> None:
        pass
