"""HF checkpoint IO: streaming safetensors reads (whole tensors or TP chunks) and sharded writes.

Reading never materialises the checkpoint: :class:`HFCheckpoint` reads one tensor, or one
tensor-parallel chunk of it, at a time, and only the bytes of that chunk. Every file is validated
by ``safetensors.safe_open`` when the checkpoint is opened (so a truncated or corrupt file fails
before any weight is copied); the bytes are then read with positional reads (``os.preadv``)
straight into the destination - for :meth:`HFCheckpoint.read_into`, into the parameter itself,
also when the destination is a strided view (a query group's rows inside a fused QKV weight).

Why not ``safe_open(...).get_slice``: in current safetensors it returns views of a memory map of
the whole file; every page a load touches then stays in the process's resident set until the file
is closed (a TP=1 load peaks at twice the model size) and each byte is copied twice (page fault,
then into the parameter). Positional reads copy once and leave nothing mapped. The chunk
arithmetic (:func:`chunk_index`) is the same either way.

Pickle-based ``.bin`` files are refused unless ``allow_torch_load=True`` (then read with
``torch.load(weights_only=True)``).

Writing goes through :func:`atomic_output_dir`: files are written into a temporary sibling
directory that is renamed into place only when everything succeeded, so a failed export or
conversion leaves no partial output behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ..errors import CheckpointFormatError, MissingTensorsError, ShapeMismatchError, ZooError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (``offset``: absolute byte offset of its data)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header (8-byte little-endian length, JSON) into :class:`TensorEntry`\ s."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointFormatError(str(path), "file shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointFormatError(str(path), f"tensor {name!r} has unsupported dtype {meta['dtype']}")
        begin, _end = meta["data_offsets"]
        entries[name] = TensorEntry(path.name, _DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin)
    return entries


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
        self._entries: dict[str, TensorEntry] = {}
        self._fds: dict[str, int] = {}
        self._where: dict[str, str] = {}
        self._bin: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0
        files = self._files(allow_torch_load)
        for file in files:
            if file.endswith(".bin"):
                self._open_bin(file)
                continue
            full = self._full(file)
            if not full.is_file():
                raise CheckpointFormatError(str(full), "listed in the index but missing")
            try:
                with safe_open(str(full), framework="pt", device="cpu") as handle:  # validates the file
                    keys = set(handle.keys())
                entries = read_safetensors_header(full)
            except CheckpointFormatError:
                raise
            except Exception as exc:  # safetensors raises SafetensorError / OSError
                raise CheckpointFormatError(str(full), f"{type(exc).__name__}: {exc}") from exc
            if set(entries) != keys:
                raise CheckpointFormatError(str(full), "header disagrees with safetensors' reading of it")
            self._fds[file] = os.open(full, os.O_RDONLY)
            for key, entry in entries.items():
                if key in self._where:
                    raise CheckpointFormatError(str(full), f"tensor {key!r} also in {self._where[key]}")
                self._where[key] = file
                self._entries[key] = entry
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
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        file = self._file_of(name)
        if file in self._bin:
            return self._bin[file][name].dtype
        return self._entries[name].dtype

    def entry(self, name: str) -> Optional[TensorEntry]:
        """File, dtype, shape and byte offset of a safetensors tensor (``None`` for ``.bin``)."""
        self._file_of(name)
        return self._entries.get(name)

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

        Only those bytes are read, into a new tensor. Raises if the range does not divide by ``size``.
        """
        file = self._file_of(name)
        box = chunk_box(name, self.shape(name), axis=axis, rank=rank, size=size, select=select)
        if file in self._bin:
            tensor = self._bin[file][name]
            return tensor[tuple(slice(lo, hi) for lo, hi in box)].clone()
        out = torch.empty(tuple(hi - lo for lo, hi in box), dtype=self._entries[name].dtype)
        self._read_box(name, box, out)
        return out

    def read_into(
        self,
        name: str,
        out: torch.Tensor,
        *,
        axis: Optional[int] = None,
        rank: int = 0,
        size: int = 1,
        select: Optional[tuple[int, int, int]] = None,
    ) -> int:
        """Read what :meth:`read` would return into ``out`` (same number of elements, filled in
        row-major order; any shape, strides, dtype or device). Returns the bytes read.

        A CPU ``out`` of the file's dtype is filled in place by positional reads, without an
        intermediate copy; anything else goes through one temporary of the chunk's size.
        """
        file = self._file_of(name)
        box = chunk_box(name, self.shape(name), axis=axis, rank=rank, size=size, select=select)
        shape = tuple(hi - lo for lo, hi in box)
        if out.numel() != math.prod(shape):
            raise ShapeMismatchError(name, tuple(out.shape), shape, context="destination of read_into")
        if file in self._bin or out.device.type != "cpu" or out.dtype != self._entries[name].dtype:
            tensor = self.read(name, axis=axis, rank=rank, size=size, select=select)
            with torch.no_grad():
                out.copy_(tensor.reshape(out.shape))
            return tensor.numel() * tensor.element_size()
        return self._read_box(name, box, out)

    def _read_box(self, name: str, box: Sequence[tuple[int, int]], out: torch.Tensor) -> int:
        entry = self._entries[name]
        fd = self._fds[entry.file]
        itemsize = out.element_size()
        storage = out.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy()
        view = memoryview(raw)
        total = 0
        try:
            for file_elem, dest_elem, count in _pair_runs(_source_runs(entry.shape, box), _dest_runs(out)):
                start = dest_elem * itemsize
                _pread_exact(fd, view[start : start + count * itemsize], entry.offset + file_elem * itemsize)
                total += count * itemsize
        except OSError as exc:
            raise CheckpointFormatError(str(self._full(entry.file)), f"reading {name!r}: {exc}") from exc
        self.bytes_read += total
        return total

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bin.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def chunk_box(
    name: str,
    shape: tuple[int, ...],
    *,
    axis: Optional[int] = None,
    rank: int = 0,
    size: int = 1,
    select: Optional[tuple[int, int, int]] = None,
) -> list[tuple[int, int]]:
    """``[(start, stop)]`` per dimension of tensor-parallel chunk ``rank`` of ``size`` along
    ``axis``, within an optional ``(axis, start, stop)`` range. Raises if it does not divide."""
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
    return bounds


