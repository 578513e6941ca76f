"""Export a zoo-built model back to HF names: the single-rank part, derived from the same rule
table as loading.

:func:`stage_hf_weights` turns rule steps (the plain values the model handle makes: bound rule,
tensor reference, transform context) into ``(hf_name, tensor)`` per rule (split each mcore tensor
into its HF pieces; a caller-given ``gather`` joins tensor-parallel pieces), and
:func:`write_hf_checkpoint` writes such items as an HF checkpoint (sharded safetensors + index +
config.json), atomically. The job-wide export - TP gathers, pipeline buckets, re-sharding,
``save_hf_checkpoint`` - is :mod:`mcore_zoo.distributed.export`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..config.arch import ArchConfig
from ..errors import MissingTensorsError, ZooError
from ..hf_assets import copy_assets
from ..progress import progress
from .io import SafetensorsShardWriter, atomic_output_dir
from .rules import BoundRule, RuleStep, TransformContext, WeightMap, direct_views

logger = logging.getLogger(__name__)

#: ``gather(piece, axis)``: join this rank's tensor-parallel piece with the other TP ranks' pieces
Gather = Callable[[torch.Tensor, int], torch.Tensor]
#: ``expert_gather(tensor)``: every expert-parallel rank's copy of a local expert's tensor, in EP rank order
ExpertGather = Callable[[torch.Tensor], list[torch.Tensor]]

_ALIGN = 64  # bytes; every tensor in a bucket starts at a multiple (views of any dtype stay legal)


def stage_hf_weights(
    steps: Sequence[RuleStep],
    *,
    copies: Optional[Mapping[str, Sequence[str]]] = None,
    gather_for: Optional[Callable[[RuleStep], Optional[Gather]]] = None,
    expert_gather: Optional[ExpertGather] = None,
    dtype: Optional[torch.dtype] = None,
    meta: bool = False,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for the HF tensors of ``steps`` (the rules a rank's chunks export, in
    model order: :meth:`~mcore_zoo.handle.ModelHandle.export_steps`), each followed by its
    ``copies`` (:func:`hf_copies`).

    ``gather_for(step)`` gives the function that joins a rule's tensor-parallel pieces (``None``,
    or no ``gather_for``: each rank's own pieces). ``expert_gather(tensor)`` gives every
    expert-parallel rank's copy of a local expert's tensor, exported under the rules of
    ``step.ep_rules`` (``None``: only this rank's experts). Both are supplied by
    :mod:`mcore_zoo.distributed.export`, which owns the collectives. ``meta=True`` yields meta
    tensors of the shapes and dtypes the real iteration would yield (gathered shapes where a
    gather is given), without reading a parameter or communicating (export planning).
    ``grads=True`` yields the parameters' ``.grad`` instead (a parameter without a gradient raises;
    checkpoint-state buffers such as an MoE router's ``expert_bias`` are left out). ``dtype`` casts
    what the parameters export; a checkpoint-state buffer keeps its own dtype (the fp32
    ``e_score_correction_bias``, as published checkpoints and vLLM hold it).
    """
    copies_of = copies or {}
    stacks = ExpertStacks()
    for step in steps:
        b = step.bound
        local = _local_tensor(step, meta=meta, grads=grads)
        if local is None:
            continue
        ctx = step.ctx
        cast = export_dtype(step, dtype)
        gather = gather_for(step) if gather_for is not None else None
        if gather is not None and meta:
            gather = _meta_gather(ctx.tp_size)
        pairs: Iterable[tuple[BoundRule, torch.Tensor]] = [(b, local)]
        if expert_gather is not None and step.ep_rules:
            parts = [local.new_empty(local.shape) for _ in step.ep_rules] if meta else expert_gather(local)
            pairs = zip(step.ep_rules, parts)
        for rb, tensor in pairs:
            for name, piece in stacks.add(rb, ctx, export_rule(rb, tensor, ctx, gather)):
                piece = piece.to(cast) if cast is not None else piece
                yield name, piece
                for copy in copies_of.get(name, ()):  # e.g. an MTP layer's embed_tokens / shared_head.head
                    yield copy, piece
    stacks.check_done()


