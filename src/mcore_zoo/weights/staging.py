"""Reads into device memory through a ring of pinned host staging buffers (the load's device path).

A parameter on the GPU cannot be the destination of a positional read. Copying it from a memory
map of the file (``out.copy_(mapping view)``) is a synchronous copy from pageable memory: the
driver stages it through its own bounce buffer, one tensor at a time, and nothing overlaps.
:class:`StagingRing` instead reads the chunk's bytes with :data:`READ_THREADS` read threads of
:class:`~mcore_zoo.weights.pread.ReadPool` into a small ring of **pinned** host buffers
(:data:`BUFFERS` of :data:`BUFFER_BYTES`, allocated at the first device read of a load and handed
back to torch's pinned-memory cache by :meth:`StagingRing.finish`), and each filled region is
copied to the destination with a ``non_blocking`` host-to-device copy on a side CUDA stream. An
event recorded after the last copy out of a buffer guards its reuse, so reading the next buffer
runs while the previous one is copied. Small tensors share a buffer; a tensor larger than a
buffer is streamed through the ring in pieces of whole rows (of its destination's row-major
order). Consecutive regions of one file are handed to the read threads in batches of up to
:data:`BATCH_BYTES` (one submission for several small tensors: an MoE checkpoint has thousands of
expert tensors of a few MB); a failed batch is read again region by region so that the error names
the tensor whose bytes are missing. Host memory grows by the ring, not by the tensors: the destination holds the bytes. A
column chunk of narrow rows (a row-parallel weight's TP shard: runs shorter than :data:`ROWS_BELOW`,
at most :data:`ROWS_SPAN` run lengths apart) is read as whole rows - one contiguous read per region
instead of one per row - copied to the device as read, and cut there.

Destinations: any strided CUDA tensor (a contiguous parameter, a row or column chunk of one, a
strided view such as a query group's rows inside a fused QKV weight - ``copy_`` scatters it on the
device), in the file's dtype or another (the cast runs on the device, exactly as on the host).
Everything else keeps :class:`~mcore_zoo.weights.io.HFCheckpoint`'s mapping path: destinations
whose elements share memory, and source chunks made of runs shorter than :data:`MIN_RUN_BYTES`
(one read per run would cost more than mapping them). Transform-fused parameters (rules without
direct views) are read into host tensors, fused, and copied by
:func:`~mcore_zoo.weights.load.read_rule_into` as before.

Ordering: the side stream first waits for the destination device's current stream (work queued
there on the destinations is done first); :meth:`StagingRing.finish` waits for every copy (the
host waits on the side stream), so the destinations hold the bytes when it returns.
:class:`~mcore_zoo.weights.io.HFCheckpoint` calls it when a read outside ``queued_reads``
returns and when the ``queued_reads`` block exits (and :meth:`StagingRing.wait` at
``finish_reads``) - before ``load_hf_weights`` returns or broadcasts a parameter.

For tests, the same pipeline runs on the CPU: ``StagingRing(pin=False, cpu_destinations=True)``
stages CPU destinations through an unpinned ring and copies them synchronously.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from . import pread

#: the default ring: 4 buffers of 16 MiB (64 MiB of pinned host memory), 3 of them in flight. On
#: an H100 host (2026-11-27, ``bench/gpu/load_gpu.py``, 8B-shaped checkpoint, host otherwise idle)
#: it loaded at 0.90 / 0.93 of the read + copy floor at TP1 / TP2 where 4 x 64 MiB with one in
#: flight reached 0.88 / 0.82, with a quarter of the host memory; in a sweep on a shared host
#: 4 x 64 MiB with three in flight reached 0.82 / 1.06 against this ring's 0.94 / 1.15, and smaller
#: buffers (8 x 8, 16 x 4 MiB) loaded the MoE checkpoint slower; a deeper ring (8 x 16 MiB, seven in
#: flight) was ahead at EP1 in two of three one-round comparisons on H200 hosts (2026-11-28), behind
#: in the third and never ahead at EP2 or on the 8B-shaped checkpoint (docs/benchmarks.md)
BUFFERS = 4
BUFFER_BYTES = 16 << 20
#: how many buffers' worth of reads may be in flight besides the newest region's (at most
#: ``buffers - 1``: the ring's own size bounds them anyway)
IN_FLIGHT_BUFFERS = 3
MIN_RUN_BYTES = 512  # source runs shorter than this on average: the mapping path
#: source runs shorter than this, evenly spaced at most ROWS_SPAN times their length apart (a column
#: chunk of narrow rows: a row-parallel weight's TP shard), are read as whole rows - one read per
#: piece instead of one per run - and cut out of the staged rows on the destination's device
ROWS_BELOW = 64 << 10
ROWS_SPAN = 4
ALIGN = 512  # regions of a buffer start at multiples of this many bytes
#: how many threads read into the ring (a pool of its own): on 64-vCPU H100 hosts (2026-11-27,
#: ``bench/gpu/load_gpu.py``) loads read with 8 threads instead of 64 (torch's thread count there)
#: took the MoE checkpoint from 0.70 to 0.82 of the floor (one round; 0.49 to 0.59 over two rounds
#: on another host) and the 8B-shaped one from 0.88 to 1.22 (docs/benchmarks.md): each read
#: thread's Python between its reads (futures, wake-ups) competes with the loading thread for the
#: interpreter lock, and 8 threads read the ring's bytes faster than they are copied
READ_THREADS = 8
#: consecutive regions of one file are handed to the read threads together, up to this many bytes
#: (and at most ``1 / BATCH_SHARE`` of a buffer): one submission - and one wake-up of the threads -
#: for several small tensors (an MoE checkpoint's experts) instead of one each
BATCH_BYTES = 16 << 20
BATCH_SHARE = 4
#: a region whose destination is a contiguous tensor of the file's dtype is copied by its bytes - on
#: CUDA one ``cudaMemcpyAsync`` on the side stream, called through ctypes with the interpreter lock
#: held (:func:`_cuda_memcpy_async`), on the CPU (the test ring) ``ctypes.memmove`` - instead of a
#: staged view and ``Tensor.copy_``: two torch calls, each of which gives the lock up to the read
#: threads and waits to get it back (an H100 host: a 3 MB copy's dispatch 5 us alone, 24 us beside
#: 8 read threads; the MoE load's copies 97 - 143 us each). On by default since measured on H100s
#: (docs/benchmarks.md): floor / load 0.59 -> 0.99 (8B-shaped, TP1), 0.52 -> 0.78 (Qwen3-30B-A3B
#: widths, EP1), 0.48 -> 0.64 (EP2); set ``False`` to copy every region through torch. Where this
#: process maps no libcudart, a CUDA ring copies through torch. Raw regions that follow each other
#: in a buffer and in device memory go as one copy (an MoE checkpoint's gate and up rows of each
#: expert: on the CPU test ring, Qwen3-MoE with 4 x 128 experts, 1 563 copies -> 1 059)
RAW_COPIES = True


def _pieces(out: torch.Tensor, start: int, limit: int) -> Iterator[tuple[torch.Tensor, int]]:
    """Views of ``out`` that cover it in row-major order, each of at most ``limit`` elements and
    contiguous in that order (whole rows, or pieces of a row when one row is more): ``(view,
    index of its first element)``, ``start`` being that of ``out``'s."""
    n = out.numel()
    if n <= limit or out.dim() == 0:
        yield out, start
        return
    row = n // out.shape[0]
    if row <= limit:
        step = limit // row
        for i in range(0, out.shape[0], step):
            yield out[i : i + step], start + i * row
        return
    for i in range(out.shape[0]):
        yield from _pieces(out[i], start + i * row, limit)


