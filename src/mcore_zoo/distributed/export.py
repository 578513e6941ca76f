"""Export from any TP / PP / VPP layout to HF names, in bounded buckets (rollout weight sync).

The model's handle hands this module its export steps once (:meth:`~mcore_zoo.handle.ModelHandle.export_steps`:
each exported rule bound to its tensor, transform context, TP group and expert-parallel copies);
everything below works on those values. :func:`hf_items` is the one export path:
:func:`iter_hf_weights`, :func:`iter_hf_buckets`, :func:`iter_hf_shards`, :func:`save_hf_checkpoint`
and :func:`mcore_zoo.refit` all go through it.

1. *Plan* (no data moves): each rank lists the HF tensors its chunks export - names, gathered
   shapes, dtypes - by running the export on meta tensors; the pipeline stages exchange their lists
   (one ``all_gather_object`` over the pipeline group). Every rank now knows the whole model in HF
   order (virtual stage by virtual stage), which stage owns each tensor and how a bucket of each
   stage reaches the ranks that want it.
2. *Buckets*: consecutive tensors of one stage, at most ``bucket_size`` bytes (a larger tensor is
   a bucket of its own; :func:`~mcore_zoo.weights.export.bucket_entries`).
3. *Move*: the owning stage's TP ranks all-gather each tensor's pieces (the same rule table as
   loading; QKV / gate-up split per group / half), pack the bucket into one flat buffer and send it
   over the pipeline group - ``broadcast`` when every stage wants it, point-to-point sends to the
   chosen ranks otherwise. Receivers unpack views of the buffer.

Memory per rank: one bucket, plus - on the owner - one gathered tensor while it is packed.

:func:`iter_hf_shards` re-splits each gathered tensor for a target inference TP size with the
rules' own :class:`~mcore_zoo.weights.rules.TPSlice` (fused HF tensors such as ``qkv_proj`` part
by part), so a rollout rank receives exactly its shard.

Ranks and groups come from the model's handle (:class:`~mcore_zoo.placement.Placement`); this module
and :mod:`mcore_zoo.distributed.load` / :mod:`~mcore_zoo.distributed.forward` are the only places
that issue collectives.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..config.transformer import validate_layout
from ..errors import LayoutError, ZooError
from ..handle import ModelHandle, handle_of
from ..placement import Parallelism, Placement
from ..weights.export import (
    ExpertGather,
    ExportEntry,
    Gather,
    aligned_nbytes,
    bucket_entries,
    bucket_items,
    export_entries,
    hf_config_for_export,
    hf_copies,
    pack_bucket,
    stage_hf_weights,
    unpack_bucket,
    write_hf_checkpoint,
)
from ..weights.fp8 import fp8_export, fp8_scale_names
from ..weights.fp8_quantize import Fp8BlockScheme
from ..weights.mxfp4 import mxfp4_export, mxfp4_names
from ..weights.io import check_output_dir, parse_size
from ..weights.rules import BoundRule, RuleStep, WeightMap

Model = Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]]


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


def expert_gather(placement: Placement) -> Optional[ExpertGather]:
    """The all-gather of a local expert's tensor over the expert-parallel group (rank order =
    global expert order); ``None`` at EP 1."""
    if placement.ep == 1:
        return None
    ep, group = placement.ep, placement.groups.ep

    def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    return gather


def export_plan(handle: ModelHandle, *, dtype: Optional[torch.dtype] = None, grads: bool = False) -> list[ExportEntry]:
    """Every HF tensor of the model in export order (collective over the pipeline group); ``grads``:
    of a gradient export (parameters only)."""
    return _export_plan(handle.export_steps(), handle.weight_map, handle.placement, dtype=dtype, grads=grads)


def _export_plan(steps: Sequence[RuleStep], weight_map: WeightMap, placement: Placement, *,
                 dtype: Optional[torch.dtype], grads: bool) -> list[ExportEntry]:  # fmt: skip
    """:func:`export_plan` of this rank's export ``steps``: their meta export (gathered shapes),
    exchanged between the pipeline stages."""
    ep, copies = expert_gather(placement), hf_copies(weight_map)
    by_stage = [[s for s in steps if s.stage == vp] for vp in range(placement.vpp)]
    local = [(vp, name, tuple(meta.shape), str(meta.dtype))
             for vp, stage_steps in enumerate(by_stage)
             for name, meta in stage_hf_weights(stage_steps, copies=copies, gather_for=tp_gather, expert_gather=ep,
                                                dtype=dtype, meta=True, grads=grads)]  # fmt: skip
    if placement.pp == 1:
        stages = [local]
    else:
        stages = [None] * placement.pp
        dist.all_gather_object(stages, local, group=placement.groups.pp)
    return export_entries(stages, placement.vpp)


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
    handle = handle_of(model)
    handle.check_current()
    yield from _iter_buckets(handle.export_steps(), handle.weight_map, handle.placement, handle.device,
                             limit=parse_size(bucket_size), dtype=dtype, ranks=ranks, grads=grads)  # fmt: skip


def _iter_buckets(steps: Sequence[RuleStep], weight_map: WeightMap, placement: Placement, device: torch.device, *,
                  limit: int, dtype: Optional[torch.dtype], ranks: Optional[Sequence[int]],
                  grads: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:  # fmt: skip
    """:func:`iter_hf_buckets` of this rank's export ``steps`` (the handle's, checked current),
    ``limit`` bytes per bucket."""
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
    ep = expert_gather(placement)
    # the plan first (pipeline stages: which stage sends which tensor to whom), then the data
    destinations: list[int] = []
    moves: list[Callable[[Optional[torch.Tensor]], None]] = []
    if placement.pp > 1:
        pp_ranks = dist.get_process_group_ranks(placement.groups.pp)
        destinations = [r for r in pp_ranks if wanted is None or r in wanted]
        moves = [_pipeline_move(src, me, destinations, pp_ranks, placement.groups.pp) for src in pp_ranks]
    entries = _export_plan(steps, weight_map, placement, dtype=dtype, grads=grads) if placement.pp > 1 else []
    local = stage_hf_weights(steps, copies=hf_copies(weight_map), gather_for=tp_gather, expert_gather=ep, dtype=dtype, grads=grads)
    if placement.pp == 1:
        yield from (bucket for bucket in bucket_items(local, limit) if receive)  # TP gathers happen here, on every TP rank
        return
    for bucket in bucket_entries(entries, limit):
        owner = bucket[0].stage
        sender = placement.pp_rank == owner
        buffer = None
        if sender or me in destinations:
            buffer = torch.empty(sum(aligned_nbytes(e.nbytes) for e in bucket), dtype=torch.uint8, device=device)
        if sender:
            pack_bucket(buffer, bucket, local)
        moves[owner](buffer)
        if receive and buffer is not None:
            yield unpack_bucket(buffer, bucket)
        del buffer
    if next(local, None) is not None:
        raise ZooError("export plan out of step: this stage has tensors the plan does not list")


def _pipeline_move(src: int, me: int, destinations: list[int], pp_ranks: list[int], group: Any) -> Callable[[Optional[torch.Tensor]], None]:
    """How a bucket of pipeline rank ``src`` reaches the destinations of this pipeline group, as
    this rank takes part: ``broadcast`` when every other stage wants it, point-to-point sends to the
    chosen ranks otherwise (nothing where no other rank wants it)."""
    others = [r for r in destinations if r != src]

    def move(buffer: Optional[torch.Tensor]) -> None:
        if not others:
            return
        if set(others) == set(pp_ranks) - {src}:
            dist.broadcast(buffer, src=src, group=group)
        elif me == src:
            for r in others:
                dist.send(buffer, dst=r)
        elif me in others:
            dist.recv(buffer, src=src)

    return move


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
    ``qkv_proj`` is ``[q_r; k_r; v_r]``): :func:`hf_shard`, the rules' own
    :class:`~mcore_zoo.weights.rules.TPSlice`. Raises :class:`LayoutError` up front when
    ``target_tp`` does not divide the model (heads, KV heads, FFN, vocab). Same collective contract
    as :func:`mcore_zoo.iter_hf_weights`.
    """
    handle = handle_of(model)
    parts = handle.weight_map.hf_parts()
    validate_layout(handle.arch_config, Parallelism(tp=target_tp))
    if target_rank is not None and not 0 <= target_rank < target_tp:
        raise LayoutError(f"target_rank {target_rank} is not in [0, {target_tp})")
    targets = range(target_tp) if target_rank is None else [target_rank]
    for name, tensor in iter_hf_weights(handle, dtype=dtype, ranks=ranks, bucket_size=bucket_size):
        shards = [hf_shard(tensor, parts[name], rank, target_tp, name) for rank in targets]
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
    (before any transfer), except checkpoint-state buffers, which keep their dtype (an MoE
    router's fp32 score-correction bias, as published checkpoints and vLLM hold it).
    ``grads=True`` yields the parameters' gradients under HF names instead (gradient parity
    checks).
    """
    handle = handle_of(model)
    if gather_tp:
        handle.check_current()
    steps = handle.export_steps()
    yield from hf_items(steps, handle.weight_map, handle.placement, handle.device, gather_tp=gather_tp, dtype=dtype,
                         ranks=ranks, limit=parse_size(bucket_size), grads=grads)  # fmt: skip


def hf_items(steps: Sequence[RuleStep], weight_map: WeightMap, placement: Placement, device: torch.device, *,
              gather_tp: bool = True, dtype: Optional[torch.dtype] = None, ranks: Optional[Sequence[int]] = None,
              limit: int = 512 * 2**20, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """:func:`iter_hf_weights` of this rank's export ``steps`` (the handle's
    :meth:`~mcore_zoo.handle.ModelHandle.export_steps`, checked current when gathered), for a
    caller that holds them: the one export path of ``iter_hf_weights``, ``save_hf_checkpoint`` and
    :func:`mcore_zoo.refit`."""
    if gather_tp:
        for bucket in _iter_buckets(steps, weight_map, placement, device, limit=limit, dtype=dtype, ranks=ranks, grads=grads):
            yield from bucket
        return
    yield from stage_hf_weights(steps, copies=hf_copies(weight_map), dtype=dtype, grads=grads)


def save_hf_checkpoint(
    model: Model,
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    writer_rank: Optional[int] = None,
    fp8: Union[bool, str] = False,
    fp8_scales: str = "fresh",
    mxfp4: bool = False,
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

    ``fp8="block"`` (any model, e.g. trained in bf16): the FP8 block format an FP8-serving vLLM
    loads (:class:`~mcore_zoo.weights.fp8_quantize.Fp8BlockScheme`: vLLM's block quantizer, 128 x
    128 blocks, fp32 ``amax / 448`` scales; linear layers quantized, embeddings, LM head, routers
    and norms kept in ``dtype``), quantized on the model's device, with its ``quantization_config``
    (``modules_to_not_convert`` naming what is kept). An ``Fp8BlockScheme`` may be passed instead
    of ``"block"`` (``scale_fmt="ue8m0"``: power-of-two scales). See docs/rollout.md.

    ``mxfp4``: write the routed experts of a model loaded from an MXFP4 checkpoint (gpt-oss as
    published) back as ``X_blocks`` / ``X_scales`` (:func:`~mcore_zoo.weights.mxfp4.mxfp4_export`;
    ``quantization_config`` kept): the loaded bytes again while every block is still on its FP4
    grid (an untrained model, any dtype); a tensor off the grid (trained weights) is refused by
    name, as MXFP4 quantization of arbitrary values is not what transformers writes.

    ``dtype``: the parameters' tensors are written in it; checkpoint-state buffers keep theirs (the
    fp32 ``e_score_correction_bias`` of DeepSeek-V3-style routers, as published checkpoints store it
    and transformers and vLLM load it: a rounded bias would choose other experts).

    Any layout: in a multi-process job every rank of the model calls it (every rank of the job, or
    the model's ranks when it is placed on part of the job); global rank ``writer_rank`` (default:
    the model's first rank) gathers the tensors (bucket by bucket) and writes, the others take part
    in the gathers. Every rank returns the weight file names, or raises if the writer failed.
    Nothing is left at ``out_dir`` if any step fails.
    """
    handle = handle_of(model)
    handle.check_current()
    writer_rank, group = _writer(handle.placement, writer_rank)
    steps = handle.export_steps()
    placement, weight_map = handle.placement, handle.weight_map
    if fp8 and mxfp4:
        raise ValueError("save_hf_checkpoint: fp8 and mxfp4 are two formats; ask for one")
    scheme = Fp8BlockScheme() if fp8 == "block" else fp8 if isinstance(fp8, Fp8BlockScheme) else None
    if scheme is None and fp8 not in (True, False):
        raise ValueError(f"save_hf_checkpoint: fp8={fp8!r}; use True (the loaded FP8 checkpoint's format) or 'block'")
    quantize = fp8_export(handle.fp8_source, fp8_scales) if fp8 is True else None
    needed = weight_map.export_names() | (fp8_scale_names(handle.fp8_source) if fp8 is True else set())
    if mxfp4:
        quantize = mxfp4_export(handle.mxfp4_source)
        needed = mxfp4_names(needed, handle.mxfp4_source)
    config = hf_config_for_export(handle.arch_config, dtype, fp8=fp8 is True or mxfp4, head=handle.head)
    if scheme is not None:  # a fresh FP8 block format: the model's tensors quantized as vLLM quantizes them
        quantize = scheme.quantize_items
        config["quantization_config"] = scheme.quantization_config(needed)
        needed = needed | scheme.scale_names(needed)
    distributed = placement.distributed
    writer = not distributed or placement.rank == writer_rank
    if distributed:  # a refusal known up front must not leave the other ranks inside the gathers
        verdict: list[Any] = [None]
        if writer:
            try:
                check_output_dir(out_dir, overwrite=overwrite)
            except FileExistsError as exc:
                verdict[0] = str(exc)
        dist.broadcast_object_list(verdict, src=writer_rank, group=group)
        if verdict[0] is not None:
            raise FileExistsError(verdict[0])
    items = hf_items(steps, weight_map, placement, handle.device, dtype=dtype, ranks=[writer_rank] if distributed else None)
    items = quantize(items) if quantize is not None else items
    outcome: list[Any] = [None]
    try:
        if writer:
            outcome[0] = ("ok", write_hf_checkpoint(items, out_dir, needed=needed, config=config, max_shard_size=max_shard_size,
                                                    overwrite=overwrite, assets=handle.hf_source))  # fmt: skip
    except Exception as exc:
        if not distributed:
            raise
        outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
    if not distributed:
        return outcome[0][1]
    deque(items, maxlen=0)  # the rest of the export (all of it off the writer): the other ranks' gathers need it
    dist.broadcast_object_list(outcome, src=writer_rank, group=group)
    status, value = outcome[0]
    if status != "ok":
        raise ZooError(f"save_hf_checkpoint failed on rank {writer_rank}: {value}")
    return value


def _writer(placement: Placement, writer_rank: Optional[int]) -> tuple[int, Any]:
    """The global rank that writes a checkpoint (default: the model's first rank) and the group
    over which the model's ranks agree on the outcome (``None``: the job's default group)."""
    ranks = placement.ranks
    if writer_rank is None:
        writer_rank = ranks[0] if ranks else 0
    if ranks is not None and writer_rank not in ranks:
        raise LayoutError(f"save_hf_checkpoint: writer_rank {writer_rank} holds no part of the model (placed on ranks"
                          f" {list(ranks)})")  # fmt: skip
    return writer_rank, placement.groups.every if ranks is not None else None


__all__ = ["ExportEntry", "export_plan", "iter_hf_buckets", "iter_hf_shards", "iter_hf_weights", "save_hf_checkpoint",
           "tp_gather", "expert_gather", "hf_shard", "hf_items"]  # fmt: skip
