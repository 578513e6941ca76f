"""HF checkpoint IO: streaming safetensors reads (whole tensors or TP chunks) and sharded writes.

Reading never materialises the checkpoint: :class:`HFCheckpoint` memory-maps each file and reads
one tensor, or one contiguous chunk of it (``get_slice``), at a time. Every file header is
validated when the checkpoint is opened, so a truncated or corrupt file fails before any weight is
copied. Pickle-based ``.bin`` files are refused unless ``allow_torch_load=True`` (then read with
``torch.load(weights_only=True)``).

Writing goes through :func:`atomic_output_dir`: files are written into a temporary sibling
directory that is renamed into place only when everything succeeded, so a failed export or
conversion leaves no partial output behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..errors import CheckpointFormatError, MissingTensorsError, ZooError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class HFCheckpoint:
    """An HF checkpoint directory (or a single ``.safetensors`` file), read lazily.

    Args:
        path: directory with ``model.safetensors``, ``model.safetensors.index.json`` + shards, or
            (with ``allow_torch_load``) ``pytorch_model*.bin``; or one ``.safetensors`` file.
        allow_torch_load: permit pickle-based ``.bin`` files (``torch.load(weights_only=True)``).
    """

    def __init__(self, path: str | os.PathLike, *, allow_torch_load: bool = False) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        self._bin: dict[str, dict[str, torch.Tensor]] = {}
        files = self._files(allow_torch_load)
        for file in files:
            if file.endswith(".bin"):
                self._open_bin(file)
                continue
            full = self._full(file)
            if not full.is_file():
                raise CheckpointFormatError(str(full), "listed in the index but missing")
            try:
                handle = safe_open(str(full), framework="pt", device="cpu")
                keys = list(handle.keys())
            except Exception as exc:  # safetensors raises SafetensorError / OSError
                raise CheckpointFormatError(str(full), f"{type(exc).__name__}: {exc}") from exc
            self._handles[file] = handle
            for key in keys:
                if key in self._where:
                    raise CheckpointFormatError(str(full), f"tensor {key!r} also in {self._where[key]}")
                self._where[key] = file
        self._check_index_consistency()

    # ------------------------------------------------------------------ discovery
    def _full(self, file: str) -> Path:
        return self.path if self.path.is_file() else self.path / file

    def _files(self, allow_torch_load: bool) -> list[str]:
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise CheckpointFormatError(str(self.path), "not a .safetensors file")
            return [self.path.name]
        if not self.path.is_dir():
            raise FileNotFoundError(f"no checkpoint at {self.path}")
        index = self.path / SAFE_INDEX
        self._index: Optional[dict[str, str]] = None
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointFormatError(str(index), f"invalid index: {exc}") from exc
            self._index = dict(weight_map)
            return sorted(set(weight_map.values()))
        singles = sorted(p.name for p in self.path.glob("*.safetensors"))
        if singles:
            return singles
        bins = sorted(p.name for p in self.path.glob("pytorch_model*.bin"))
        if bins:
            if not allow_torch_load:
                raise CheckpointFormatError(
                    str(self.path),
                    "only pickle-based .bin weights found; refusing to unpickle by default. Convert to"
                    " safetensors, or pass allow_torch_load=True (torch.load(weights_only=True))",
                )
            return bins
        raise CheckpointFormatError(str(self.path), "no *.safetensors (or index) found")

    def _open_bin(self, file: str) -> None:
        full = self._full(file)
        try:
            state = torch.load(str(full), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointFormatError(str(full), f"{type(exc).__name__}: {exc}") from exc
        self._bin[file] = state
        for key in state:
            self._where[key] = file

    def _check_index_consistency(self) -> None:
        index = getattr(self, "_index", None)
        if not index:
            return
        for name, file in index.items():
            if self._where.get(name) != file:
                raise CheckpointFormatError(
                    str(self.path / SAFE_INDEX), f"index says {name!r} is in {file}, but it is not there"
                )

    # ------------------------------------------------------------------ queries
    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._file_of(name)
        if file in self._bin:
            return tuple(self._bin[file][name].shape)
        return tuple(self._handles[file].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        file = self._file_of(name)
        if file in self._bin:
            return self._bin[file][name].dtype
        return _DTYPES[self._handles[file].get_slice(name).get_dtype()]

    def _file_of(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise MissingTensorsError([name], source=str(self.path)) from None

    def read(
        self,
        name: str,
        *,
        axis: Optional[int] = None,
        rank: int = 0,
        size: int = 1,
        select: Optional[tuple[int, int, int]] = None,
    ) -> torch.Tensor:
        """Tensor ``name``; or its range ``select=(axis, start, stop)``; or (``axis`` given,
        ``size > 1``) chunk ``rank`` of ``size`` along ``axis`` (of the selected range).

        Only those bytes are read. Raises if the range does not divide by ``size``.
        """
        file = self._file_of(name)
        index = chunk_index(name, self.shape(name), axis=axis, rank=rank, size=size, select=select)
        try:
            if file in self._bin:
                tensor = self._bin[file][name]
                return (tensor if index is None else tensor[index]).clone()
            handle = self._handles[file]
            if index is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[index]
        except ZooError:
            raise
        except Exception as exc:
            raise CheckpointFormatError(str(self._full(file)), f"reading {name!r}: {exc}") from exc

    def close(self) -> None:
        self._handles.clear()
        self._bin.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def chunk_index(
    name: str,
    shape: tuple[int, ...],
    *,
    axis: Optional[int] = None,
    rank: int = 0,
    size: int = 1,
    select: Optional[tuple[int, int, int]] = None,
) -> Optional[tuple[slice, ...]]:
    """The index of a tensor-parallel chunk within an optional ``(axis, start, stop)`` range."""
    if select is None and (axis is None or size == 1):
        return None
    bounds = [(0, n) for n in shape]
    if select is not None:
        sel_axis, start, stop = select
        if stop > shape[sel_axis]:
            raise ZooError(f"tensor {name!r} dim {sel_axis} = {shape[sel_axis]} has no range [{start}, {stop})")
        bounds[sel_axis] = (start, stop)
    if axis is not None and size > 1:
        lo, hi = bounds[axis]
        if (hi - lo) % size:
            raise ZooError(f"tensor {name!r} dim {axis} range {hi - lo} is not divisible into {size} chunks")
        step = (hi - lo) // size
        bounds[axis] = (lo + rank * step, lo + (rank + 1) * step)
    index = [slice(lo, hi) for lo, hi in bounds]
    while index and index[-1] == slice(0, shape[len(index) - 1]):
        index.pop()  # get_slice accepts fewer dims than the tensor has
    return tuple(index) or None


# ---------------------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds.

    Raises ``FileExistsError`` up front if ``path`` exists and is not empty (unless ``overwrite``).
    On any exception the temporary directory is removed and ``path`` is untouched.
    """
    final = Path(path)
    occupied = (final.is_dir() and any(final.iterdir())) or final.is_file()
    if occupied and not overwrite:
        raise FileExistsError(f"{final} exists and is not empty (pass overwrite=True)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        backup = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, backup)
        os.replace(tmp, final)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


class SafetensorsShardWriter:
    """Write tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards of bounded size.

    Holds at most one shard in memory. ``close()`` names the shards and writes the index (or a
    single ``model.safetensors`` when everything fit in one shard).
    """

    def __init__(self, directory: Path, max_shard_size: int | str = "5GB", metadata: Optional[dict[str, str]] = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = _parse_size(max_shard_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ZooError(f"tensor {name!r} written twice")
        self._names.add(name)
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_bytes:
            self._flush()
        self._buffer[name] = tensor.clone() if tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes else tensor
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buffer:
            return
        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        save_file(self._buffer, str(self.directory / tmp_name), metadata=self.metadata)
        self._shards.append((tmp_name, list(self._buffer)))
        self._buffer = {}
        self._buffer_bytes = 0

    def close(self) -> list[str]:
        """Finish writing; returns the shard file names."""
        self._flush()
        count = len(self._shards)
        if count == 0:
            raise ZooError("nothing was exported")
        if count == 1:
            os.replace(self.directory / self._shards[0][0], self.directory / "model.safetensors")
            return ["model.safetensors"]
        weight_map = {}
        names = []
        for i, (tmp_name, keys) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / tmp_name, self.directory / final)
            names.append(final)
            for key in keys:
                weight_map[key] = final
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names