def _one_run(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether elements of ``shape`` at element ``strides`` lie in row-major order without gaps
    (a whole tensor, a chunk of whole rows): one contiguous run."""
    expected = 1
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if stride != expected:
                return False
            expected *= n
    return True


def _segments(run: int, starts: Sequence[int], itemsize: int, first: int, count: int, address: int,
              base: int = 0) -> list[pread.Segment]:  # fmt: skip
    """The reads of elements ``[first, first + count)`` of a chunk (``run`` elements per file run
    starting at byte ``base + starts[k]``) into consecutive memory at ``address``."""
    if len(starts) == 1:  # one run: one read
        return [(base + starts[0] + first * itemsize, address, count * itemsize)]
    segments: list[pread.Segment] = []
    k, skip, done = first // run, first % run, 0
    while done < count:
        n = min(run - skip, count - done)
        segments.append((base + starts[k] + skip * itemsize, address + done * itemsize, n * itemsize))
        done += n
        k, skip = k + 1, 0
    return segments


def _shifted(starts: Sequence[int], offset: int) -> Sequence[int]:
    """``starts`` each plus ``offset`` (a range stays a range: no list of one start per row)."""
    if isinstance(starts, range):
        return range(starts.start + offset, starts.stop + offset, starts.step)
    return [offset + start for start in starts]


def _row_spacing(run: int, starts: Sequence[int], itemsize: int) -> Optional[int]:
    """The byte distance between consecutive runs when the chunk is best read as whole rows (short
    runs at one spacing of at most :data:`ROWS_SPAN` run lengths), else ``None``."""
    if len(starts) < 2 or run * itemsize >= ROWS_BELOW:
        return None
    spacing = starts[1] - starts[0]
    if spacing % itemsize or not run * itemsize < spacing <= ROWS_SPAN * run * itemsize:
        return None
    if not isinstance(starts, range) and any(b - a != spacing for a, b in zip(starts, starts[1:])):
        return None  # (a range is evenly spaced)
    return spacing


class SourceLayout(NamedTuple):
    """How :meth:`StagingRing.read` reads a chunk (:meth:`StagingRing.layout`): ``run`` elements
    per contiguous file run, the byte offset of each run from the chunk's first byte
    (``starts``), and for a chunk read as whole rows ``rows``: ``(the destination as [rows,
    run], row spacing in bytes)``."""

    run: int
    starts: Sequence[int]
    rows: Optional[tuple[torch.Tensor, int]]


@dataclass(slots=True)
class _Piece:
    """A region of the ring being read into: the reads' futures, where its bytes go next.
    ``rows``: the region holds whole rows, ``(rows, run, spacing)`` in elements, of which the
    destination takes the first ``run`` of each."""

    futures: list[Future]
    destination: torch.Tensor
    staged: Optional[torch.Tensor]  # None: a raw copy (RAW_COPIES) from ``address``
    buffer: int
    nbytes: int
    describe: Optional[Callable[[OSError], BaseException]]
    rows: Optional[tuple[int, int, int]] = None
    #: the region's own reads (``fd``, segments) while its futures are shared with other regions of
    #: a batch: a failed batch is read again region by region, so that the error names its tensor
    own: Optional[tuple[pread.ReadPool, int, list[pread.Segment]]] = None
    #: a raw copy's host address (the region's bytes in the pinned buffer); 0 otherwise
    address: int = 0


@dataclass(slots=True)
class _Batch:
    """Regions of one file whose reads are not yet handed to the read threads."""

    reader: pread.ReadPool
    fd: int
    populate: bool
    segments: list[pread.Segment] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    nbytes: int = 0


_HOST_TO_DEVICE = 1  # cudaMemcpyKind cudaMemcpyHostToDevice


@functools.lru_cache(maxsize=None)
def _cuda_memcpy_async() -> Optional[Callable[[int, int, int, int, int], int]]:
    """``cudaMemcpyAsync(dst, src, count, kind, stream) -> cudaError_t`` of the CUDA runtime torch
    loaded (found among the process's mapped libraries), called with the interpreter lock held
    (``ctypes.PyDLL``: a few microseconds, no hand-over to the read threads); ``None`` where this
    process maps no ``libcudart`` (a torch that links it statically, or no CUDA)."""
    import ctypes
    import os

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    path = next((p for p in sorted(paths) if os.path.basename(p).startswith("libcudart.so")), None)
    if path is None:
        return None
    lib = ctypes.PyDLL(path)
    fn = lib.cudaMemcpyAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _host_memmove(dst: int, src: int, count: int, kind: int, stream: int) -> int:
    """:func:`_cuda_memcpy_async`'s signature on host memory (a CPU ring's raw copies)."""
    import ctypes

    ctypes.memmove(dst, src, count)
    return 0


def _cut(staged: torch.Tensor, rows: Optional[tuple[int, int, int]]) -> torch.Tensor:
    """``staged`` itself, or for a region of whole rows (``(rows, run, spacing)``) the first ``run``
    elements of each row."""
    if rows is None:
        return staged
    count, run, step = rows
    return staged.as_strided((count, run), (step, 1))


def _raw_runs(pieces: Sequence[_Piece]) -> list[tuple[_Piece, int]]:
    """``pieces`` as ``(first region, bytes)`` copies: consecutive raw regions whose bytes follow
    each other in one buffer and whose destinations follow each other in one storage (views of one
    parameter: never a copy across two allocations) join the run before them (its destination's
    pointer and the run's bytes are then the whole copy's); every other region is a copy of its
    own (``bytes``: its own)."""
    runs: list[tuple[_Piece, int]] = []
    end_address = end_pointer = storage = -1
    for piece in pieces:
        if piece.staged is None:
            pointer = piece.destination.data_ptr()
            base = piece.destination.untyped_storage().data_ptr()
            if (runs and piece.address == end_address and pointer == end_pointer and base == storage
                    and runs[-1][0].buffer == piece.buffer):  # fmt: skip
                first, nbytes = runs[-1]
                runs[-1] = (first, nbytes + piece.nbytes)
            else:
                runs.append((piece, piece.nbytes))
            end_address, end_pointer, storage = piece.address + piece.nbytes, pointer + piece.nbytes, base
        else:
            runs.append((piece, piece.nbytes))
            end_address = end_pointer = storage = -1
    return runs


class StagingRing:
    """A ring of ``buffers`` host buffers of ``buffer_bytes`` each (pinned unless ``pin=False``)
    through which :meth:`read` fills device destinations (module docstring); with
    ``cpu_destinations``, CPU destinations too (the CPU test of the pipeline).

    The reads of a region run on ``read_threads`` threads (default :data:`READ_THREADS`; a pool of
    their own) while the caller goes on: up to ``in_flight``
    buffers' bytes (default :data:`IN_FLIGHT_BUFFERS`, at most ``buffers - 1``) are in flight
    besides the newest region's, and the oldest region is copied (queued on the side stream) once
    its reads are done - so the threads read the next regions while the oldest one is read to its
    end and copied."""

    def __init__(self, buffers: Optional[int] = None, buffer_bytes: Optional[int] = None, *, pin: bool = True,
                 cpu_destinations: bool = False, in_flight: Optional[int] = None,
                 read_threads: Optional[int] = None) -> None:  # fmt: skip
        # defaults: the module's values when the ring is made (a bench may set them for a process)
        buffers = BUFFERS if buffers is None else buffers
        buffer_bytes = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        if buffers < 2 or buffer_bytes < ALIGN:
            raise ValueError(f"a staging ring needs >= 2 buffers of >= {ALIGN} bytes (got {buffers} x {buffer_bytes})")
        if in_flight is None:  # the module's depth, or all buffers but one of a smaller ring
            in_flight = min(IN_FLIGHT_BUFFERS, buffers - 1)
        read_threads = READ_THREADS if read_threads is None else read_threads
        if read_threads < 1:
            raise ValueError(f"a staging ring reads with >= 1 thread (got {read_threads})")
        if not 1 <= in_flight <= buffers - 1:
            raise ValueError(f"a staging ring of {buffers} buffers keeps 1 to {buffers - 1} of them in flight (got {in_flight})")
        self.buffers, self.buffer_bytes = buffers, buffer_bytes - buffer_bytes % ALIGN
        self.in_flight_bytes = in_flight * self.buffer_bytes
        self.read_threads = read_threads
        self.pin, self.cpu_destinations = pin, cpu_destinations
        self.bytes_staged = 0  # over the ring's life: every destination byte that went through it
        self.bytes_read = 0  # over the ring's life: every byte read into it (whole rows read more)
        self._ring: list[Optional[torch.Tensor]] = []  # a buffer allocated when first taken
        self._addresses: list[int] = []  # each allocated buffer's address
        self._views: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (buffer, dtype): the buffer as that dtype
        self._events: list[Optional[torch.cuda.Event]] = []
        self._stream: Optional[torch.cuda.Stream] = None
        self._stream_handle = 0  # the side stream's cudaStream_t
        self._raw: Optional[Callable[[int, int, int, int, int], int]] = None  # RAW_COPIES' cudaMemcpyAsync
        self._device: Optional[torch.device] = None
        self._pending: deque[_Piece] = deque()
        self._batch: Optional[_Batch] = None  # the newest regions, reads not yet submitted
        self._in_flight = 0
        self._current = self._used = 0
        self._pinned = False

    def accepts(self, out: torch.Tensor, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
        """Whether :meth:`read` takes this chunk (``shape`` at element ``strides`` in the file)
        into ``out``."""
        return self.layout(out, shape, strides, itemsize) is not None

    def layout(self, out: torch.Tensor, shape: Sequence[int], strides: Sequence[int],
               itemsize: int) -> Optional[SourceLayout]:  # fmt: skip
        """How :meth:`read` reads this chunk into ``out`` (pass it on to :meth:`read`: nothing is
        computed twice), or ``None`` when :meth:`accepts` says no."""
        kind = out.device.type
        if not (kind == "cuda" or (kind == "cpu" and self.cpu_destinations)):
            return None
        if out.layout != torch.strided or out.numel() == 0:
            return None
        out_strides = out.stride()
        if 0 in out_strides and any(st == 0 and n > 1 for n, st in zip(out.shape, out_strides)):
            return None  # elements sharing memory: torch's copy refuses them on the mapping path
        if _one_run(shape, strides):
            return SourceLayout(math.prod(shape), [0], None)
        runs = pread._runs(shape, strides)
        if runs is None:
            return None
        run, outer_shape, outer_strides = runs
        starts = pread._starts(outer_shape, outer_strides, 0, itemsize)
        rows = self._whole_rows(out, run, starts, itemsize)
        if rows is None and len(starts) > 1 and run * itemsize < MIN_RUN_BYTES:
            return None
        return SourceLayout(run, starts, rows)

    def read(self, reader: pread.ReadPool, fd: int, out: torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
             strides: Sequence[int], file_offset: int, describe: Optional[Callable[[OSError], BaseException]] = None,
             layout: Optional[SourceLayout] = None) -> None:  # fmt: skip
        """Fill ``out`` with the chunk of ``dtype`` elements of ``shape`` at element ``strides``
        from byte ``file_offset`` of ``fd`` (row-major order; :meth:`accepts` said yes;
        ``layout``: what :meth:`layout` returned for it, computed here when not given). Its reads
        and copies may still run when it returns: :meth:`wait` waits for them, and raises a read's
        error (``describe(error)`` when given)."""
        itemsize = dtype.itemsize
        if layout is None:
            layout = self.layout(out, shape, strides, itemsize)
            assert layout is not None, "read of a chunk the ring does not accept"
        self._start(out.device)
        if layout.rows is not None:
            rows, spacing = layout.rows
            self._read_rows(reader, fd, rows, dtype, _shifted(layout.starts, file_offset), spacing, describe)
            return
        limit = self.buffer_bytes // itemsize
        pieces = ((out, 0),) if out.numel() <= limit else _pieces(out, 0, limit)
        for view, first in pieces:
            count = view.numel()
            nbytes = count * itemsize
            while self._pending and self._in_flight > self.in_flight_bytes:
                self._copy_oldest()
            offset = self._take(nbytes)
            address = self._addresses[self._current] + offset
            segments = _segments(layout.run, layout.starts, itemsize, first, count, address, file_offset)
            if self._raw and view.dtype == dtype and view.is_contiguous():  # copied by its bytes (RAW_COPIES)
                piece = _Piece([], view, None, self._current, nbytes, describe, own=(reader, fd, segments), address=address)
            else:
                shape_ = view.shape
                staged = self._typed(dtype).as_strided(shape_, pread.row_major_strides(shape_), offset // itemsize)
                piece = _Piece([], view, staged, self._current, nbytes, describe, own=(reader, fd, segments))
            self._pending.append(piece)
            self._queue(piece, reader, fd, segments, nbytes)
            self._in_flight += nbytes
            self.bytes_staged += nbytes
            self.bytes_read += nbytes

    def _whole_rows(self, out: torch.Tensor, run: int, starts: Sequence[int],
                    itemsize: int) -> Optional[tuple[torch.Tensor, int]]:  # fmt: skip
        """``(out as [rows, run], row spacing in bytes)`` when the chunk is read as whole rows:
        :func:`_row_spacing` says so, a row fits a buffer and ``out`` is a view of its rows in order."""
        spacing = _row_spacing(run, starts, itemsize)
        if spacing is None or spacing > self.buffer_bytes or out.numel() != run * len(starts):
            return None
        try:
            return out.view(len(starts), run), spacing  # the destination in the chunk's row-major order
        except RuntimeError:
            return None

    def _read_rows(self, reader: pread.ReadPool, fd: int, out: torch.Tensor, dtype: torch.dtype, starts: Sequence[int],
                   spacing: int, describe: Optional[Callable[[OSError], BaseException]]) -> None:  # fmt: skip
        """Fill ``out`` (``[rows, run]``) from runs at ``starts`` ``spacing`` bytes apart by reading
        whole rows: as many as a buffer holds per region, one contiguous file range each."""
        itemsize = dtype.itemsize
        rows, run = out.shape
        step = spacing // itemsize
        per_piece = self.buffer_bytes // spacing
        for first in range(0, rows, per_piece):
            count = min(per_piece, rows - first)
            nbytes = (count - 1) * spacing + run * itemsize
            while self._pending and self._in_flight > self.in_flight_bytes:
                self._copy_oldest()
            offset = self._take(nbytes)
            self._submit()  # the regions queued before this one go first
            address = self._addresses[self._current] + offset
            futures = reader.submit(fd, [(starts[first], address, nbytes)], populate=not self._pinned,
                                    threads=self.read_threads)  # fmt: skip
            staged = self._typed(dtype).as_strided((nbytes // itemsize,), (1,), offset // itemsize)
            piece = _Piece(futures, out[first : first + count], staged, self._current, nbytes, describe,
                           rows=(count, run, step))  # fmt: skip
            self._pending.append(piece)
            self._in_flight += nbytes
            self.bytes_staged += count * run * itemsize
            self.bytes_read += nbytes

    def wait(self) -> None:
        """Return once every read and copy :meth:`read` started is done (the ring stays
        allocated); raises the first failed read's error, after every read has ended."""
        try:
            self._submit()
            while self._pending:
                self._copy_oldest()
        finally:
            self._submit()  # reads queued but never submitted: none runs after the ring is handed back
            for piece in self._pending:  # after a failed read: the others end before the ring is touched
                for future in piece.futures:
                    future.exception()
            self._pending.clear()
            self._in_flight = 0
            if self._stream is not None:
                self._stream.synchronize()
            self._events = [None] * len(self._ring)

    def finish(self) -> None:
        """:meth:`wait`, then hand the buffers back (to torch's pinned-memory cache: the next
        load's ring takes them again without a new allocation)."""
        try:
            self.wait()
        finally:
            self._ring, self._events, self._stream, self._device, self._raw = [], [], None, None, None
            self._addresses, self._views = [], {}
            self._current = self._used = 0

    # ------------------------------------------------------------------ internals
    def _start(self, device: torch.device) -> None:
        """The ring, and for a CUDA ``device`` the side stream, ordered after the device's
        current stream (at the first read after :meth:`finish`). Only the first buffer is
        allocated here, the others when first taken (:meth:`_take`): pinning host memory takes
        time, and a later buffer's allocation then overlaps the reads and copies of the ones
        before it."""
        if self._ring and self._device == device:
            return
        if self._ring:  # another device: its copies first
            self.finish()
        cuda = device.type == "cuda"
        self._pinned = self.pin and cuda
        self._ring = [None] * self.buffers
        self._addresses, self._views = [0] * self.buffers, {}
        self._allocate(0)
        self._events = [None] * self.buffers
        self._device = device
        if cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            self._stream_handle = self._stream.cuda_stream
        if not RAW_COPIES:
            self._raw = None
        elif cuda:  # from pinned buffers only (a pageable source would make the copy synchronous)
            self._raw = _cuda_memcpy_async() if self._pinned else None
        else:
            self._raw = _host_memmove

    def _allocate(self, index: int) -> None:
        """Allocate buffer ``index`` of the ring."""
        buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self._pinned)
        self._ring[index], self._addresses[index] = buffer, buffer.data_ptr()

    def _typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The current buffer viewed as ``dtype`` elements (regions start at multiples of
        :data:`ALIGN` bytes, so at whole elements)."""
        key = (self._current, dtype)
        typed = self._views.get(key)
        if typed is None:
            typed = self._views[key] = self._ring[self._current].view(dtype)  # type: ignore[union-attr]
        return typed

    def _copy_oldest(self) -> None:
        """Wait for the oldest region's reads, then copy it to its destination (queued on the
        side stream, an event marking when its buffer is free again) - and with it the regions
        right behind it that share its reads (the rest of its batch: read too, by then)."""
        if not self._pending[0].futures:  # its reads wait in the open batch
            self._submit()
        futures = self._pending[0].futures
        error = next((e for e in [future.exception() for future in futures] if e is not None), None)
        if error is not None:
            self._copy_failed(error)
            return
        ready = [self._pending.popleft()]
        while self._pending and self._pending[0].futures is futures:
            ready.append(self._pending.popleft())
        self._in_flight -= sum(piece.nbytes for piece in ready)
        self._copy(ready)

    def _copy_failed(self, error: BaseException) -> None:
        """The oldest region, whose reads failed: when its reads were part of a batch, its own
        reads again (to tell whose error it is) and its copy if they succeed; else the error (as
        the region's ``describe`` makes it, when given)."""
        piece = self._pending.popleft()
        self._in_flight -= piece.nbytes
        if piece.own is not None:  # the batch failed somewhere: this region's own reads again
            reader, fd, segments = piece.own
            try:
                reader.read(fd, segments, populate=not self._pinned)
            except OSError as exc:
                error = exc
            else:
                self._copy([piece])
                return
        if piece.describe is not None and isinstance(error, OSError):
            raise piece.describe(error) from error
        raise error

    def _copy(self, pieces: list[_Piece]) -> None:
        """Copy regions whose reads are done to their destinations (oldest first; on the side stream,
        an event recorded after the last copy out of each buffer). Raw regions that follow each
        other both in the buffer and in device memory (an expert's gate and up rows, read one after
        the other into the halves of its ``linear_fc1``) go as one copy."""
        with torch.no_grad():
            if self._stream is None:
                for piece, nbytes in _raw_runs(pieces):
                    if piece.staged is None:
                        self._raw_copy(piece, 0, nbytes)
                    else:
                        piece.destination.copy_(_cut(piece.staged, piece.rows))
                return
            runs = _raw_runs(pieces)
            # torch copies are queued on the side stream as the current stream; raw copies name it,
            # and need only its device current (no stream switch when every region is raw and the
            # device is current: most of an MoE model's small tensors)
            switch = torch.cuda.current_device() != self._device.index or any(piece.staged is not None for piece, _ in runs)
            with torch.cuda.stream(self._stream) if switch else contextlib.nullcontext():
                for i, (piece, nbytes) in enumerate(runs):
                    if piece.staged is None:  # a raw copy (RAW_COPIES): the interpreter lock kept
                        self._raw_copy(piece, self._stream_handle, nbytes)
                    elif piece.rows is None:
                        piece.destination.copy_(piece.staged, non_blocking=True)
                    else:  # whole rows to the device as they are, cut there (a strided host source
                        # would be made contiguous on the host first, synchronously)
                        rows = torch.empty_like(piece.staged, device=self._device)
                        rows.copy_(piece.staged, non_blocking=True)
                        piece.destination.copy_(_cut(rows, piece.rows))
                    # the buffer's reuse waits for its last copy: a buffer's regions are consecutive in
                    # the queue, so only a region with none of its buffer behind it records the event
                    # (a run of raw regions lies in one buffer: its last region's is its own)
                    after = runs[i + 1][0] if i + 1 < len(runs) else (self._pending[0] if self._pending else None)
                    if after is None or after.buffer != piece.buffer:
                        self._events[piece.buffer] = self._stream.record_event()

    def _raw_copy(self, piece: _Piece, stream: int, nbytes: int) -> None:
        """Copy ``nbytes`` from a raw region (:data:`RAW_COPIES`) on by its bytes - the region, or a
        run of regions after it (:func:`_raw_runs`) - queued on ``stream`` on CUDA."""
        assert self._raw is not None
        error = self._raw(piece.destination.data_ptr(), piece.address, nbytes, _HOST_TO_DEVICE, stream)
        if error:
            raise RuntimeError(f"cudaMemcpyAsync of a staged region ({nbytes} bytes into"
                               f" {tuple(piece.destination.shape)}) failed: cudaError_t {error}")  # fmt: skip

    def _queue(self, piece: _Piece, reader: pread.ReadPool, fd: int, segments: list[pread.Segment], nbytes: int) -> None:
        """Add a region's reads to the open batch (a batch holds one file's reads; a full one, or one of
        another file, is submitted first)."""
        batch = self._batch
        if batch is not None and (batch.fd != fd or batch.reader is not reader):
            self._submit()
            batch = None
        if batch is None:
            batch = self._batch = _Batch(reader, fd, populate=not self._pinned)  # pinned pages are resident
        batch.segments += segments
        batch.pieces.append(piece)
        batch.nbytes += nbytes
        if batch.nbytes >= min(BATCH_BYTES, self.buffer_bytes // BATCH_SHARE):
            self._submit()

    def _submit(self) -> None:
        """Hand the open batch's reads to the read threads (its regions share the futures)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        futures = batch.reader.submit(batch.fd, batch.segments, populate=batch.populate, threads=self.read_threads)
        for piece in batch.pieces:
            piece.futures = futures
        if len(batch.pieces) == 1:
            batch.pieces[0].own = None  # its futures are its own

    def _take(self, nbytes: int) -> int:
        """``nbytes`` of the ring, free to be written: the rest of the current buffer, else the
        next buffer once every copy out of it is done. Returns their byte offset in the (then)
        current buffer."""
        if self._used + nbytes > self.buffer_bytes:
            self._current = (self._current + 1) % self.buffers
            while any(piece.buffer == self._current for piece in self._pending):
                self._copy_oldest()
            event = self._events[self._current]
            if event is not None:
                event.synchronize()
                self._events[self._current] = None
            self._used = 0
        if self._ring[self._current] is None:
            self._allocate(self._current)
        offset = self._used
        self._used += -(-nbytes // ALIGN) * ALIGN
        return offset


class MappingPath(StagingRing):
    """A ring that takes no chunk: every destination an :class:`~mcore_zoo.weights.io.HFCheckpoint`
    reads with it goes the mapping path (``HFCheckpoint(path, staging=MappingPath())``) - the
    reference the ring's loads are compared with bit for bit. Refuses in :meth:`layout`, which both
    :meth:`accepts` and the checkpoint's reads ask."""

    def layout(self, out: torch.Tensor, shape: Sequence[int], strides: Sequence[int],
               itemsize: int) -> Optional[SourceLayout]:  # fmt: skip
        return None
