"""Export from any TP / PP / VPP layout to HF names, in bounded buckets (rollout weight sync).

:func:`iter_hf_buckets` is the one export path: :func:`iter_hf_weights`, :func:`iter_hf_shards` and
:func:`save_hf_checkpoint` all go through it.

1. *Plan* (no data moves): each rank lists the HF tensors its chunks export - names, gathered
   shapes, dtypes - by running the export on meta tensors; the pipeline stages exchange their lists
   (one ``all_gather_object`` over the pipeline group). Every rank now knows the whole model in HF
   order (virtual stage by virtual stage) and which stage owns each tensor.
2. *Buckets*: consecutive tensors of one stage, at most ``bucket_size`` bytes (a larger tensor is
   a bucket of its own).
3. *Move*: the owning stage's TP ranks all-gather each tensor's pieces (the same rule table as
   loading; QKV / gate-up split per group / half), pack the bucket into one flat buffer and send it
   over the pipeline group - ``broadcast`` when every stage wants it, point-to-point sends to the
   chosen ranks otherwise. Receivers unpack views of the buffer.

Memory per rank: one bucket, plus - on the owner - one gathered tensor while it is packed.

:func:`iter_hf_shards` re-splits each gathered tensor for a target inference TP size along the
axis the rule table gives (fused HF tensors such as ``qkv_proj`` part by part), so a rollout rank
receives exactly its shard.

Ranks and groups come from the model's handle (:class:`~mcore_zoo.placement.Placement`); this module
and :mod:`mcore_zoo.distributed.load` / :mod:`~mcore_zoo.distributed.forward` are the only places
that issue collectives.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..config.transformer import validate_layout
from ..errors import LayoutError, ZooError
from ..handle import ModelHandle, handle_of
from ..placement import Parallelism
from ..weights.export import ExpertCopies, Gather, hf_config_for_export, hf_copies, stage_hf_weights, write_hf_checkpoint
from ..weights.io import _parse_size, check_output_dir
from ..weights.rules import BoundRule, RuleStep

Model = Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]]

_ALIGN = 64  # bytes; every tensor in a bucket starts at a multiple (views of any dtype stay legal)


@dataclass(frozen=True)
class ExportEntry:
    """One HF tensor of the model as export will produce it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int  # pipeline rank that holds it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _all_gather(piece: torch.Tensor, axis: int, group: Any, size: int) -> torch.Tensor:
    piece = piece.contiguous()
    parts = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(parts, piece, group=group)
    return torch.cat(parts, dim=axis)


def tp_gather(step: RuleStep) -> Optional[Gather]:
    """The all-gather of a rule step's tensor-parallel pieces over its TP group (the expert TP
    group for expert rules); ``None`` where that size is 1."""
    size, group = step.ctx.tp_size, step.tp_group
    if size == 1:
        return None
    return lambda piece, axis: _all_gather(piece, axis, group, size)


