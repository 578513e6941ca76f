"""``mcore_zoo.kernels.copy_runs``: copies as byte runs, executed on the CPU (``memmove``) against
``Tensor.copy_``. The Triton kernel that executes the same tables on CUDA: ``tests/gpu/test_copy_runs_gpu.py``
and ``tests/gpu/test_refit_gpu.py`` (every engine parameter bitwise after a refit)."""

from __future__ import annotations

import torch

from mcore_zoo.kernels.copy_runs import UNIT, RunTable, byte_runs


def _pairs():
    """``(dst, src)`` view pairs as a refit makes them, on fresh storage."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(8 * 6, 64, generator=g, dtype=torch.float32)  # mcore's per-group [q q q q k v] rows
    engine = torch.zeros(8 * 6, 64)  # vLLM's [q; k; v]
    q_src = fused.view(8, 6, 64)[:, :4]
    k_src = fused.view(8, 6, 64)[:, 4:5]
    yield engine[:32].view(8, 4, 64), q_src  # strided source: 8 runs
    yield engine[32:40].view(8, 1, 64), k_src  # strided, one row per group
    big = torch.randn(100, 64, generator=g)
    yield torch.zeros(100, 64), big  # contiguous: one run
    host = torch.zeros(10, 128, dtype=torch.bfloat16)
    yield host[:, 64:], torch.randn(10, 64, generator=g).to(torch.bfloat16)  # strided destination
    yield torch.zeros(()), torch.tensor(3.5)  # 0-dim (4 bytes: not a multiple of UNIT -> None)
    yield torch.zeros(1, 2), torch.randn(1, 2, generator=g)  # size-1 dims dropped


def test_byte_runs_copy_what_copy_does():
    for dst, src in _pairs():
        runs = byte_runs(dst, src)
        want = dst.clone().copy_(src)
        if runs is None:
            assert dst.numel() * dst.element_size() % UNIT, (dst.shape, src.shape)
            continue
        assert all(s % UNIT == 0 and d % UNIT == 0 and n % UNIT == 0 for s, d, n in runs)
        RunTable(runs, dst.device).launch()
        assert torch.equal(dst, want)


def test_byte_runs_counts_and_refusals():
    fused = torch.zeros(48, 64)
    assert len(byte_runs(torch.zeros(8, 4, 64), fused.view(8, 6, 64)[:, :4])) == 8
    assert len(byte_runs(torch.zeros(48, 64), fused)) == 1
    assert byte_runs(torch.zeros(48, 64, dtype=torch.float64), fused.double()) is not None
    assert byte_runs(torch.zeros(48, 64), fused.double()) is None  # a cast is not a byte copy
    assert byte_runs(torch.zeros(64, 48), fused.t()) is None  # no contiguous inner dimension
    assert byte_runs(torch.zeros(48, 64), torch.zeros(64, 48)) is None  # shapes differ
    assert byte_runs(torch.zeros(8, 4, 64), fused.view(8, 6, 64)[:, :4], max_runs=4) is None
    odd = torch.zeros(3, 3, dtype=torch.bfloat16)  # 6-byte rows: not whole words
    assert byte_runs(odd[:, :3], torch.zeros(3, 3, dtype=torch.bfloat16)) is None
    assert byte_runs(torch.zeros(0, 64), torch.zeros(0, 64)) == []


def test_a_table_of_many_copies_writes_each_region_and_nothing_else():
    g = torch.Generator().manual_seed(1)
    src = torch.randn(4096, generator=g)
    dst = torch.full((4096 + 64,), -1.0)
    pieces = [(0, 100, 64), (100, 0, 36), (1000, 2000, 2048)]  # (src start, dst start, length) in floats
    runs = [r for s, d, n in pieces for r in byte_runs(dst[d : d + n], src[s : s + n])]
    table = RunTable(runs, dst.device)
    assert table.nbytes == 4 * sum(n for _, _, n in pieces)
    table.launch()
    want = torch.full_like(dst, -1.0)
    for s, d, n in pieces:
        want[d : d + n] = src[s : s + n]
    assert torch.equal(dst, want)
