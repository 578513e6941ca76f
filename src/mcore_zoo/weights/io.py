"""HF checkpoint IO: streaming safetensors reads (whole tensors or TP chunks) and sharded writes.

Reading never materialises the checkpoint: :class:`HFCheckpoint` reads one tensor, or one
tensor-parallel chunk of it, at a time. Every file header is validated when the checkpoint is
opened (dtypes, sizes, offsets tiling the data section exactly, the file length), so a truncated
or corrupt file fails before any weight is copied - without mapping the files. A read into CPU
memory of the file's dtype (what a load does: for :meth:`HFCheckpoint.read_into` the destination
is the parameter itself, also when it is a strided view such as a query group's rows inside a
fused QKV weight) is a positional read of the chunk's bytes straight into it
(:mod:`~mcore_zoo.weights.pread`: destination pages populated in one call, large chunks split over
threads). A read into device memory goes through a ring of pinned host buffers, the same
positional reads into the ring and ``non_blocking`` copies from it on a side stream
(:mod:`~mcore_zoo.weights.staging`). Any other read maps only the byte range of that chunk
(``mmap``), copies the chunk - a strided view of the mapping - into its destination with one torch
copy (multi-threaded; casting if the dtypes differ) and unmaps it.

Why not keep ``safe_open(...).get_slice`` for the bytes: in current safetensors it returns views of
a memory map of the whole file; every page a load touches then stays in the process's resident
set until the file is closed (a TP=1 load peaked at twice the model size). Mapping one chunk at a
time leaves at most one tensor's file pages mapped; a positional read maps none. (A plain
``preadv`` faults the destination in page by page inside the kernel's copy and is no faster than
the mapping; populating the pages first is what makes it faster - :mod:`~mcore_zoo.weights.pread`.)
The chunk arithmetic (:meth:`~mcore_zoo.weights.rules.TPSlice.box`) is the same either way.

Pickle-based ``.bin`` files are refused unless ``allow_torch_load=True`` (then read with
``torch.load(weights_only=True)``).

Writing goes through :func:`atomic_output_dir`: files are written into a temporary sibling
directory that is renamed into place only when everything succeeded, so a failed export or
conversion leaves no partial output behind; an output never replaces an input, a concurrent
output or anything mcore-zoo did not write (:func:`check_output_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import mmap
import os
import posixpath
import shutil
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ..errors import CheckpointFormatError, MissingTensorsError, OutputError, OutputExistsError, ShapeMismatchError, ZooError
from . import pread
from .rules import TPSlice
from .staging import StagingRing

logger = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
}  # fmt: skip
# F8_E4M3 is the "fn" variant (no infinities, NaN = 0x7f/0xff), as safetensors and every FP8
# checkpoint use it; 1-byte floats size and map like U8. HFCheckpoint reads the FP8 ones only when
# asked (``allow_fp8``, for mcore_zoo.weights.fp8); other quantized dtypes (F8_E8M0, F4, F6_*, ...)
# are refused when the header is read, naming the tensor and its dtype.
_FP8_READABLE = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (``offset``: absolute byte offset of its data)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    dtype_name: str = ""  # as the header spells it (``BF16``, ``F8_E4M3``)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _box_layout(full: Sequence[int], box: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], list[int], int, int]:
    """A ``box`` (``[(start, stop)]`` per dimension) of a row-major tensor of shape ``full``:
    ``(its shape, the tensor's element strides, element offset of its first and of its last
    element)`` (for a box of elements)."""
    strides = pread.row_major_strides(full)
    shape = tuple(hi - lo for lo, hi in box)
    first = last = 0
    for (lo, hi), stride in zip(box, strides):
        first += lo * stride
        last += (hi - 1) * stride
    return shape, strides, first, last


#: Safetensors dtypes of quantized checkpoints: refused by name (never reinterpreted as another dtype).
_QUANTIZED = ("F8_", "F6_", "F4", "E8M0", "I4", "U4", "MXF")


def unsupported_dtype(name: Any) -> Optional[str]:
    """The refusal for a quantized safetensors dtype (``F8_E4M3``, ``F8_E5M2``, ...), else ``None``.

    Keyed on the header's dtype string, so it holds whether or not the dtype table can read it."""
    if isinstance(name, str) and name.upper().startswith(_QUANTIZED):
        return f"quantized checkpoints are not supported ({name})"
    return None


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def copy_into(name: str, out: torch.Tensor, tensor: torch.Tensor) -> None:
    """Fill ``out`` with ``tensor``'s elements in row-major order (any shape, same number of
    elements; casting and device moves as ``Tensor.copy_``): ``read_into`` of a checkpoint view that
    reads a chunk whole first. :class:`~mcore_zoo.errors.ShapeMismatchError` naming ``name`` when the
    element counts differ."""
    if out.numel() != tensor.numel():
        raise ShapeMismatchError(name, tuple(out.shape), tuple(tensor.shape), context="destination of read_into")
    with torch.no_grad():
        out.copy_(tensor.reshape(out.shape))


