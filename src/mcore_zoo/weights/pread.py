"""Positional reads of checkpoint bytes straight into CPU tensor memory (the load's hot path).

Copying a chunk from a memory map of the file costs a page fault per source page (the mapping is
fresh for every chunk) and one per destination page (parameters are allocated untouched). A
positional read (``preadv``) has no source mapping at all: the kernel copies from the page cache
into the destination. Its destination pages are populated first, in one call per range
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) instead of one fault at a time inside the copy; and
a large chunk is split over ``torch.get_num_threads()`` threads (``preadv`` and ``madvise`` release
the GIL). No file page is mapped into the process, so the load's resident set is the parameters.

:func:`plan_segments` says whether a chunk can be read this way - a CPU destination of the file's
dtype, both sides made of contiguous runs of at least :data:`MIN_RUN` bytes on average - and
returns the ``(file offset, address, length)`` copies; :class:`ReadPool` runs them. Everything else
(other devices, casts, column chunks of narrow rows) keeps the mapping path of
:class:`~mcore_zoo.weights.io.HFCheckpoint`.

A load reads with the pool *queued* (:meth:`ReadPool.queued`): each read is cut into pieces of
:data:`PIECE` bytes that the read threads take in turn while the caller plans the next parameter,
so the threads copy without a pause between tensors and without one tensor's split waiting for
its slower half; :meth:`ReadPool.wait` returns when every queued byte is written (or raises the
first read's error).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import math
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Sequence

import torch

MIN_RUN = 64 << 10  # average bytes per run (of several) below which the mapping path is faster
MAX_SEGMENTS = 4096
SPLIT_MIN = 8 << 20  # a chunk at least this large is split over the read threads
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SPLIT_ALIGN = _PAGE  # the threads' shares are multiples of this many bytes
PIECE = 8 << 20  # bytes of one queued read job (a queued read of more is cut into pieces)
_IOV_MAX = 1024
_MADV_POPULATE_WRITE = 23

Segment = tuple[int, int, int]  # (file offset, destination address, bytes)


def available() -> bool:
    return hasattr(os, "preadv")


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous (row-major) tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 1, 0, -1):
        strides[d - 1] = strides[d] * shape[d]
    return strides


def _runs(shape: Sequence[int], strides: Sequence[int]) -> Optional[tuple[int, list[int], list[int]]]:
    """Coalesce a strided layout (element units) into contiguous runs: ``(run length, outer
    shape, outer strides)``, or ``None`` when the innermost dimension is not contiguous."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return 1, [], []
    merged = [dims[-1]]
    for n, s in reversed(dims[:-1]):
        inner_n, inner_s = merged[0]
        if s == inner_n * inner_s:
            merged[0] = (n * inner_n, inner_s)
        else:
            merged.insert(0, (n, s))
    run, step = merged[-1]
    if step != 1:
        return None
    return run, [n for n, _ in merged[:-1]], [s for _, s in merged[:-1]]


def _starts(outer_shape: list[int], outer_strides: list[int], base: int, scale: int) -> Sequence[int]:
    """Start of every run in row-major order (``base + scale * element offset``). One outer
    dimension (a row or column chunk of a matrix: every run the same distance apart) gives a
    ``range`` - no list of one start per row (a TP2 row-parallel shard of an 8B model has 262 144)."""
    if not outer_shape:
        return [base]
    if len(outer_shape) == 1:
        step = scale * outer_strides[0]
        return range(base, base + step * outer_shape[0], step)
    return [base + scale * sum(i * s for i, s in zip(index, outer_strides))
            for index in itertools.product(*(range(n) for n in outer_shape))]  # fmt: skip