def expert_copies_for(handle: ModelHandle) -> Optional[ExpertCopies]:
    """``expert_copies(bound, tensor, meta)``: this local expert as every EP rank holds it,
    all-gathered over the EP group (rank order = global expert order); ``None`` at EP 1."""
    placement = handle.placement
    if placement.ep == 1 or handle.arch_config.moe is None:
        return None
    ep, ep_rank, group = placement.ep, placement.ep_rank, placement.groups.ep
    per_rank = handle.arch_config.moe.num_experts // ep

    # every EP rank's copy of a local expert's rule, bound once per model (HF names re-filled)
    bound = handle.derived("expert_copies", dict)

    def copies(b: BoundRule, tensor: torch.Tensor, meta: bool) -> list[tuple[BoundRule, torch.Tensor]]:
        rules = bound.get(b.hf)  # HF names: global layer and expert, unique over chunks
        if rules is None:
            local_index = b.expert - ep_rank * per_rank
            rules = bound[b.hf] = [b.for_expert(r * per_rank + local_index) for r in range(ep)]
        if meta:
            parts = [tensor.new_empty(tensor.shape) for _ in range(ep)]
        else:
            parts = [torch.empty_like(tensor) for _ in range(ep)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
        return list(zip(rules, parts))

    return copies


def export_plan(handle: ModelHandle, *, dtype: Optional[torch.dtype] = None, grads: bool = False) -> list[ExportEntry]:
    """Every HF tensor of the model in export order (collective over the pipeline group); ``grads``:
    of a gradient export (parameters only)."""
    placement = handle.placement
    local = [(vp, name, tuple(meta.shape), str(meta.dtype))
             for vp, steps in enumerate(_steps_by_stage(handle))
             for name, meta in _gathered(handle, steps, dtype=dtype, meta=True, grads=grads)]  # fmt: skip
    if placement.pp == 1:
        stages = [local]
    else:
        stages = [None] * placement.pp
        dist.all_gather_object(stages, local, group=placement.groups.pp)
    entries = [ExportEntry(name, shape, getattr(torch, dt.replace("torch.", "")), stage)
               for vp in range(placement.vpp)
               for stage, items in enumerate(stages)
               for item_vp, name, shape, dt in items if item_vp == vp]  # fmt: skip
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ZooError(f"HF tensor {e.name!r} is exported by more than one pipeline stage")
        seen.add(e.name)
    return entries


def _steps_by_stage(handle: ModelHandle) -> list[list[RuleStep]]:
    """The handle's export steps, per virtual-pipeline stage (chunk)."""
    stages: list[list[RuleStep]] = [[] for _ in handle.chunks]
    for step in handle.export_steps():
        stages[step.stage].append(step)
    return stages


def _gathered(handle: ModelHandle, steps: Sequence[RuleStep], **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`~mcore_zoo.weights.export.stage_hf_weights` of ``steps``, gathered over TP (expert
    TP) and EP, with the HF copies."""
    return stage_hf_weights(steps, copies=hf_copies(handle.weight_map), gather_for=tp_gather,
                            expert_copies=expert_copies_for(handle), **kwargs)  # fmt: skip


def _buckets(entries: list[ExportEntry], limit: int) -> list[list[ExportEntry]]:
    buckets: list[list[ExportEntry]] = []
    used = 0
    for e in entries:
        size = _aligned(e.nbytes)
        if buckets and buckets[-1][0].stage == e.stage and used + size <= limit:
            buckets[-1].append(e)
            used += size
        else:
            buckets.append([e])
            used = size
    return buckets


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _unpack(buffer: torch.Tensor, bucket: list[ExportEntry]) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for e in bucket:
        view = buffer[offset : offset + e.nbytes].view(e.dtype).view(e.shape)
        out.append((e.name, view))
        offset += _aligned(e.nbytes)
    return out


def iter_hf_buckets(
    model: Model,
    *,
    bucket_size: Union[int, str] = "512MB",
    dtype: Optional[torch.dtype] = None,
    ranks: Optional[Sequence[int]] = None,
    grads: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the model's HF tensors as lists ``[(hf_name, tensor), ...]`` of at most ``bucket_size``
    bytes, gathered over TP and PP (see module docstring). Every rank of the job must iterate to
    the end. ``ranks``: global ranks that receive buckets (default: all); the others yield nothing.
    Under pipeline parallelism the tensors of a bucket are views of one flat buffer; without it
    they may be views of the parameters themselves (TP = 1, an HF tensor that is a whole
    parameter): read them, do not modify them. Memory stays bounded when each bucket is released
    before the next is requested. ``grads=True`` gathers the parameters' gradients instead."""
    yield from _iter_buckets(handle_of(model), limit=_parse_size(bucket_size), dtype=dtype, ranks=ranks, grads=grads)


def _iter_buckets(handle: ModelHandle, *, limit: int, dtype: Optional[torch.dtype], ranks: Optional[Sequence[int]],
                  grads: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:  # fmt: skip
    """:func:`iter_hf_buckets` of a handle, ``limit`` bytes per bucket."""
    handle.check_current()
    placement = handle.placement
    wanted = None if ranks is None else set(int(r) for r in ranks)
    me = placement.rank
    # Expert parallelism: expert tensors are all-gathered over the EP group, which spans
    # model-parallel groups, so every rank takes part in the gathers (and yields nothing unless
    # it is in ``ranks``); the shortcut below is for EP = 1 only.
    if wanted is not None and placement.groups.model_parallel is not None and placement.ep == 1:
        group_ranks = dist.get_process_group_ranks(placement.groups.model_parallel)
        if not wanted.intersection(group_ranks):
            return  # no receiver in this model-parallel group: nothing to gather
    receive = wanted is None or me in wanted
    local = _gathered(handle, handle.export_steps(), dtype=dtype, grads=grads)
    if placement.pp == 1:
        bucket: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, tensor in local:  # TP gathers happen here, on every TP rank
            size = _aligned(tensor.numel() * tensor.element_size())
            if bucket and used + size > limit:
                if receive:
                    yield bucket
                bucket, used = [], 0
            bucket.append((name, tensor))
            used += size
        if bucket and receive:
            yield bucket
        return
    entries = export_plan(handle, dtype=dtype, grads=grads)
    pp_group = placement.groups.pp
    pp_ranks = dist.get_process_group_ranks(pp_group)
    destinations = [r for r in pp_ranks if wanted is None or r in wanted]
    device = handle.device
    for bucket_entries in _buckets(entries, limit):
        owner = bucket_entries[0].stage
        src = pp_ranks[owner]
        total = sum(_aligned(e.nbytes) for e in bucket_entries)
        if placement.pp_rank == owner:
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            for (name, view), e in zip(_unpack(buffer, bucket_entries), bucket_entries):
                got_name, tensor = next(local)
                if got_name != e.name or tuple(tensor.shape) != e.shape:
                    raise ZooError(f"export plan out of step: planned {e.name} {e.shape}, got {got_name} {tuple(tensor.shape)}")
                view.copy_(tensor)
                del tensor
        elif me in destinations:
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            buffer = None
        _move(buffer, src, me, destinations, pp_ranks, pp_group)
        if receive and buffer is not None:
            yield _unpack(buffer, bucket_entries)
        del buffer
    if next(local, None) is not None:
        raise ZooError("export plan out of step: this stage has tensors the plan does not list")


def _move(buffer: Optional[torch.Tensor], src: int, me: int, destinations: list[int], pp_ranks: list[int], group: Any) -> None:
    """Bring the owner's bucket to the destinations of this pipeline group."""
    others = [r for r in destinations if r != src]
    if not others:
        return
    if set(others) == set(pp_ranks) - {src}:
        dist.broadcast(buffer, src=src, group=group)
    elif me == src:
        for r in others:
            dist.send(buffer, dst=r)
    elif me in others:
        dist.recv(buffer, src=src)


def iter_hf_shards(
    model: Model,
    target_tp: int,
    *,
    target_rank: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    ranks: Optional[Sequence[int]] = None,
    bucket_size: Union[int, str] = "512MB",
) -> Iterator[tuple[str, Union[torch.Tensor, list[torch.Tensor]]]]:
    """HF tensors split for an inference engine running at tensor-parallel size ``target_tp``.

    Yields ``(hf_name, shards)`` with ``shards[r]`` what inference rank ``r`` holds (replicated
    tensors: the same tensor ``target_tp`` times), or ``(hf_name, shard)`` for one ``target_rank``.
    Splits follow the rule table's TP axes - column-parallel weights by rows, row-parallel ones by
    columns, the vocabulary by rows - and fused HF tensors part by part (rank ``r`` of
    ``qkv_proj`` is ``[q_r; k_r; v_r]``). Raises :class:`LayoutError` up front when ``target_tp``
    does not divide the model (heads, KV heads, FFN, vocab). Same collective contract as
    :func:`mcore_zoo.iter_hf_weights`.
    """
    handle = handle_of(model)
    validate_layout(handle.arch_config, Parallelism(tp=target_tp))
    if target_rank is not None and not 0 <= target_rank < target_tp:
        raise LayoutError(f"target_rank {target_rank} is not in [0, {target_tp})")
    parts = handle.weight_map.hf_parts()
    ranks_wanted = range(target_tp) if target_rank is None else [target_rank]
    for name, tensor in _iter_hf_weights(handle, dtype=dtype, ranks=ranks, bucket_size=bucket_size):
        shards = [hf_shard(tensor, parts[name], rank, target_tp, name) for rank in ranks_wanted]
        yield name, (shards if target_rank is None else shards[0])


def hf_shard(tensor: torch.Tensor, parts: Sequence[tuple[BoundRule, int]], rank: int, size: int, name: str) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s shard of a whole HF tensor made by ``parts`` (its rule sources,
    :meth:`~mcore_zoo.weights.rules.WeightMap.hf_parts`): each part's TP slice, parts of a fused HF
    tensor concatenated back (rank ``r`` of ``qkv_proj`` is ``[q_r; k_r; v_r]``)."""
    slices = [b.tp_slice(k, rank, size) for b, k in parts]
    pieces = [s.cut(tensor, name if s.select is None else f"{name}[{s.select[1]}:{s.select[2]}]") for s in slices]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=slices[0].select[0])  # type: ignore[index]


def iter_hf_weights(
    model: Model,
    *,
    gather_tp: bool = True,
    dtype: Optional[torch.dtype] = None,
    ranks: Optional[Sequence[int]] = None,
    bucket_size: Union[int, str] = "512MB",
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor of the model, from any layout.

    Every rank of the job must iterate to the end (the iteration issues collectives). By default
    every rank receives every tensor, gathered over TP and PP (model order, one bucket of at most
    ``bucket_size`` bytes - or one tensor, if larger - alive at a time). ``ranks``: only these
    global ranks receive tensors; the others yield nothing (a model-parallel group without any of
    them does no work at all). ``gather_tp=False``: each rank yields the pieces it holds, for its
    own pipeline stage only, without communication. Tensors are detached; ``dtype`` casts them
    (before any transfer). ``grads=True`` yields the parameters' gradients under HF names instead
    (gradient parity checks).
    """
    yield from _iter_hf_weights(handle_of(model), gather_tp=gather_tp, dtype=dtype, ranks=ranks, bucket_size=bucket_size, grads=grads)


def _iter_hf_weights(handle: ModelHandle, *, gather_tp: bool = True, dtype: Optional[torch.dtype] = None,
                     ranks: Optional[Sequence[int]] = None, bucket_size: Union[int, str] = "512MB",
                     grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """:func:`iter_hf_weights` of a handle."""
    if not gather_tp:
        yield from stage_hf_weights(handle.export_steps(), copies=hf_copies(handle.weight_map), dtype=dtype, grads=grads)
        return
    for bucket in _iter_buckets(handle, limit=_parse_size(bucket_size), dtype=dtype, ranks=ranks, grads=grads):
        yield from bucket


def save_hf_checkpoint(
    model: Model,
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    writer_rank: int = 0,
    fp8: bool = False,
    fp8_scales: str = "fresh",
) -> list[str]:
    """Write a complete HF checkpoint (safetensors + config.json) that transformers loads, with the
    tokenizer files and ``generation_config.json`` of the checkpoint the model was loaded from.

    ``fp8``: write the FP8 block format of the FP8 checkpoint the model was loaded from (for an FP8
    inference engine): the tensors that were quantized there as e4m3 ``X.weight`` +
    ``X.weight_scale_inv``, the rest as ``dtype``, ``quantization_config`` kept. ``fp8_scales``:
    ``"fresh"`` (transformers' quantizer; a block that is an exact dequantization gets back a scale
    that reproduces it, so an fp32 model loaded from FP8 and not trained exports the identical
    bytes) or ``"source"`` (the loaded ``weight_scale_inv``: identical bytes from any dtype; values
    beyond ``448 * scale`` saturate). See docs/fp8.md.

    Any layout: in a multi-process job every rank calls it; global rank ``writer_rank`` gathers
    the tensors (bucket by bucket) and writes, the others take part in the gathers. Every rank
    returns the weight file names, or raises if the writer failed. Nothing is left at ``out_dir``
    if any step fails.
    """
    handle = handle_of(model)
    needed = handle.weight_map.export_names()
    config = hf_config_for_export(handle.arch_config, dtype, fp8=fp8, head=handle.head)
    quantize = _fp8_export(handle, fp8, fp8_scales)
    needed = needed | set(_fp8_scale_names(handle)) if fp8 else needed
    if not handle.placement.distributed:
        return write_hf_checkpoint(quantize(iter_hf_weights(handle, dtype=dtype)), out_dir, needed=needed, config=config,
                                   max_shard_size=max_shard_size, overwrite=overwrite, assets=handle.hf_source)  # fmt: skip
    writer = handle.placement.rank == writer_rank
    verdict: list[Any] = [None]
    if writer:  # a refusal known up front must not leave the other ranks inside the gathers
        try:
            check_output_dir(out_dir, overwrite=overwrite)
        except FileExistsError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=writer_rank)
    if verdict[0] is not None:
        raise FileExistsError(verdict[0])
    items = quantize(iter_hf_weights(handle, dtype=dtype, ranks=[writer_rank]))
    outcome: list[Any] = [None]
    if writer:
        try:
            outcome[0] = ("ok", write_hf_checkpoint(items, out_dir, needed=needed, config=config, max_shard_size=max_shard_size,
                                                    overwrite=overwrite, assets=handle.hf_source))  # fmt: skip
        except Exception as exc:
            outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
            _drain(items)  # keep the collectives matched so the other ranks get the verdict
    else:
        _drain(items)
    dist.broadcast_object_list(outcome, src=writer_rank)
    status, value = outcome[0]
    if status != "ok":
        raise ZooError(f"save_hf_checkpoint failed on rank {writer_rank}: {value}")
    return value


def _fp8_scale_names(handle: ModelHandle) -> list[str]:
    return list(handle.fp8_source.plan.quantized.values())


def _fp8_export(handle: ModelHandle, fp8: bool, fp8_scales: str) -> Any:
    """Identity, or the FP8 quantization of the export items (see :func:`save_hf_checkpoint`)."""
    if not fp8:
        return lambda items: items
    if fp8_scales not in ("fresh", "source"):
        raise ValueError(f"fp8_scales={fp8_scales!r}; use 'fresh' or 'source'")
    source = handle.fp8_source
    if source is None:
        raise ZooError("save_hf_checkpoint(fp8=True) writes the FP8 format of the checkpoint the model was loaded"
                       " from; this model was not loaded from an FP8 block-quantized checkpoint")  # fmt: skip
    from ..weights.fp8 import quantize_for_export

    scales = source.scales if fp8_scales == "source" else None
    return lambda items: quantize_for_export(items, source.plan.quantized, source.fmt, scales=scales)


def _drain(items: Iterator[Any]) -> None:
    for _ in items:
        pass


__all__ = ["ExportEntry", "export_plan", "iter_hf_buckets", "iter_hf_shards", "iter_hf_weights", "save_hf_checkpoint", "tp_gather", "expert_copies_for", "hf_shard"]