def shard_name(index: Path, file: str) -> str:
    """A shard path from an index, normalised and kept inside the checkpoint directory: a relative
    path without ``..`` escaping the directory (subdirectories are fine). Raises otherwise."""
    norm = posixpath.normpath(file.replace("\\", "/")) if file else ""
    if not file or "\x00" in file or os.path.isabs(file) or norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise CheckpointFormatError(
            str(index), f"shard path {file!r} is not a file inside the checkpoint directory (absolute or escaping with '..')"
        )
    return norm


def read_safetensors_header(path: Path, file: Optional[str] = None) -> dict[str, TensorEntry]:
    """Parse and validate a safetensors header (8-byte little-endian length, JSON) into one
    :class:`TensorEntry` per tensor, as the format requires: known dtypes, sizes that match the
    shapes, data offsets that tile the data section exactly (no holes, no overlaps, nothing missing)."""

    def bad(reason: str) -> CheckpointFormatError:
        return CheckpointFormatError(str(path), reason)

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise bad("file shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise bad(f"header length {length} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"header is not JSON: {exc}") from None
        except RecursionError:
            raise bad("header is not JSON a safetensors reader accepts (nested too deeply)") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base, entries, spans = 8 + length, {}, []
    file = file or path.name
    itemsizes: dict[Any, int] = {}  # safetensors dtype name -> item size, once per dtype (checked once)
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if type(meta) is not dict:
            raise bad(f"tensor {name!r}: malformed entry {_short(meta)}")
        dtype_name, raw_shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        itemsize = itemsizes.get(dtype_name) if type(dtype_name) is str else None
        if itemsize is None:
            quantized = unsupported_dtype(dtype_name)
            if quantized and dtype_name not in _DTYPES:  # readable ones are refused by HFCheckpoint
                raise bad(f"tensor {name!r}: {quantized}")
            if type(dtype_name) is str and dtype_name in _DTYPES:
                itemsize = itemsizes[dtype_name] = _itemsize(_DTYPES[dtype_name])
        # JSON integers are exactly int (never bool, which is an int too)
        if (itemsize is None or type(raw_shape) is not list or not all(type(n) is int for n in raw_shape)
                or type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int):  # fmt: skip
            raise bad(f"tensor {name!r}: malformed entry {_short(meta)} (dtype a safetensors name, shape and"
                      " data_offsets lists of integers)")  # fmt: skip
        shape, (begin, end) = tuple(raw_shape), offsets
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            raise bad(f"tensor {name!r}: data_offsets {[begin, end]} do not hold {dtype_name} {list(shape)}")
        entries[name] = TensorEntry(file, _DTYPES[dtype_name], shape, base + begin, dtype_name)
        spans.append((begin, end, name))
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin != position:
            raise bad(f"tensor {name!r} starts at byte {begin} of the data section, expected {position}")
        position = end
    if base + position != size:
        raise bad(f"data section ends at byte {base + position}, the file has {size} bytes (truncated or padded)")
    return entries