class ExpertStacks:
    """Collects the experts' slices of stacked-experts HF tensors (``Source.expert_axis``) as
    export produces them, and hands each tensor on once every expert's slice is in: the rules of a
    layer's experts come one after another, so at most one layer's stacked tensors wait here."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, b: BoundRule, ctx: TransformContext,
            items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """``items`` (the HF tensors of rule ``b``), the stacked ones held back until complete."""
        stacked = {name: select for name, select, flag in zip(b.hf, b.selects, b.stacked) if flag and select}
        for name, piece in items:
            if name not in stacked:
                yield name, piece
                continue
            axis, start, _ = stacked[name]
            parts = self._parts.setdefault(name, {})
            parts[start] = piece
            total = ctx.arch.moe.num_experts if ctx.arch.moe is not None else 0
            if len(parts) == total:
                del self._parts[name]
                yield name, torch.cat([parts[e] for e in range(total)], dim=axis)

    def check_done(self) -> None:
        """Raise :class:`ZooError` naming a stacked tensor some of whose experts never came."""
        if self._parts:
            name, parts = next(iter(self._parts.items()))
            raise ZooError(f"export: {name!r} stacks every expert, but only experts {sorted(parts)} were exported"
                           " (export experts gathered over expert parallelism)")  # fmt: skip



def export_dtype(step: RuleStep, dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype an export asked for ``dtype`` casts ``step``'s tensors to: ``dtype`` for a
    parameter, ``None`` (its own dtype) for a checkpoint-state buffer - an MoE router's fp32
    score-correction bias, which published checkpoints store and engines keep in fp32 (a rounded
    bias chooses other experts)."""
    return dtype if isinstance(step.tensor(), torch.nn.Parameter) else None


def _local_tensor(step: RuleStep, *, meta: bool, grads: bool) -> Optional[torch.Tensor]:
    """What a step exports on this rank: its tensor (or gradient), detached, or a meta tensor of
    its shape; ``None`` for a buffer or a frozen parameter in a gradient export."""
    param = step.tensor()
    if grads and not isinstance(param, torch.nn.Parameter):  # a buffer (MoE expert_bias): no gradient
        return None
    if grads and not param.requires_grad:  # frozen (the DSA indexer, as transformers' no_grad): no gradient
        return None
    if meta:
        return torch.empty(param.shape, dtype=param.dtype, device="meta")
    if not grads:
        return param.detach()
    grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)  # DDP keeps main_grad
    if grad is None:
        raise ZooError(f"parameter {step.bound.mcore!r} has no gradient")
    return grad.detach()


#: one rule a chunk exports, bound once: see :class:`~mcore_zoo.weights.rules.RuleStep`
ExportStep = RuleStep


def hf_copies(weight_map: WeightMap) -> dict[str, list[str]]:
    """HF name -> the copies export writes next to it (:meth:`WeightMap.copies_of`)."""
    out: dict[str, list[str]] = {}
    for copy, source in weight_map.copies:
        out.setdefault(source, []).append(copy)
    return out


