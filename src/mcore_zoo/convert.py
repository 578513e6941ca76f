"""Offline conversion between HF checkpoints and Megatron-Core distributed checkpoints.

``hf_to_mcore`` loads an HF checkpoint into a zoo-built model and saves it with
``megatron.core.dist_checkpointing`` (``torch_dist`` format): the result loads at any TP/PP through
dist_checkpointing's resharding. ``mcore_to_hf`` goes back: load the distributed checkpoint into
a model of the recorded architecture, then write an HF checkpoint.

A ``mcore_zoo.json`` beside the distributed checkpoint records the architecture and the HF
config, so the way back needs nothing else. Both directions write atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .errors import ZooError

META_FILE = "mcore_zoo.json"
FORMAT_VERSION = 1

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


def parse_dtype(name: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ZooError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def hf_to_mcore(
    hf_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    params_dtype: Optional[Union[str, torch.dtype]] = None,
    backend: str = "local",
    overwrite: bool = False,
) -> Path:
    """HF checkpoint -> Megatron-Core distributed checkpoint (see module docstring)."""
    from megatron.core import dist_checkpointing

    from .build import build_model, model_info
    from .weights.io import atomic_output_dir

    dtype = parse_dtype(params_dtype) or torch.float32
    model = build_model(hf_dir, backend=backend, params_dtype=dtype, load=hf_dir)
    info = model_info(model)
    out = Path(out_dir)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp))
        meta = {
            "format_version": FORMAT_VERSION,
            "architecture": info.arch.architecture,
            "hf_config": info.arch.hf_config,
            "params_dtype": str(dtype).replace("torch.", ""),
            "backend": backend,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _barrier()
    return out


def read_meta(mcore_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    path = Path(mcore_dir) / META_FILE
    if not path.is_file():
        raise ZooError(f"{mcore_dir} has no {META_FILE}: not a checkpoint written by mcore-zoo convert")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ZooError(f"{path}: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
    return meta


def load_mcore_checkpoint(model: Any, mcore_dir: Union[str, os.PathLike]) -> None:
    """Load a distributed checkpoint into ``model`` (any layout); every key must be present."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .build import as_chunks

    for chunk in as_chunks(model):
        state = dist_checkpointing.load(chunk.sharded_state_dict(), str(mcore_dir), strict=StrictHandling.RAISE_ALL)
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ZooError(f"distributed checkpoint {mcore_dir} does not match the model: missing {missing}, unexpected {unexpected}")


def mcore_to_hf(
    mcore_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[Union[str, torch.dtype]] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> list[str]:
    """Megatron-Core distributed checkpoint (written by :func:`hf_to_mcore`) -> HF checkpoint."""
    from .build import build_model
    from .weights.export import save_hf_checkpoint

    meta = read_meta(mcore_dir)
    params_dtype = parse_dtype(meta.get("params_dtype"))
    model = build_model(meta["hf_config"], backend=meta.get("backend", "local"), params_dtype=params_dtype)
    load_mcore_checkpoint(model, mcore_dir)
    return save_hf_checkpoint(model, out_dir, dtype=parse_dtype(dtype), max_shard_size=max_shard_size, overwrite=overwrite)
