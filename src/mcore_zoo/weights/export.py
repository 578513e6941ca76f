"""Export a zoo-built model back to HF names, derived from the same rule table as loading.

:func:`iter_hf_weights` is a streaming generator of ``(hf_name, tensor)`` for any layout: per
rule, split the local mcore tensor into its HF pieces and all-gather each piece along its TP axis;
under pipeline parallelism the stages' tensors are moved in bounded buckets
(:func:`mcore_zoo.distributed.export.iter_hf_buckets`). Only one rule's tensors (or one bucket)
are alive at a time. :func:`save_hf_checkpoint` writes a complete HF checkpoint (sharded
safetensors + index + config.json) atomically from any layout and refuses to finish if any HF
tensor of the model is missing from what was exported.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from ..build import as_chunks, model_info
from ..errors import MissingTensorsError, ZooError
from ..hf_assets import copy_assets, source_of
from ..progress import progress
from .io import SafetensorsShardWriter, atomic_output_dir, check_output_dir
from .load import bind_chunk
from .rules import BoundRule, TransformContext

logger = logging.getLogger(__name__)


def _gather_tp(piece: torch.Tensor, axis: int, group: Any, size: int) -> torch.Tensor:
    import torch.distributed as dist

    piece = piece.contiguous()
    parts = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(parts, piece, group=group)
    return torch.cat(parts, dim=axis)


def _tp_slot() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def iter_stage_hf_weights(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    *,
    gather_tp: bool = True,
    dtype: Optional[torch.dtype] = None,
    meta: bool = False,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for the HF tensors this rank's chunks hold (its pipeline stage only).

    With ``gather_tp`` tensor-parallel pieces are all-gathered (all TP ranks must iterate
    together). ``meta=True`` yields meta tensors of the shapes and dtypes the real iteration would
    yield, without reading a parameter or issuing a collective (export planning). ``grads=True``
    yields the parameters' ``.grad`` instead (a parameter without a gradient raises).
    """
    chunks = as_chunks(model)
    info = model_info(chunks[0])
    wmap = info.weight_map
    tp_rank, tp_size, group = _tp_slot()
    ctx = TransformContext(info.arch, tp_rank, tp_size)
    gather: Callable[[torch.Tensor, int], torch.Tensor]
    if meta:

        def gather(piece: torch.Tensor, axis: int) -> torch.Tensor:
            shape = list(piece.shape)
            shape[axis] *= tp_size
            return piece.new_empty(shape)

    else:

        def gather(piece: torch.Tensor, axis: int) -> torch.Tensor:
            return _gather_tp(piece, axis, group, tp_size)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None else t

    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for b in bind_chunk(wmap, chunk):
            if not b.rule.export:
                continue
            param = params[b.mcore]
            if grads and param.grad is None:
                raise ZooError(f"parameter {b.mcore!r} has no gradient")
            source = param.grad if grads else param
            local = torch.empty(param.shape, dtype=param.dtype, device="meta") if meta else source.detach()
            for name, tensor in export_rule(b, local, ctx, gather if gather_tp and tp_size > 1 else None):
                yield name, cast(tensor)


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


def iter_hf_weights(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
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
    if not gather_tp:
        yield from iter_stage_hf_weights(model, gather_tp=False, dtype=dtype, grads=grads)
        return
    from ..distributed.export import iter_hf_buckets

    for bucket in iter_hf_buckets(model, bucket_size=bucket_size, dtype=dtype, ranks=ranks, grads=grads):
        yield from bucket


def hf_config_for_export(model: Any, dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """The HF config dict to save next to exported weights."""
    info = model_info(as_chunks(model)[0])
    config = dict(info.arch.hf_config)
    config.setdefault("architectures", [info.arch.architecture])
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


def save_hf_checkpoint(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    writer_rank: int = 0,
) -> list[str]:
    """Write a complete HF checkpoint (safetensors + config.json) that transformers loads, with the
    tokenizer files and ``generation_config.json`` of the checkpoint the model was loaded from.

    Any layout: in a multi-process job every rank calls it; global rank ``writer_rank`` gathers
    the tensors (bucket by bucket) and writes, the others take part in the gathers. Every rank
    returns the weight file names, or raises if the writer failed. Nothing is left at ``out_dir``
    if any step fails.
    """
    import torch.distributed as dist

    chunks = as_chunks(model)
    info = model_info(chunks[0])
    needed = info.weight_map.hf_names()
    config = hf_config_for_export(chunks, dtype)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return write_hf_checkpoint(iter_hf_weights(chunks, dtype=dtype), out_dir, needed=needed, config=config,
                                   max_shard_size=max_shard_size, overwrite=overwrite, assets=source_of(chunks))  # fmt: skip
    writer = dist.get_rank() == writer_rank
    verdict: list[Any] = [None]
    if writer:  # a refusal known up front must not leave the other ranks inside the gathers
        try:
            check_output_dir(out_dir, overwrite=overwrite)
        except FileExistsError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=writer_rank)
    if verdict[0] is not None:
        raise FileExistsError(verdict[0])
    items = iter_hf_weights(chunks, dtype=dtype, ranks=[writer_rank])
    outcome: list[Any] = [None]
    if writer:
        try:
            outcome[0] = ("ok", write_hf_checkpoint(items, out_dir, needed=needed, config=config, max_shard_size=max_shard_size,
                                                    overwrite=overwrite, assets=source_of(chunks)))  # fmt: skip
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


def _drain(items: Iterator[Any]) -> None:
    for _ in items:
        pass