def plan_segments(
    out: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int], file_offset: int
) -> Optional[list[Segment]]:
    """The copies that read a chunk - ``dtype`` elements of ``shape`` at element ``strides`` from
    byte ``file_offset`` of the file, in row-major order - into ``out`` (as many elements), or
    ``None`` when this module should not read it (module docstring)."""
    if out.dtype != dtype or out.device.type != "cpu" or out.layout != torch.strided or out.numel() == 0:
        return None
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        return None  # elements sharing memory: left to torch's copy (which refuses them)
    itemsize = out.element_size()
    src = _runs(shape, strides)
    dst = _runs(tuple(out.shape), out.stride())
    if src is None or dst is None:
        return None
    src_count, dst_count = math.prod(src[1]), math.prod(dst[1])
    total = math.prod(shape) * itemsize
    runs = max(src_count, dst_count)
    if src_count + dst_count > MAX_SEGMENTS or (runs > 1 and total < MIN_RUN * runs):
        return None
    src_run, dst_run = src[0] * itemsize, dst[0] * itemsize
    src_starts = _starts(src[1], src[2], file_offset, itemsize)
    dst_starts = _starts(dst[1], dst[2], out.data_ptr(), itemsize)
    segments: list[Segment] = []
    i = j = 0
    si = dj = 0  # bytes done within the current source / destination run
    while i < len(src_starts):
        n = min(src_run - si, dst_run - dj)
        segments.append((src_starts[i] + si, dst_starts[j] + dj, n))
        si, dj = si + n, dj + n
        if si == src_run:
            i, si = i + 1, 0
        if dj == dst_run:
            j, dj = j + 1, 0
    return segments