@dataclass(frozen=True)
class ExportEntry:
    """One HF tensor of the model as export will produce it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int  # pipeline rank that holds it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_entries(stages: Sequence[Sequence[tuple[int, str, tuple[int, ...], str]]], vpp: int) -> list[ExportEntry]:
    """The whole model's :class:`ExportEntry` list in export order (virtual stage by virtual stage,
    pipeline stage by pipeline stage) from every pipeline stage's ``(virtual stage, name, shape,
    dtype)`` items. Raises :class:`ZooError` for a tensor two stages export."""
    entries = [ExportEntry(name, shape, getattr(torch, dt.replace("torch.", "")), stage)
               for vp in range(vpp)
               for stage, items in enumerate(stages)
               for item_vp, name, shape, dt in items if item_vp == vp]  # fmt: skip
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise ZooError(f"HF tensor {e.name!r} is exported by more than one pipeline stage")
        seen.add(e.name)
    return entries


def aligned_nbytes(n: int) -> int:
    """``n`` bytes rounded up to where the next tensor of a bucket starts."""
    return -(-n // _ALIGN) * _ALIGN


def bucket_entries(entries: Sequence[ExportEntry], limit: int) -> list[list[ExportEntry]]:
    """Consecutive entries of one pipeline stage, at most ``limit`` bytes a bucket (a larger tensor
    is a bucket of its own)."""
    buckets: list[list[ExportEntry]] = []
    used = 0
    for e in entries:
        size = aligned_nbytes(e.nbytes)
        if buckets and buckets[-1][0].stage == e.stage and used + size <= limit:
            buckets[-1].append(e)
            used += size
        else:
            buckets.append([e])
            used = size
    return buckets


def bucket_items(items: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``items`` in lists of at most ``limit`` bytes (a larger tensor is a list of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in items:
        size = aligned_nbytes(tensor.numel() * tensor.element_size())
        if bucket and used + size > limit:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


def unpack_bucket(buffer: torch.Tensor, bucket: Sequence[ExportEntry]) -> list[tuple[str, torch.Tensor]]:
    """The entries of ``bucket`` as views of the flat byte ``buffer`` that carries them."""
    out, offset = [], 0
    for e in bucket:
        view = buffer[offset : offset + e.nbytes].view(e.dtype).view(e.shape)
        out.append((e.name, view))
        offset += aligned_nbytes(e.nbytes)
    return out


def pack_bucket(buffer: torch.Tensor, bucket: Sequence[ExportEntry], items: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy the next ``len(bucket)`` export items into ``buffer``, each checked against its entry."""
    for (_, view), e in zip(unpack_bucket(buffer, bucket), bucket):
        got_name, tensor = next(items)
        if got_name != e.name or tuple(tensor.shape) != e.shape:
            raise ZooError(f"export plan out of step: planned {e.name} {e.shape}, got {got_name} {tuple(tensor.shape)}")
        view.copy_(tensor)
        del tensor


def check_planned_shape(what: str, planned: tuple[int, ...], got: Optional[tuple[int, ...]]) -> None:
    """Raise unless the model's piece ``what`` has the shape a refit plan was made for."""
    if got != planned:
        raise ZooError(f"refit: {what}: planned shape {planned}, the model's is {got} (plan made for another model?)")


def export_views(b: BoundRule, tensor: torch.Tensor, ctx: TransformContext, *,
                 chunk: bool = False) -> Optional[list[tuple[str, Any, torch.Tensor]]]:  # fmt: skip
    """The HF pieces of rule ``b`` as views of its mcore ``tensor``, without a copy, where the
    transform allows it: ``(hf_name, select, view)`` per source, in source order. ``chunk=True``:
    under tensor parallelism too, each view then holds this rank's TP chunk of its piece (what the
    rank has, before any gather; a transform works on its rank's chunks).

    A view holds its piece's elements in row-major order (the ``views`` contract of
    :class:`~.rules.Transform`), possibly in another shape: QKV's q view is ``[groups, q_rows,
    ...]`` for the HF ``[groups * q_rows, ...]``. ``view.reshape(piece_shape)`` is what
    :func:`export_rule` yields for that source (before fused HF parts are concatenated). ``None``
    when there are no trusted views (:func:`~.rules.direct_views`), when the pieces need a
    tensor-parallel gather (``ctx.tp_size > 1`` without ``chunk``) or a finishing step (a padded
    vocabulary), or when ``tensor`` cannot be viewed so."""
    if (ctx.tp_size != 1 and not chunk) or getattr(b.transform, "finish", None) is not None:
        return None
    try:
        views = direct_views(b.transform, tensor, ctx)
    except RuntimeError:  # a layout the transform's views do not accept (non-contiguous)
        return None
    if views is None or len(views) != len(b.hf):
        return None
    return list(zip(b.hf, b.selects, views))