class HFCheckpoint:
    """An HF checkpoint directory (or a single ``.safetensors`` file), read lazily.

    Args:
        path: directory with ``model.safetensors``, ``model.safetensors.index.json`` + shards, or
            (with ``allow_torch_load``) ``pytorch_model*.bin``; or one ``.safetensors`` file; or a
            Hugging Face Hub id (``org/name[@revision]``, :mod:`mcore_zoo.hub`).
        allow_torch_load: permit pickle-based ``.bin`` files (``torch.load(weights_only=True)``).
        allow_fp8: read ``F8_E4M3`` / ``F8_E5M2`` tensors as float8 (an FP8 block-quantized
            checkpoint, dequantized by :mod:`mcore_zoo.weights.fp8`); refused by default.
        staging: the ring of host buffers through which device destinations are read
            (:class:`~mcore_zoo.weights.staging.StagingRing`; default: 4 pinned buffers of 16 MiB).
    """

    def __init__(
        self, path: str | os.PathLike, *, allow_torch_load: bool = False, allow_fp8: bool = False,
        staging: Optional[StagingRing] = None,
    ) -> None:
        from ..hub import resolve

        self.path = Path(resolve(path))  # a Hugging Face Hub id: its (safetensors-only) snapshot
        self._entries: dict[str, TensorEntry] = {}
        self._fds: dict[str, int] = {}
        self._where: dict[str, str] = {}
        self._bin: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0
        self._reader = pread.ReadPool()
        self.staging = staging if staging is not None else StagingRing()
        files = self._files(allow_torch_load)
        try:
            self._open_all(files, allow_fp8)
            self._check_index_consistency()
        except BaseException:
            self.close()
            raise

    def _open_all(self, files: Sequence[str], allow_fp8: bool = False) -> None:
        """Validate every file's header and open it; files are keyed by their path relative to
        the checkpoint directory, and one file reached under two names is refused."""
        resolved: dict[str, str] = {}
        for file in files:
            if file.endswith(".bin"):
                self._open_bin(file)
                continue
            full = self._full(file)
            real = os.path.realpath(full)
            if real in resolved:
                raise CheckpointFormatError(str(full), f"the same file as {resolved[real]} (listed twice in the index)")
            resolved[real] = file
            if not full.exists():
                raise CheckpointFormatError(str(full), "listed in the index but missing")
            if not full.is_file():
                raise CheckpointFormatError(str(full), "not a regular file")
            try:
                entries = read_safetensors_header(full, file=file)
            except OSError as exc:
                raise CheckpointFormatError(str(full), f"{type(exc).__name__}: {exc}") from exc
            try:
                self._fds[file] = os.open(full, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointFormatError(str(full), f"{type(exc).__name__}: {exc.strerror}") from exc
            refused = {}  # dtype name -> its refusal (None: readable), once per dtype
            for key, entry in entries.items():
                if entry.dtype_name not in refused:
                    quantized = unsupported_dtype(entry.dtype_name)
                    refused[entry.dtype_name] = quantized if quantized and not (allow_fp8 and entry.dtype_name in _FP8_READABLE) else None
                if refused[entry.dtype_name] is not None:
                    raise CheckpointFormatError(str(full), f"tensor {key!r}: {refused[entry.dtype_name]}")
                if key in self._where:
                    raise CheckpointFormatError(str(full), f"tensor {key!r} also in {self._where[key]}")
                self._where[key] = file
                self._entries[key] = entry

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
            except (ValueError, KeyError, TypeError, RecursionError) as exc:  # ValueError: JSON, UTF-8
                raise CheckpointFormatError(str(index), f"invalid index: {type(exc).__name__}: {exc}") from None
            except OSError as exc:
                raise CheckpointFormatError(str(index), f"{type(exc).__name__}: {exc.strerror}") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise CheckpointFormatError(str(index), "invalid index: weight_map must map tensor names to file names")
            self._index = {name: shard_name(index, file) for name, file in weight_map.items()}
            return sorted(set(self._index.values()))
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
        box = TPSlice(axis, rank, size, select).box(self.shape(name), f"tensor {name!r}")
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

        For safetensors files there is no intermediate tensor: a CPU destination of the file's
        dtype is read into positionally, a device destination through the pinned staging ring
        (:mod:`~mcore_zoo.weights.staging`), anything else copied from a mapping of the chunk.
        """
        file = self._file_of(name)
        if file in self._bin:
            box = TPSlice(axis, rank, size, select).box(self.shape(name), f"tensor {name!r}")
            shape = tuple(hi - lo for lo, hi in box)
            if out.numel() != math.prod(shape):
                raise ShapeMismatchError(name, tuple(out.shape), shape, context="destination of read_into")
            tensor = self.read(name, axis=axis, rank=rank, size=size, select=select)
            copy_into(name, out, tensor)
            return tensor.numel() * tensor.element_size()
        entry = self._entries[name]
        if select is None and (axis is None or size <= 1):  # the whole tensor (TPSlice.box's bounds, without it)
            box, shape = None, entry.shape
        else:
            box = TPSlice(axis, rank, size, select).box(entry.shape, f"tensor {name!r}")
            shape = tuple(hi - lo for lo, hi in box)
        if out.numel() != math.prod(shape):
            raise ShapeMismatchError(name, tuple(out.shape), shape, context="destination of read_into")
        try:
            return self._read_box(name, box, out, wait=False)
        finally:
            if not self._reader.queuing:
                self.staging.finish()  # not queued: the destination holds the bytes on return

    @contextlib.contextmanager
    def queued_reads(self) -> Iterator[None]:
        """Inside the block, :meth:`read_into` may return before ``out`` holds the bytes: its
        positional reads are queued on the read threads, so they overlap whatever the caller does
        next (:mod:`~mcore_zoo.weights.pread`). Every queued read is finished when the block exits,
        and its error raised then (:class:`~mcore_zoo.errors.CheckpointFormatError`, naming the
        tensor); :meth:`finish_reads` waits for them inside the block. :meth:`read` still returns
        its tensor complete. Device destinations' copies out of the staging ring are waited for
        too (:meth:`~mcore_zoo.weights.staging.StagingRing.finish`), also when the block raises."""
        outer = self._reader.queuing
        try:
            with self._reader.queued():
                yield
        finally:
            if not outer:
                self.staging.finish()

    def finish_reads(self) -> None:
        """Return once every read queued by :meth:`queued_reads` has written its destination
        (host and device destinations)."""
        self._reader.wait()
        self.staging.wait()

    def _read_box(self, name: str, box: Optional[Sequence[tuple[int, int]]], out: torch.Tensor, wait: bool = True) -> int:
        """Copy the ``box`` of tensor ``name`` (``None``: all of it) into ``out``: positional reads
        (queued unless ``wait``, see :meth:`queued_reads`), else through a mapping of just its bytes."""
        entry = self._entries[name]
        if box is None:
            shape, strides, first = entry.shape, pread.row_major_strides(entry.shape), 0
            last = math.prod(shape) - 1
        else:
            shape, strides, first, last = _box_layout(entry.shape, box)
        if 0 in shape:
            return 0
        itemsize = _itemsize(entry.dtype)
        start, stop = entry.offset + first * itemsize, entry.offset + (last + 1) * itemsize
        nbytes = math.prod(shape) * itemsize
        describe = lambda exc: CheckpointFormatError(str(self._full(entry.file)), f"reading {name!r}: {exc}")  # noqa: E731
        layout = self.staging.layout(out, shape, strides, itemsize)
        if layout is not None:  # a device destination: the pinned ring
            self.staging.read(self._reader, self._fds[entry.file], out, entry.dtype, shape, strides, start, describe,
                              layout=layout)  # fmt: skip
            torch.autograd.graph.increment_version(out)
            self.bytes_read += nbytes
            return nbytes
        segments = pread.plan_segments(out, entry.dtype, shape, strides, start)
        if segments is not None:  # positional reads straight into ``out``
            self._reader.read(self._fds[entry.file], segments, wait=wait, out=out, describe=describe)
            torch.autograd.graph.increment_version(out)
            self.bytes_read += nbytes
            return nbytes
        base = start - start % mmap.ALLOCATIONGRANULARITY
        self._reader.populate(out)  # the destination's pages in one call, not one fault each inside the copy
        try:
            mapping = mmap.mmap(self._fds[entry.file], stop - base, offset=base, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise describe(exc) from exc
        raw = source = None
        try:
            with warnings.catch_warnings():  # read-only buffer: torch warns that it is not writable
                warnings.simplefilter("ignore")
                raw = torch.frombuffer(mapping, dtype=torch.uint8)[start - base :]
            if (start - base) % itemsize:  # misaligned for a typed view (not written by safetensors)
                raw = raw.clone()
            source = raw.view(entry.dtype).as_strided(shape, strides)
            with torch.no_grad():
                out.copy_(source if tuple(out.shape) == shape else source.reshape(out.shape))
        finally:
            raw = source = None  # release the buffer before unmapping
            mapping.close()
        self.bytes_read += nbytes
        return nbytes

    def close(self) -> None:
        self.staging.finish()
        self._reader.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bin.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------- writing


#: Written into every output directory: what mcore-zoo wrote there, so that ``overwrite`` removes
#: only that (a directory holding anything else is never deleted).
OUTPUT_MANIFEST = ".mcore_zoo_output.json"


def _same_or_inside(inner: Path, outer: Path) -> bool:
    try:
        inner.relative_to(outer)
        return True
    except ValueError:
        return False


def _tree(root: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """Everything under ``root`` at every depth (links not followed), as paths relative to it:
    ``({regular file: size}, [directories], [anything else: links, fifos, ...])``."""
    files: dict[str, int] = {}
    dirs: list[str] = []
    other: list[str] = []
    for current, subdirs, names in os.walk(root, followlinks=False):
        base = Path(current)
        for name in subdirs + names:
            full = base / name
            rel = full.relative_to(root).as_posix()
            info = full.lstat()
            if stat.S_ISDIR(info.st_mode):
                dirs.append(rel)
            elif stat.S_ISREG(info.st_mode):
                files[rel] = info.st_size
            else:
                other.append(rel)
    files.pop(OUTPUT_MANIFEST, None)
    return files, sorted(dirs), sorted(other)


def _foreign_entries(final: Path) -> list[str]:
    """What ``final`` holds that its manifest does not list, at every depth: a file not written
    by mcore-zoo or changed in size since, a directory it did not create, a link or other special
    file. Everything, without a readable manifest. (A manifest of an older mcore-zoo lists
    top-level names only: it vouches for top-level files, not for what a folder holds.)"""
    try:
        manifest = json.loads((final / OUTPUT_MANIFEST).read_text())
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    sizes: dict[str, Any] = {}
    dirs: set = set()
    if isinstance(listed, list) and all(isinstance(entry, dict) for entry in listed):
        sizes = {entry.get("path"): entry.get("size") for entry in listed}
        dirs = set(manifest.get("dirs", [])) if isinstance(manifest.get("dirs", []), list) else set()
    elif isinstance(listed, list):  # the older form: top-level names
        sizes = {name: None for name in listed if isinstance(name, str) and "/" not in name}
    files, found_dirs, other = _tree(final)
    foreign = [f for f, size in files.items() if f not in sizes or (sizes[f] is not None and sizes[f] != size)]
    foreign += [d for d in found_dirs if d not in dirs]
    return sorted(foreign + other)


def check_output_dir(
    path: str | os.PathLike, *, overwrite: bool = False, inputs: Sequence[str | os.PathLike] = ()
) -> None:
    """Refuse an output directory that would lose data: one that equals or contains an input
    (``inputs``), a non-empty one (unless ``overwrite``), and - even with ``overwrite`` - one holding
    anything mcore-zoo did not write there itself. Raises :class:`OutputExistsError` (a
    ``FileExistsError``)."""
    final = Path(path)
    resolved = final.resolve()
    for source in inputs:
        src = Path(source).resolve()
        if _same_or_inside(src, resolved):
            what = "is" if src == resolved else "contains"
            raise OutputExistsError(final, f"the output {what} the input {source}; choose another output directory")
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise OutputExistsError(final, "exists and is not a directory")
    if not final.is_dir() or not any(final.iterdir()):
        return
    if not overwrite:
        raise OutputExistsError(final, "exists and is not empty", overwrite_hint=True)
    foreign = _foreign_entries(final)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputExistsError(
            final, f"holds files mcore-zoo did not write ({shown}); overwrite removes only a previous mcore-zoo"
            " output - remove them yourself or choose another output directory",
        )  # fmt: skip


def _partial_prefix(final: Path) -> str:
    return f".{final.name}.partial-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def clean_stale_partials(final: Path) -> list[Path]:
    """Remove the temporary directories of earlier writes to ``final`` whose process died (killed
    mid-write) on this host; warn about those that cannot be proven stale. Returns the removed ones."""
    import socket

    removed, unknown = [], []
    host = socket.gethostname()
    prefixes = (_partial_prefix(final), f".{final.name}.old-")
    try:
        candidates = [p for p in final.parent.iterdir() if p.name.startswith(prefixes)]
    except OSError:
        return []
    for entry in candidates:
        tag = entry.name.split(".partial-" if ".partial-" in entry.name else ".old-", 1)[1]
        parts = tag.rsplit("-", 2)
        stale = (
            len(parts) == 3 and parts[0] == host and parts[1].isdigit()
            and int(parts[1]) != os.getpid() and not _pid_alive(int(parts[1]))
        )  # fmt: skip
        if stale and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        else:
            unknown.append(entry)
    if removed:
        logger.info("removed %d stale partial output(s) of killed runs: %s", len(removed), ", ".join(map(str, removed)))
    if unknown:
        logger.warning(
            "partial output(s) of other or earlier runs next to %s (remove them if no run is writing): %s",
            final, ", ".join(map(str, unknown)),
        )  # fmt: skip
    return removed


def _make_partial(final: Path) -> Path:
    """A fresh sibling directory for the write, created with the process umask (``mkdtemp`` would
    make it 0700, and the rename would keep that)."""
    import secrets
    import socket

    for _ in range(100):
        tmp = final.parent / f"{_partial_prefix(final)}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
    raise OutputExistsError(final, "cannot create a temporary directory next to it")


def _write_manifest(tmp: Path) -> None:
    """List every file mcore-zoo wrote into ``tmp`` (at every depth, with its size) and every
    directory it made: ``overwrite`` later removes the output only if it holds nothing else."""
    from .._version import __version__

    files, dirs, other = _tree(tmp)
    if other:
        raise OutputError(tmp, f"wrote something other than files and folders: {', '.join(other[:5])}")
    manifest = {"producer": "mcore-zoo", "version": __version__,
                "files": [{"path": f, "size": files[f]} for f in sorted(files)], "dirs": dirs}  # fmt: skip
    (tmp / OUTPUT_MANIFEST).write_text(json.dumps(manifest) + "\n")


def _swap_into_place(tmp: Path, final: Path, overwrite: bool, inputs: Sequence[str | os.PathLike]) -> None:
    try:
        os.rename(tmp, final)  # atomic; replaces only a missing or empty directory
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    if not overwrite:
        raise OutputExistsError(final, "was created by someone else while this output was written", overwrite_hint=True)
    check_output_dir(final, overwrite=True, inputs=inputs)  # still only a previous mcore-zoo output
    backup = final.parent / f".{final.name}.old-{tmp.name.rsplit('.partial-', 1)[1]}"
    os.rename(final, backup)
    os.rename(tmp, final)
    shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(
    path: str | os.PathLike, *, overwrite: bool = False, inputs: Sequence[str | os.PathLike] = ()
) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds.

    :func:`check_output_dir` runs up front, and the final rename refuses again a target that became
    non-empty meanwhile (a concurrent write), unless ``overwrite``; ``overwrite`` replaces only a
    previous mcore-zoo output. On any exception the temporary directory is removed and ``path`` is
    untouched. Temporary directories left by killed runs on this host are removed first. Everything
    is created with the process umask.
    """
    final = Path(path)
    check_output_dir(final, overwrite=overwrite, inputs=inputs)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputExistsError(final, f"cannot create its parent directory: {exc.strerror or exc}") from None
    clean_stale_partials(final)
    try:
        tmp = _make_partial(final)
    except PermissionError as exc:
        raise OutputError(final, f"cannot write next to it: {exc.strerror or exc}") from None
    try:
        yield tmp
        _write_manifest(tmp)
        _swap_into_place(tmp, final, overwrite, inputs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an integer, or a number with a unit (``5GB``, ``500MB``, ``1.5GiB``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
                 "GIB": 2**30, "TIB": 2**40, "B": 1}  # fmt: skip
        text = str(size).strip().upper()
        try:
            for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
                if text.endswith(unit):
                    value = int(float(text[: -len(unit)]) * mult)
                    break
            else:
                value = int(text)
        except (ValueError, OverflowError):
            raise ZooError(f"size {size!r} is not a size (an integer of bytes, or e.g. 5GB, 500MB, 1.5GiB)") from None
    if value <= 0:
        raise ZooError(f"size {size!r} must be positive")
    return value


_parse_size = parse_size


_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file straight from the tensors' memory (``safetensors.torch.save_file``
    first flattens every tensor into a bytes copy, doubling the memory a shard needs). CPU,
    contiguous tensors; the header is padded to 8 bytes as safetensors writes it."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ZooError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for tensor in tensors.values():
            if tensor.numel():
                f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


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
        if not self._buffer:
            return
        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        write_safetensors(self.directory / tmp_name, self._buffer, self.metadata)
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
