"""Many same-dtype copies in one kernel launch: each copy as byte runs, all runs in one table.

A refit writes a few hundred engine regions from views of the trainer's parameters. One
``Tensor.copy_`` per region costs a launch each (10-20 us of host time on a GPU machine, more than
the copy itself once the tensors are split over TP ranks), and a strided region (mcore's q / k / v
rows of each query group into vLLM's ``[q; k; v]``) runs through the generic elementwise kernel at
about a third of a memcpy's bandwidth. Here a copy ``dst <- src`` of the same dtype and shape is
described as contiguous byte runs ``(src address, dst address, bytes)`` (:func:`byte_runs`: the
innermost dimensions contiguous in both tensors make one run, the outer dimensions enumerate
them), and a :class:`RunTable` of many copies' runs is written by one launch
(:meth:`RunTable.launch`) that moves 8-byte words at memcpy speed.

Contract:

* Only bitwise copies: same dtype, same shape, every run's addresses and length a multiple of
  :data:`UNIT` bytes (:func:`byte_runs` returns ``None`` otherwise; the caller copies that one
  with ``copy_``). Overlapping source and destination are not supported (a refit never has them).
* The table holds raw addresses: it is valid while every tensor it was built from stays where it
  was. The caller keys it on the tensors' data pointers and layouts and rebuilds it on any change
  (:class:`~mcore_zoo.rollout.vllm._Binding` does).
* CUDA: a Triton kernel (``available()``), launched on the current stream like ``copy_``; the
  launching rank's tensors only (one device). CPU: the runs are replayed with ``ctypes.memmove``
  (what the tests exercise; production CPU copies keep ``copy_``).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Optional

import torch

from .logprob_rows import available

#: bytes every run's addresses and length must be a multiple of (the kernel moves int64 words)
UNIT = 8
#: words one program copies (64 KB): a run of n words takes ceil(n / TILE) programs
TILE = 8192
#: words one program moves per step
BLOCK = 1024


def byte_runs(dst: torch.Tensor, src: torch.Tensor, max_runs: int = 4096) -> Optional[list[tuple[int, int, int]]]:
    """``dst.copy_(src)`` as ``[(src address, dst address, bytes)]``, or ``None`` where that is not
    a plain byte copy this module takes: dtypes or shapes differ, devices differ, more than
    ``max_runs`` runs, or an address / length not a multiple of :data:`UNIT`. The innermost
    dimensions that are row-major contiguous in both tensors make one run; each index of the outer
    dimensions is one run."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.device != src.device:
        return None
    size = dst.element_size()
    dims = [(n, ds, ss) for n, ds, ss in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if not dims:  # one element (or a 0-dim tensor)
        runs_shape, inner = [], 1
    else:
        inner, k = 1, len(dims)
        while k > 0 and dims[k - 1][1] == inner and dims[k - 1][2] == inner:
            inner *= dims[k - 1][0]
            k -= 1
        if inner == 1:  # not even the last dimension is contiguous in both
            return None
        runs_shape = dims[:k]
    if dst.numel() == 0:
        return []
    count = math.prod(n for n, _, _ in runs_shape)
    length = inner * size
    if count > max_runs or length % UNIT:
        return None
    d0, s0 = dst.data_ptr(), src.data_ptr()
    offsets = [(0, 0)]
    for n, ds, ss in runs_shape:
        offsets = [(d + i * ds * size, s + i * ss * size) for d, s in offsets for i in range(n)]
    runs = [(s0 + s, d0 + d, length) for d, s in offsets]
    if any(s % UNIT or d % UNIT for s, d, _ in runs):
        return None
    return runs


class RunTable:
    """The runs of many copies on one device, ready to launch (see the module docstring).

    Built once per layout: on CUDA a ``[runs, 4]`` int64 table (source and destination as word
    offsets from an anchor tensor, length in words, first program) and the run of every program.
    """

    def __init__(self, runs: list[tuple[int, int, int]], device: torch.device) -> None:
        self.device = torch.device(device)
        self.runs = [r for r in runs if r[2]]
        self.nbytes = sum(n for _, _, n in self.runs)
        self._programs = 0
        if self.device.type != "cuda" or not self.runs:
            return
        self._anchor = torch.empty(2, dtype=torch.int64, device=self.device)  # 16-byte aligned
        base = self._anchor.data_ptr()
        words = torch.tensor([n // UNIT for _, _, n in self.runs], dtype=torch.int64)
        tiles = (words + TILE - 1) // TILE
        first = torch.cumsum(tiles, 0) - tiles
        table = torch.stack([torch.tensor([(s - base) // UNIT for s, _, _ in self.runs], dtype=torch.int64),
                             torch.tensor([(d - base) // UNIT for _, d, _ in self.runs], dtype=torch.int64),
                             words, first], dim=1)  # fmt: skip
        self._programs = int(tiles.sum())
        self._table = table.to(self.device)
        # on the device (torch's CPU repeat_interleave takes milliseconds for this); output_size: no sync
        self._program_run = torch.repeat_interleave(torch.arange(len(self.runs), dtype=torch.int32, device=self.device),
                                                    tiles.to(self.device), output_size=self._programs)  # fmt: skip
        # 16-byte aligned runs let the kernel use 16-byte loads and stores
        self._aligned = all(s % 16 == 0 and d % 16 == 0 and n % 16 == 0 for s, d, n in self.runs)

    def launch(self) -> None:
        """Write every run (enqueued on the current stream on CUDA; done on return on the CPU)."""
        if not self.runs:
            return
        if self.device.type != "cuda":
            for s, d, n in self.runs:
                ctypes.memmove(d, s, n)
            return
        with torch.cuda.device(self.device):
            _kernel()[(self._programs,)](self._anchor, self._table, self._program_run,
                                         TILE=TILE, BLOCK=BLOCK, ALIGNED=self._aligned)  # fmt: skip


@functools.lru_cache(maxsize=None)
def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def copy_runs_kernel(anchor, table, program_run, TILE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        run = tl.load(program_run + pid).to(tl.int64)
        src = tl.load(table + run * 4)
        dst = tl.load(table + run * 4 + 1)
        words = tl.load(table + run * 4 + 2)
        start = (pid - tl.load(table + run * 4 + 3)) * TILE
        if ALIGNED:
            src = tl.multiple_of(src, 2)
            dst = tl.multiple_of(dst, 2)
            words = tl.multiple_of(words, 2)
        for lo in tl.static_range(0, TILE, BLOCK):
            offs = start + lo + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(anchor + dst + offs, tl.load(anchor + src + offs, mask=mask), mask=mask)

    return copy_runs_kernel


def supported(device: torch.device) -> bool:
    """Whether :class:`RunTable` launches on ``device`` in production: CUDA with Triton."""
    return torch.device(device).type == "cuda" and available()


__all__ = ["UNIT", "RunTable", "byte_runs", "supported"]