def _split(segments: list[Segment], parts: int) -> list[list[Segment]]:
    """``segments`` cut into at most ``parts`` groups of about equal bytes."""
    total = sum(n for _, _, n in segments)
    share = -(-total // parts)
    share += -share % SPLIT_ALIGN
    groups: list[list[Segment]] = [[]]
    room = share
    for offset, address, n in segments:
        while n:
            if room == 0:
                groups.append([])
                room = share
            take = min(n, room)
            groups[-1].append((offset, address, take))
            offset, address, n, room = offset + take, address + take, n - take, room - take
    return groups


def _parts(total: int, threads: Optional[int] = None) -> int:
    """How many of ``threads`` (default ``torch.get_num_threads()``) threads a read of ``total``
    bytes is split over."""
    threads = torch.get_num_threads() if threads is None else threads
    return min(threads, max(1, total // (SPLIT_MIN // 2))) if total >= SPLIT_MIN else 1


class ReadPool:
    """Runs :func:`plan_segments`' copies on ``torch.get_num_threads()`` threads (the caller's
    and a pool's, created at the first large read); :meth:`close` stops the pool.

    Inside :meth:`queued`, :meth:`read` (unless told ``wait=True``) hands its copies to the
    pool's threads in pieces and returns at once; the destination holds the bytes once
    :meth:`wait` has returned."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._workers = 0
        self._sized: dict[int, ThreadPoolExecutor] = {}  # submit(threads=N)'s pools of exactly N threads
        self._populate = sys.platform.startswith("linux")
        self._madvise = None
        self._queue = False
        # (a queued piece, how to describe its error, its destination: kept alive until waited for)
        self._pending: list[tuple[Future, Optional[Callable[[OSError], BaseException]], Optional[torch.Tensor]]] = []

    def read(self, fd: int, segments: list[Segment], *, wait: bool = True, out: Optional[torch.Tensor] = None,
             describe: Optional[Callable[[OSError], BaseException]] = None, populate: bool = True) -> None:  # fmt: skip
        """Copy every segment from ``fd``; raises ``OSError`` (``EIO`` at an unexpected end of
        file), or ``describe(error)`` when given. Queued (inside :meth:`queued`, ``wait=False``):
        the error is raised by :meth:`wait`, and ``out`` (the tensor the segments write into) is
        kept alive until then, so that no thread writes into freed memory. ``populate=False``:
        the destination pages are resident already (a reused or pinned buffer), none is populated."""
        total = sum(n for _, _, n in segments)
        if self._queue and not wait:
            pieces = _split(segments, max(1, -(-total // PIECE)))
            pool = self._executor(torch.get_num_threads())
            self._pending += [(pool.submit(self._run, fd, piece, populate), describe, out) for piece in pieces]
            return
        try:
            self._read_now(fd, segments, total, populate)
        except OSError as exc:
            if describe is None:
                raise
            raise describe(exc) from exc

    def submit(self, fd: int, segments: list[Segment], *, populate: bool = True,
               threads: Optional[int] = None) -> list[Future]:  # fmt: skip
        """Start copying the segments on the pool's threads, cut into parts as :meth:`read` cuts
        them; returns the parts' futures (each raises its read's ``OSError``). The caller keeps
        the destination alive until every future is done. ``threads``: on a pool of exactly that
        many threads (its own, kept for later submissions of the same size) instead of the
        pool of ``torch.get_num_threads()``."""
        total = sum(n for _, _, n in segments)
        parts = _parts(total, threads)
        groups = _split(segments, parts) if parts > 1 else [segments]
        if threads is None:
            pool = self._executor(torch.get_num_threads())
        else:
            pool = self._sized.get(threads)
            if pool is None:
                pool = self._sized[threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"mcore-zoo-read{threads}")
        return [pool.submit(self._run, fd, group, populate) for group in groups if group]

    def _read_now(self, fd: int, segments: list[Segment], total: int, populate: bool = True) -> None:
        parts = _parts(total)
        if parts == 1:
            self._run(fd, segments, populate)
            return
        groups = _split(segments, parts)
        pool = self._executor(len(groups) - 1)
        futures = [pool.submit(self._run, fd, group, populate) for group in groups[1:]]
        try:
            self._run(fd, groups[0], populate)
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def _executor(self, workers: int) -> ThreadPoolExecutor:
        """The pool, with at least ``workers`` threads (a smaller one is replaced once its queued
        reads are done)."""
        if self._pool is None or self._workers < workers:
            if self._pool is not None:
                self._pool.shutdown()
            self._workers = workers
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mcore-zoo-read")
        return self._pool

    @property
    def queuing(self) -> bool:
        """Whether reads are being queued (inside :meth:`queued`)."""
        return self._queue

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """Queue reads inside the block; every queued read is finished when the block exits
        (:meth:`wait`, which raises the first read's error - after the block's own, if it raised)."""
        outer, self._queue = self._queue, True
        try:
            yield
        finally:
            self._queue = outer
            if not outer:
                self.wait()

    def wait(self) -> None:
        """Return once every queued read has finished; raise the first one's error (every read is
        waited for first, so no thread writes into a destination after this returns)."""
        pending, self._pending = self._pending, []
        errors = [(future.exception(), describe) for future, describe, _ in pending]
        for error, describe in errors:
            if error is None:
                continue
            if describe is not None and isinstance(error, OSError):
                raise describe(error) from error
            raise error

    def populate(self, out: torch.Tensor) -> None:
        """Populate the pages that ``out`` (a CPU tensor about to be written whole) spans, in one
        call: what :meth:`read` does for its destinations, for a copy made elsewhere. The
        contents do not change (pages between a view's elements are populated as they are)."""
        if out.device.type != "cpu" or out.layout != torch.strided or out.numel() == 0:
            return
        span = sum((n - 1) * abs(st) for n, st in zip(out.shape, out.stride())) + 1
        self._prefault(out.data_ptr(), span * out.element_size())

    def _prefault(self, address: int, n: int) -> None:
        """Populate the whole pages of ``[address, address + n)`` writable, in one call."""
        start = -(-address // _PAGE) * _PAGE
        stop = (address + n) // _PAGE * _PAGE
        if not self._populate or stop - start < 16 * _PAGE:
            return
        if self._madvise is None:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        failed = self._madvise(start, stop - start, _MADV_POPULATE_WRITE) != 0
        if failed and ctypes.get_errno() == errno.EINVAL:
            self._populate = False  # a kernel without it (< 5.14): the read faults the pages in

    def _run(self, fd: int, segments: list[Segment], populate: bool = True) -> None:
        for _, address, n in segments if populate else ():
            self._prefault(address, n)
        k = 0
        while k < len(segments):  # one preadv per run of file-contiguous segments
            first, _, want = segments[k]
            end = k + 1
            while end < len(segments) and end - k < _IOV_MAX and segments[end][0] == first + want:
                want += segments[end][2]
                end += 1
            batch, k = segments[k:end], end
            buffers = [(ctypes.c_char * n).from_address(address) for _, address, n in batch]
            done = os.preadv(fd, buffers, first)
            while done < want:  # a short read: the rest, one segment at a time
                offset, address, n = next(s for s in batch if s[0] - first + s[2] > done)
                skip = first + done - offset
                rest = (ctypes.c_char * (n - skip)).from_address(address + skip)
                got = os.preadv(fd, [rest], offset + skip)
                if got == 0:
                    raise OSError(errno.EIO, "unexpected end of file")
                done += got

    def close(self) -> None:
        """Finish the queued reads (their errors are dropped: the caller is closing) and stop the pool."""
        for future, _, _ in self._pending:
            future.exception()
        self._pending = []
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
            self._workers = 0
        for pool in self._sized.values():
            pool.shutdown()
        self._sized.clear()