def exports(b: BoundRule, chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` exports rule ``b``: not a rule marked ``export=False`` (a tied output
    layer), nor the embedding of a chunk that only keeps a copy of the first stage's (the MTP
    block's, on a pipeline's last stage)."""
    if not b.rule.export:
        return False
    return not (b.mcore.startswith("embedding.") and getattr(chunk, "pre_process", True) is False)


def _meta_gather(size: int) -> Gather:
    """What a TP gather of ``size`` pieces returns, as a meta tensor."""

    def gather(piece: torch.Tensor, axis: int) -> torch.Tensor:
        shape = list(piece.shape)
        shape[axis] *= size
        return piece.new_empty(shape)

    return gather


def export_rule(
    b: BoundRule,
    tensor: torch.Tensor,
    ctx: TransformContext,
    gather: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one bound rule from its mcore tensor (``gather(piece, axis)`` joins
    tensor-parallel pieces; ``None``: the pieces as they are). Parts of a fused HF tensor
    (``Source.select``) are concatenated back into it."""
    parts: dict[str, list[tuple[tuple[int, int, int], torch.Tensor]]] = {}
    finish = getattr(b.transform, "finish", None)  # e.g. a padded vocabulary loses its padding rows
    if finish is not None and gather is None and ctx.tp_size > 1:
        raise ZooError(f"{b.mcore!r} ({b.transform}): exported only gathered over tensor parallelism")
    for name, axis, select, piece in zip(b.hf, b.tp_axes, b.selects, b.transform.split(tensor, ctx)):
        if gather is not None and axis is not None:
            piece = gather(piece, axis)
        if finish is not None:
            piece = finish(piece)
        if select is not None:  # a part of a fused HF tensor: emit once all parts are here
            parts.setdefault(name, []).append((select, piece))
            continue
        yield name, piece
    for name, selected in parts.items():
        selected.sort(key=lambda item: item[0][1])
        yield name, torch.cat([piece for _, piece in selected], dim=selected[0][0][0])


def hf_config_for_export(arch: ArchConfig, dtype: Optional[torch.dtype] = None, *, fp8: bool = False, head: str = "lm") -> dict[str, Any]:
    """The HF config dict to save next to exported weights of a model of ``arch`` (``head="value"``:
    a critic). The source's ``quantization_config`` is kept only for an FP8 export (the weights
    are otherwise written dequantized)."""
    config = dict(arch.hf_config)
    if not fp8:
        config.pop("quantization_config", None)
    config.setdefault("architectures", [arch.architecture])
    if head == "value":  # a critic: transformers' token classifier, one label
        name = arch.architecture
        base = name[: -len("ForCausalLM")] if name.endswith("ForCausalLM") else name
        config.update(architectures=[base + "ForTokenClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = name
        if "dtype" not in config and "torch_dtype" not in config:
            config["torch_dtype"] = name
    return config


def write_hf_checkpoint(
    items: Iterator[tuple[str, torch.Tensor]],
    out_dir: Union[str, os.PathLike],
    *,
    needed: set[str],
    config: dict[str, Any],
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    inputs: Sequence[Union[str, os.PathLike]] = (),
    assets: Optional[Union[str, os.PathLike]] = None,
) -> list[str]:
    """Write ``(hf_name, tensor)`` items as an HF checkpoint (atomically); every name in ``needed``
    must come by. Returns the weight file names. ``inputs``: directories the output may not be
    or contain; ``assets``: a directory whose tokenizer files and ``generation_config.json`` are
    copied next to the weights (:mod:`mcore_zoo.hf_assets`)."""
    with atomic_output_dir(out_dir, overwrite=overwrite, inputs=inputs) as tmp:
        writer = SafetensorsShardWriter(tmp, max_shard_size, metadata={"producer": "mcore-zoo"})
        written = set()
        for name, tensor in progress(items, total=len(needed), desc="writing HF checkpoint", unit="tensor"):
            writer.add(name, tensor)
            written.add(name)
        missing = needed - written
        if missing:
            raise MissingTensorsError(sorted(missing), source="export")
        files = writer.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_assets(assets, tmp)
    logger.info("wrote HF checkpoint %s: %d tensors in %d file(s)", out_dir, len(written), len(files))
    return files