def chunk_index(
    name: str,
    shape: tuple[int, ...],
    *,
    axis: Optional[int] = None,
    rank: int = 0,
    size: int = 1,
    select: Optional[tuple[int, int, int]] = None,
) -> Optional[tuple[slice, ...]]:
    """:func:`chunk_box` as an index (trailing whole dimensions dropped; ``None``: everything)."""
    index = [slice(lo, hi) for lo, hi in chunk_box(name, shape, axis=axis, rank=rank, size=size, select=select)]
    while index and index[-1] == slice(0, shape[len(index) - 1]):
        index.pop()
    return tuple(index) or None


def _source_runs(shape: Sequence[int], box: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Contiguous ``(element offset, length)`` runs of a box inside a row-major tensor, in order."""
    if not shape:
        yield 0, 1
        return
    partial = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    k = partial[-1] if partial else 0
    inner = math.prod(shape[k + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = (box[k][1] - box[k][0]) * inner
    if length == 0:
        return
    outer = [range(lo, hi) for lo, hi in box[:k]]
    for index in _product(outer):
        yield sum(i * st for i, st in zip(index, strides)) + box[k][0] * strides[k], length


def _dest_runs(out: torch.Tensor) -> Iterator[tuple[int, int]]:
    """Contiguous ``(element offset in the storage, length)`` runs of ``out``, row-major order."""
    shape, stride = list(out.shape), list(out.stride())
    d, run = len(shape) - 1, 1
    while d >= 0 and (shape[d] == 1 or stride[d] == run):
        run *= shape[d]
        d -= 1
    base = out.storage_offset()
    if out.numel() == 0:
        return
    for index in _product([range(n) for n in shape[: d + 1]]):
        yield base + sum(i * st for i, st in zip(index, stride)), run


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*ranges)


def _pair_runs(source: Iterator[tuple[int, int]], dest: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """Merge two run lists covering the same number of elements: ``(src, dst, count)`` pieces."""
    src_off, src_left = 0, 0
    dst_off, dst_left = 0, 0
    while True:
        if src_left == 0:
            nxt = next(source, None)
            if nxt is None:
                return
            src_off, src_left = nxt
        if dst_left == 0:
            dst_off, dst_left = next(dest)
        n = min(src_left, dst_left)
        yield src_off, dst_off, n
        src_off, src_left = src_off + n, src_left - n
        dst_off, dst_left = dst_off + n, dst_left - n


def _pread_exact(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill ``buffer`` from ``fd`` at ``offset`` (looping over short reads)."""
    done, want = 0, len(buffer)
    while done < want:
        got = os.preadv(fd, [buffer[done : done + (1 << 30)]], offset + done)
        if got == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


# ---------------------------------------------------------------------------- writing


def check_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Raise ``FileExistsError`` if ``path`` exists and is not empty (unless ``overwrite``)."""
    final = Path(path)
    occupied = (final.is_dir() and any(final.iterdir())) or final.is_file()
    if occupied and not overwrite:
        raise FileExistsError(f"{final} exists and is not empty (pass overwrite=True)")


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds.

    Raises ``FileExistsError`` up front if ``path`` exists and is not empty (unless ``overwrite``).
    On any exception the temporary directory is removed and ``path`` is untouched.
    """
    final = Path(path)
    check_output_dir(final, overwrite=overwrite)
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
