"""Export a zoo-built model back to HF names, derived from the same rule table as loading.

:func:`iter_hf_weights` is a streaming generator of ``(hf_name, tensor)``: per rule, split the local
mcore tensor into its HF pieces and (``gather_tp``) all-gather each piece along its TP axis. Only
one rule's tensors are alive at a time. :func:`save_hf_checkpoint` writes a complete HF checkpoint
(sharded safetensors + index + config.json) atomically and refuses to finish if any HF tensor of
the model is missing from what was exported.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ..build import as_chunks, model_info
from ..errors import MissingTensorsError, ZooError
from .io import SafetensorsShardWriter, atomic_output_dir
from .load import bind_chunk
from .rules import TransformContext


def _gather_tp(piece: torch.Tensor, axis: int, group: Any, size: int) -> torch.Tensor:
    import torch.distributed as dist

    piece = piece.contiguous()
    parts = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(parts, piece, group=group)
    return torch.cat(parts, dim=axis)


def iter_hf_weights(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    *,
    gather_tp: bool = True,
    dtype: Optional[torch.dtype] = None,
    grads: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor this rank's chunks hold.

    With ``gather_tp`` (default) tensor-parallel pieces are all-gathered, so every TP rank yields
    full tensors (all TP ranks must iterate together). Without it each rank yields its own chunks.
    Pipeline stages yield their own layers only (see ``mcore_zoo.distributed`` for gathering
    across stages). Tensors are detached; ``dtype`` casts them. ``grads=True`` yields the
    parameters' ``.grad`` under HF names instead (gradient parity checks; a parameter without a
    gradient raises).
    """
    from megatron.core import parallel_state as ps

    chunks = as_chunks(model)
    info = model_info(chunks[0])
    wmap = info.weight_map
    if ps.model_parallel_is_initialized():
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_size = ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group()
    else:
        tp_rank, tp_size, group = 0, 1, None
    ctx = TransformContext(info.arch, tp_rank, tp_size)
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for b in bind_chunk(wmap, chunk):
            if not b.rule.export:
                continue
            param = params[b.mcore]
            if grads and param.grad is None:
                raise ZooError(f"parameter {b.mcore!r} has no gradient")
            local = (param.grad if grads else param).detach()
            pieces = b.transform.split(local, ctx)
            parts: dict[str, list[tuple[tuple[int, int, int], torch.Tensor]]] = {}
            for name, axis, select, piece in zip(b.hf, b.tp_axes, b.selects, pieces):
                if gather_tp and axis is not None and tp_size > 1:
                    piece = _gather_tp(piece, axis, group, tp_size)
                if select is not None:  # a part of a fused HF tensor: emit once all parts are here
                    parts.setdefault(name, []).append((select, piece))
                    continue
                yield name, piece.to(dtype) if dtype is not None else piece
            for name, selected in parts.items():
                selected.sort(key=lambda item: item[0][1])
                tensor = torch.cat([piece for _, piece in selected], dim=selected[0][0][0])
                yield name, tensor.to(dtype) if dtype is not None else tensor


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


def save_hf_checkpoint(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> list[str]:
    """Write a complete HF checkpoint (safetensors + config.json) that transformers loads.

    Single-process models (PP=1) only; for pipeline-parallel models use
    ``mcore_zoo.distributed.save_hf_checkpoint_distributed``. Nothing is left at ``out_dir`` if
    any step fails. Returns the weight file names.
    """
    chunks = as_chunks(model)
    info = model_info(chunks[0])
    if info.options.parallel.pp > 1:
        raise ZooError("save_hf_checkpoint needs the whole model in this process (pp=1)")
    needed = info.weight_map.hf_names()
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        writer = SafetensorsShardWriter(tmp, max_shard_size, metadata={"producer": "mcore-zoo"})
        written = set()
        for name, tensor in iter_hf_weights(chunks, dtype=dtype):
            writer.add(name, tensor)
            written.add(name)
        missing = needed - written
        if missing:
            raise MissingTensorsError(sorted(missing), source="export")
        files = writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config_for_export(chunks, dtype), indent=2, sort_keys=True) + "\n")
    return files
