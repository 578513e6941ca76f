"""The staging ring (``mcore_zoo.weights.staging``), run on the CPU: an unpinned ring staging CPU
destinations goes through the same pieces, ring regions, reads and copies as the device path, and
must give what the positional-read / mapping path gives, bit for bit. The CUDA counterpart is
``tests/gpu/test_staging_gpu.py`` (the same cases, pinned ring, device destinations)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

import mcore_zoo
from mcore_zoo.errors import CheckpointFormatError
from mcore_zoo.weights import staging
from mcore_zoo.weights.io import HFCheckpoint
from mcore_zoo.testing.common import same_bits
from mcore_zoo.weights.staging import StagingRing


def staged_state() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes; rows wider and narrower than the small test ring's buffers."""
    gen = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(40, 1000, generator=gen),  # 4000-byte rows: one row per 4 KiB buffer
        "wide": torch.randn(4, 3000, generator=gen).bfloat16(),  # a row larger than a buffer
        "half": torch.randn(6, 512, generator=gen).half(),
        "vector": torch.randn(5000, generator=gen).bfloat16(),
        "small": torch.randn(2, 256, generator=gen),  # 512-byte column chunks: staged
    }  # fmt: skip


def check_staged_reads(directory: Path, device: str, ring: StagingRing) -> None:
    """Every chunk (whole, row and column TP chunks, a ``select`` range) into every destination
    layout (contiguous, rows apart, another shape with rows apart, transposed) and dtype (the
    file's, wider, narrower), read through ``ring`` onto ``device``, equals the reference path's
    read of the same chunk on the CPU bitwise."""
    state = staged_state()
    save_file(state, str(directory / "model.safetensors"))
    with HFCheckpoint(directory) as plain, HFCheckpoint(directory, staging=ring) as staged:
        for name, t in state.items():
            for axis in range(t.dim()):
                for rank in range(2):
                    want = plain.read(name, axis=axis, rank=rank, size=2)
                    before = ring.bytes_staged
                    got = torch.full(want.shape, 7, dtype=t.dtype, device=device)
                    staged.read_into(name, got, axis=axis, rank=rank, size=2)
                    assert same_bits(got.cpu(), want), (name, axis, rank)
                    assert ring.bytes_staged - before == want.numel() * want.element_size()
                    for dtype in (torch.float64, torch.bfloat16, torch.float16):
                        cast = torch.empty(want.shape, dtype=dtype, device=device)
                        staged.read_into(name, cast, axis=axis, rank=rank, size=2)
                        reference = torch.empty(want.shape, dtype=dtype)
                        plain.read_into(name, reference, axis=axis, rank=rank, size=2)  # the mapping path's cast
                        assert same_bits(cast.cpu(), reference), (name, axis, rank, dtype)
                    holes = torch.zeros(want.shape[0] * 2, *want.shape[1:], dtype=t.dtype, device=device)
                    grouped = torch.zeros(want.numel() // want.shape[-1], want.shape[-1] + 3, dtype=t.dtype, device=device)
                    flipped = tuple(reversed(range(want.dim())))
                    transposed = torch.zeros(want.shape[::-1], dtype=t.dtype, device=device).permute(*flipped)
                    with staged.queued_reads():
                        staged.read_into(name, holes[1::2], axis=axis, rank=rank, size=2)
                        staged.read_into(name, grouped[:, 1:-2], axis=axis, rank=rank, size=2)
                        staged.read_into(name, transposed, axis=axis, rank=rank, size=2)
                    assert same_bits(holes[1::2].cpu(), want) and not holes[0::2].any()
                    assert same_bits(grouped[:, 1:-2].reshape(want.shape).cpu(), want)
                    assert not grouped[:, :1].any() and not grouped[:, -2:].any()
                    assert same_bits(transposed.cpu(), want)
        part = torch.empty(8, 1000, device=device)
        staged.read_into("rows", part, axis=0, rank=1, size=2, select=(0, 4, 20))
        assert same_bits(part.cpu(), state["rows"][4:20].chunk(2)[1])


def test_staged_reads_copied_through_torch_equal_the_reference_path_bitwise(tmp_path, monkeypatch):
    """Small buffers: tensors span many buffers and rows span several pieces; regions of a buffer
    are reused only once the ring has come round. Every region copied through torch
    (``RAW_COPIES`` off): no raw copy made."""
    monkeypatch.setattr(staging, "RAW_COPIES", False)
    monkeypatch.setattr(staging, "_host_memmove", lambda *args: pytest.fail("a raw copy with RAW_COPIES off"))
    check_staged_reads(tmp_path, "cpu", StagingRing(3, 4096, pin=False, cpu_destinations=True))


def test_raw_copies_are_the_default_and_equal_the_reference_path_bitwise(tmp_path, monkeypatch):
    """``RAW_COPIES`` (on by default): regions whose destination is contiguous and of the file's
    dtype are copied by their bytes (on the CPU ring ``ctypes.memmove``, on CUDA
    ``cudaMemcpyAsync``), the others (casts, strided destinations, whole rows cut) through torch -
    the same bits as the reference path, and raw copies were made."""
    assert staging.RAW_COPIES is True
    copied = []
    memmove = staging._host_memmove
    monkeypatch.setattr(staging, "_host_memmove", lambda *args: copied.append(args[2]) or memmove(*args))
    check_staged_reads(tmp_path, "cpu", StagingRing(3, 4096, pin=False, cpu_destinations=True))
    assert len(copied) > 10 and all(n > 0 for n in copied)


def test_a_failed_raw_copy_raises(tmp_path, monkeypatch):
    save_file({"w": torch.ones(4, 8)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(staging, "RAW_COPIES", True)
    monkeypatch.setattr(staging, "_host_memmove", lambda *args: 700)
    with HFCheckpoint(tmp_path, staging=StagingRing(2, 4096, pin=False, cpu_destinations=True)) as ckpt:
        with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of a staged region \(128 bytes into \(4, 8\)\) failed: cudaError_t 700"):
            ckpt.read_into("w", torch.empty(4, 8))


def test_the_ring_packs_small_tensors_and_refuses_what_it_cannot_stage(tmp_path, monkeypatch):
    state = {**staged_state(), "narrow": torch.randn(2, 16)}
    save_file(state, str(tmp_path / "model.safetensors"))
    ring = StagingRing(2, 1 << 20, pin=False, cpu_destinations=True)
    with HFCheckpoint(tmp_path, staging=ring) as ckpt:
        with ckpt.queued_reads():
            small = [torch.empty(2, 256) for _ in range(5)]
            for out in small:
                ckpt.read_into("small", out)
            assert ring._current == 0 and ring._used == 5 * 2048  # one buffer, five regions
        assert all(same_bits(out, state["small"]) for out in small)
        assert ring._ring == []  # handed back when the block exits
        before = ring.bytes_staged
        narrow = torch.empty(2, 2)
        ckpt.read_into("narrow", narrow, axis=1, rank=0, size=8)  # 8-byte runs 64 bytes apart: the mapping path
        assert ring.bytes_staged == before and same_bits(narrow, state["narrow"][:, :2])
        monkeypatch.setattr(staging, "MIN_RUN_BYTES", 0)
        ckpt.read_into("narrow", narrow, axis=1, rank=1, size=8)
        assert ring.bytes_staged == before + narrow.numel() * 4 and same_bits(narrow, state["narrow"][:, 2:4])
        with pytest.raises(RuntimeError, match="single memory location"):  # shared elements: torch refuses
            ckpt.read_into("rows", torch.empty(1, 1000).expand(20, 1000), axis=0, rank=0, size=2)
    default = StagingRing()
    assert not default.accepts(torch.empty(4), (4,), (1,), 4)  # CPU destinations: positional reads
    with pytest.raises(ValueError):
        StagingRing(1, 4096)
    # the mapping path's ring takes nothing a staging ring takes, and a read through it is the same
    mapping = staging.MappingPath(2, 1 << 20, pin=False, cpu_destinations=True)
    chunk = (torch.empty(2, 256), (2, 256), (256, 1), 4)
    assert ring.accepts(*chunk) and not mapping.accepts(*chunk)
    with HFCheckpoint(tmp_path, staging=mapping) as ckpt:
        out = torch.empty(2, 256)
        ckpt.read_into("small", out)
    assert mapping.bytes_staged == 0 and same_bits(out, state["small"])


def test_a_staged_read_of_a_truncated_file_names_the_tensor(tmp_path):
    save_file({"w": torch.randn(64, 1024)}, str(tmp_path / "model.safetensors"))
    ring = StagingRing(2, 64 << 10, pin=False, cpu_destinations=True)
    with HFCheckpoint(tmp_path, staging=ring) as ckpt:
        with open(tmp_path / "model.safetensors", "r+b") as f:
            f.truncate(4096)
        with pytest.raises(CheckpointFormatError, match="'w'.*end of file"), ckpt.queued_reads():
            ckpt.read_into("w", torch.empty(64, 1024))
        assert ring._ring == []


def test_small_tensors_of_one_file_are_read_in_batches_and_a_failed_batch_names_its_tensor(tmp_path, monkeypatch):
    """Consecutive regions of one file go to the read threads together (one submission for several
    small tensors, up to ``BATCH_BYTES``), land where each belongs, and when a batch's read fails
    the error names the tensor whose bytes are missing - not the first tensor of the batch."""
    gen = torch.Generator().manual_seed(3)
    state = {f"expert{i:02d}": torch.randn(16, 64, generator=gen) for i in range(24)}  # 4 KiB each
    save_file(state, str(tmp_path / "model.safetensors"))
    ring = StagingRing(4, 64 << 10, pin=False, cpu_destinations=True)  # batches of up to 16 KiB
    submits = []
    with HFCheckpoint(tmp_path, staging=ring) as ckpt:
        real = ckpt._reader.submit
        monkeypatch.setattr(ckpt._reader, "submit", lambda *a, **k: submits.append(1) or real(*a, **k))
        outs = {name: torch.empty(16, 64) for name in state}
        with ckpt.queued_reads():
            for name, out in outs.items():
                ckpt.read_into(name, out)
    assert all(same_bits(outs[n], state[n]) for n in state)
    assert len(submits) == 6  # 24 regions of 4 KiB in batches of 16 KiB
    names = sorted(state)
    with HFCheckpoint(tmp_path, staging=ring) as ckpt:
        with open(tmp_path / "model.safetensors", "r+b") as f:  # the last two tensors' bytes are gone
            f.truncate(ckpt.entry(names[22]).offset + 100)
        with pytest.raises(CheckpointFormatError, match=f"'{names[22]}'.*end of file"), ckpt.queued_reads():
            for name in names:
                ckpt.read_into(name, torch.empty(16, 64))
    assert ring._ring == []


def test_a_load_through_the_ring_equals_the_default_load(mpu, reference_checkpoint: Callable[..., Path]):
    """``load_hf_weights`` through an unpinned ring of small buffers (every parameter with direct
    views staged; fused ones as before) gives the default load's parameters bitwise."""
    ckpt = reference_checkpoint("LlamaForCausalLM")
    reference = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    model = mcore_zoo.build_model(ckpt, backend="local")
    ring = StagingRing(3, 8192, pin=False, cpu_destinations=True)
    with HFCheckpoint(ckpt, staging=ring) as source:
        report = mcore_zoo.load_hf_weights(model, source)
    assert ring.bytes_staged > 0 and report.bytes_read >= ring.bytes_staged
    want = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert same_bits(param.detach(), want[name].detach()), name


def test_a_load_makes_every_read_view_before_its_first_read(mpu, reference_checkpoint: Callable[..., Path], monkeypatch):
    """``load_hf_weights`` makes the views its parameters' sources are read into (QKV groups, gate
    and up halves: ``rule_views``) for every parameter before the first read is queued - making a
    view releases the interpreter lock, which the read threads hold while reads run - and the load
    equals the default one bitwise."""
    from mcore_zoo.weights import load as weights_load

    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    reference = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    model = mcore_zoo.build_model(ckpt, backend="local")
    ring = StagingRing(3, 8192, pin=False, cpu_destinations=True)
    with HFCheckpoint(ckpt, staging=ring) as source:
        made: list[bool] = []  # per view made: whether reads were being queued then
        views = weights_load.rule_views
        monkeypatch.setattr(weights_load, "rule_views", lambda *a: made.append(source._reader.queuing) or views(*a))
        monkeypatch.setattr("mcore_zoo.distributed.load.rule_views", weights_load.rule_views)
        mcore_zoo.load_hf_weights(model, source)
    assert made and not any(made)
    want = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert same_bits(param.detach(), want[name].detach()), name


def test_a_load_runs_with_the_cyclic_collector_paused(mpu, reference_checkpoint: Callable[..., Path]):
    """``load_hf_weights`` pauses Python's cyclic garbage collector while it plans and reads (a full
    collection inside a load walks every object of the process with the interpreter lock held)
    and switches it back on after - also when the load raises - and leaves it off when it was off."""
    import gc

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local")
    seen: list[bool] = []
    real = HFCheckpoint.read_into

    def read_into(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return real(self, *args, **kwargs)

    assert gc.isenabled()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HFCheckpoint, "read_into", read_into)
        mcore_zoo.load_hf_weights(model, ckpt)
        assert seen and not any(seen) and gc.isenabled()

        def failing(self, *args, **kwargs):
            raise OSError("unreadable")

        patch.setattr(HFCheckpoint, "read_into", failing)
        with pytest.raises(OSError, match="unreadable"):
            mcore_zoo.load_hf_weights(model, ckpt)
        assert gc.isenabled()
        gc.disable()
        try:
            patch.setattr(HFCheckpoint, "read_into", read_into)
            mcore_zoo.load_hf_weights(model, ckpt)
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_column_chunks_of_narrow_rows_are_read_as_whole_rows(tmp_path):
    """A TP column chunk of narrow rows (a row-parallel weight's shard) is read as whole rows, one
    contiguous read per region, and cut after: the same bytes land as on the reference path; a wide
    spacing (more than ``ROWS_SPAN`` run lengths) keeps one read per run (or the mapping path for
    runs shorter than ``MIN_RUN_BYTES``)."""
    gen = torch.Generator().manual_seed(1)
    state = {"o_proj": torch.randn(96, 512, generator=gen).bfloat16(), "down": torch.randn(64, 2048, generator=gen)}
    save_file(state, str(tmp_path / "model.safetensors"))
    ring = StagingRing(3, 16 << 10, pin=False, cpu_destinations=True)
    with HFCheckpoint(tmp_path) as plain, HFCheckpoint(tmp_path, staging=ring) as staged:
        for name, size in (("o_proj", 2), ("o_proj", 4), ("down", 2)):
            for rank in range(size):
                want = plain.read(name, axis=1, rank=rank, size=size)
                run_bytes = want.shape[1] * want.element_size()
                spacing = state[name].shape[1] * state[name].element_size()
                per_region = (16 << 10) // spacing
                regions = -(-want.shape[0] // per_region)
                whole_rows = want.shape[0] * spacing - regions * (spacing - run_bytes)
                for out in (torch.empty(want.shape, dtype=want.dtype), torch.empty(want.shape, dtype=torch.float32),
                            torch.zeros(want.shape[0], want.shape[1] + 8, dtype=want.dtype)[:, 4:-4]):  # fmt: skip
                    read_before, staged_before = ring.bytes_read, ring.bytes_staged
                    staged.read_into(name, out, axis=1, rank=rank, size=size)
                    assert torch.equal(out, want.to(out.dtype)), (name, size, rank)
                    if out.dtype != want.dtype:
                        continue  # a cast is checked for its values only (the checkpoint may read it another way)
                    assert ring.bytes_staged - staged_before == want.numel() * want.element_size()
                    assert ring.bytes_read - read_before == whole_rows, (name, size, rank)  # rows read whole
        want = plain.read("o_proj", axis=1, rank=3, size=8)  # 128-byte runs 8 run lengths apart: not whole rows
        before = ring.bytes_read
        out = torch.empty(want.shape, dtype=want.dtype)
        staged.read_into("o_proj", out, axis=1, rank=3, size=8)
        assert torch.equal(out, want) and ring.bytes_read == before  # (runs this short: the mapping path)
        want = plain.read("down", axis=1, rank=5, size=8)  # 1 KiB runs 8 run lengths apart: one read per run
        out = torch.empty(want.shape, dtype=want.dtype)
        staged.read_into("down", out, axis=1, rank=5, size=8)
        assert torch.equal(out, want) and ring.bytes_read - before == want.numel() * want.element_size()
        want = plain.read("o_proj", axis=1, rank=1, size=2)
        transposed = torch.empty(want.shape[::-1], dtype=want.dtype).t()  # any strides: the cut is copied into it
        staged.read_into("o_proj", transposed, axis=1, rank=1, size=2)
        assert torch.equal(transposed, want)


def _merged(segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``segments`` with file- and memory-adjacent neighbours joined: the bytes they move."""
    out: list[tuple[int, int, int]] = []
    for offset, address, n in segments:
        if out and out[-1][0] + out[-1][2] == offset and out[-1][1] + out[-1][2] == address:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((offset, address, n))
    return out


def test_the_one_run_layout_reads_what_the_general_layout_reads():
    """A chunk of one contiguous file run (a whole tensor, whole rows, one expert of a stacked
    tensor) takes a shortcut - one run, one read per region - that must plan the same bytes as the
    general run arithmetic (``pread._runs`` / ``_starts``), for every box of a small 3-D tensor."""
    from mcore_zoo.weights import pread
    from mcore_zoo.weights.io import _box_layout

    full, itemsize = (3, 4, 5), 2
    ring = StagingRing(2, 4096, pin=False, cpu_destinations=True)
    ranges = [[(lo, hi) for lo in range(n) for hi in range(lo + 1, n + 1)] for n in full]
    shortcut = 0
    for box in itertools.product(*ranges):
        shape, strides, first, last = _box_layout(full, box)
        assert strides == [20, 5, 1] and first == sum(lo * st for (lo, _), st in zip(box, strides))
        assert last == sum((hi - 1) * st for (_, hi), st in zip(box, strides))
        one = staging._one_run(shape, strides)
        layout = ring.layout(torch.empty(shape, dtype=torch.bfloat16), shape, strides, itemsize)
        runs = pread._runs(shape, strides)
        if runs is None:  # a strided innermost dimension: the mapping path
            assert not one and layout is None, box
            continue
        run, outer_shape, outer_strides = runs
        starts = pread._starts(outer_shape, outer_strides, 0, itemsize)
        assert one == (len(starts) == 1), box
        if layout is None:  # short runs: the mapping path
            assert not one and run * itemsize < staging.MIN_RUN_BYTES
            continue
        if layout.rows is None:
            assert (layout.run, layout.starts) == (run, starts), box
        shortcut += one
        total = math.prod(shape)
        for first_element in range(0, total, 7):  # a region's elements from any element on
            count = min(7, total - first_element)
            got = staging._segments(layout.run, layout.starts, itemsize, first_element, count, 1 << 20, 100)
            if one:  # the general arithmetic, one run per innermost row
                general = staging._segments(shape[-1], [k * itemsize for k in range(0, total, shape[-1])], itemsize,
                                            first_element, count, 1 << 20, 100)  # fmt: skip
                assert len(got) == 1
            else:
                general = staging._segments(run, starts, itemsize, first_element, count, 1 << 20, 100)
            assert _merged(got) == _merged(general), (box, first_element)
    assert shortcut > 20


def test_stacked_expert_slices_read_through_the_ring_bitwise(tmp_path):
    """One expert's slice of a stacked ``[experts, rows, cols]`` tensor (a ``select`` of the
    leading axis: one run), whole and TP-chunked by rows (one run) or columns (many), into
    contiguous, strided and casting destinations, including slices larger than a buffer (several
    regions) and many slices queued together (batched reads, copies of a batch together): the
    same bytes as the reference path."""
    gen = torch.Generator().manual_seed(4)
    state = {"experts": torch.randn(6, 48, 80, generator=gen).bfloat16()}
    save_file(state, str(tmp_path / "model.safetensors"))
    ring = StagingRing(3, 8192, pin=False, cpu_destinations=True)  # a slice (7680 bytes) nearly fills a buffer
    reads = [dict(select=(0, e, e + 1)) for e in range(6)]
    reads += [dict(select=(0, e, e + 1), axis=a, rank=r, size=2) for e in (0, 5) for a in (1, 2) for r in (0, 1)]
    with HFCheckpoint(tmp_path) as plain, HFCheckpoint(tmp_path, staging=ring) as staged:
        wants = [plain.read("experts", **kw) for kw in reads]
        outs = []
        with staged.queued_reads():
            for kw, want in zip(reads, wants):
                contiguous = torch.full(want.shape[1:], 7, dtype=want.dtype)
                holes = torch.zeros(want.shape[1] * 2, want.shape[2], dtype=want.dtype)
                cast = torch.empty(want.shape, dtype=torch.float32)
                for out in (contiguous, holes[1::2], cast):
                    staged.read_into("experts", out, **kw)
                outs.append((contiguous, holes, cast))
        for want, (contiguous, holes, cast) in zip(wants, outs):
            assert same_bits(contiguous, want[0]) and same_bits(holes[1::2], want[0]) and not holes[0::2].any()
            assert torch.equal(cast, want.float())
        big = torch.empty(3, 48, 80, dtype=torch.bfloat16)  # 23 KiB: three buffers' worth of regions
        staged.read_into("experts", big, select=(0, 2, 5))
        assert same_bits(big, state["experts"][2:5])


def test_run_starts_of_one_outer_dimension_are_a_range_equal_to_the_listed_starts():
    """A row or column chunk's run starts come as a ``range`` (no list of one start per row); its
    values are the general formula's, and a layout of two outer dimensions still lists them."""
    import itertools

    from mcore_zoo.weights import pread

    def listed(shape, strides, base, scale):
        return [base + scale * sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]

    starts = pread._starts([4096], [14336], 1000, 2)
    assert isinstance(starts, range) and list(starts) == listed([4096], [14336], 1000, 2)
    assert starts[1:][0] == starts[1] and len(starts) == 4096
    assert pread._starts([3, 4], [100, 10], 8, 4) == listed([3, 4], [100, 10], 8, 4)
    assert pread._starts([], [], 8, 4) == [8]
    shard = pread._runs((4096, 7168), (14336, 1))  # a TP2 row-parallel shard of down_proj
    assert shard == (7168, [4096], [14336])


def test_the_ring_takes_the_module_defaults_when_made_and_any_in_flight_depth_reads_the_same_bytes(tmp_path, monkeypatch):
    """``StagingRing()`` reads ``BUFFERS`` / ``BUFFER_BYTES`` / ``IN_FLIGHT_BUFFERS`` when it is made
    (a bench sets them for its process), refuses an in-flight depth the ring cannot hold, and reads
    the same bytes at every depth."""
    from mcore_zoo.weights import staging

    monkeypatch.setattr(staging, "BUFFERS", 3)
    monkeypatch.setattr(staging, "BUFFER_BYTES", 8192)
    monkeypatch.setattr(staging, "IN_FLIGHT_BUFFERS", 2)
    ring = StagingRing(pin=False, cpu_destinations=True)
    assert (ring.buffers, ring.buffer_bytes, ring.in_flight_bytes) == (3, 8192, 2 * 8192)
    with pytest.raises(ValueError, match="keeps 1 to 2 of them in flight"):
        StagingRing(3, 8192, in_flight=3)
    # the default depth fits a smaller ring: all its buffers but one
    assert StagingRing(2, 8192, pin=False, cpu_destinations=True).in_flight_bytes == 8192
    for depth in (1, 2, 3):
        (tmp_path / str(depth)).mkdir()
        check_staged_reads(tmp_path / str(depth), "cpu", StagingRing(4, 4096, pin=False, cpu_destinations=True, in_flight=depth))


def test_whole_row_reads_keep_the_run_starts_a_range():
    """A column chunk read as whole rows hands its row starts on as a ``range`` shifted to the
    tensor's file offset (no list of one start per row), equal to the listed starts."""
    from mcore_zoo.weights.staging import _shifted

    starts = range(0, 4096 * 28672, 28672)
    moved = _shifted(starts, 1000)
    assert isinstance(moved, range) and list(moved) == [1000 + s for s in starts]
    assert _shifted([0, 10, 30], 5) == [5, 15, 35]


def test_the_ring_reads_on_its_own_pool_of_read_threads(tmp_path, monkeypatch):
    """The ring's reads run on ``read_threads`` threads of a pool of their own (default
    ``READ_THREADS``), whatever torch's thread count, and read the same bytes at any count."""
    import threading

    from mcore_zoo.weights import pread

    monkeypatch.setattr(staging, "READ_THREADS", 3)
    assert StagingRing(pin=False, cpu_destinations=True).read_threads == 3
    with pytest.raises(ValueError, match=">= 1 thread"):
        StagingRing(read_threads=0)
    gen = torch.Generator().manual_seed(7)
    state = {f"expert{i:02d}": torch.randn(64, 256, generator=gen) for i in range(40)}  # 64 KiB each
    save_file(state, str(tmp_path / "model.safetensors"))
    readers: set[str] = set()
    real_run = pread.ReadPool._run
    monkeypatch.setattr(pread.ReadPool, "_run", lambda self, *a, **k: readers.add(threading.current_thread().name) or real_run(self, *a, **k))
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(6)
        for threads in (1, 2):
            readers.clear()
            ring = StagingRing(4, 256 << 10, pin=False, cpu_destinations=True, read_threads=threads)  # batches of 64 KiB
            outs = {name: torch.empty(64, 256) for name in state}
            with HFCheckpoint(tmp_path, staging=ring) as ckpt, ckpt.queued_reads():
                for name, out in outs.items():
                    ckpt.read_into(name, out)
            assert all(same_bits(outs[n], state[n]) for n in state)
            assert 1 <= len(readers) <= threads and all(name.startswith(f"mcore-zoo-read{threads}") for name in readers), readers
    finally:
        torch.set_num_threads(torch_threads)


def test_regions_that_follow_each_other_go_as_one_raw_copy(tmp_path, monkeypatch):
    """Two tensors read one after the other into the two halves of one destination (an expert's
    gate and up rows into its ``linear_fc1``): one raw copy of both; into halves in the other
    order, or apart, a copy each - the same bits every time."""
    gen = torch.Generator().manual_seed(1)
    state = {"a.gate": torch.randn(4, 128, generator=gen).bfloat16(), "a.up": torch.randn(4, 128, generator=gen).bfloat16()}
    save_file(state, str(tmp_path / "model.safetensors"))
    copied = []
    memmove = staging._host_memmove
    monkeypatch.setattr(staging, "_host_memmove", lambda *args: copied.append(args[2]) or memmove(*args))
    want = torch.cat([state["a.gate"], state["a.up"]])
    for order, runs in (((0, 1), [2048]), ((1, 0), [1024, 1024])):
        copied.clear()
        out = torch.zeros(8, 128, dtype=torch.bfloat16)
        with HFCheckpoint(tmp_path, staging=StagingRing(2, 1 << 20, pin=False, cpu_destinations=True)) as ckpt:
            with ckpt.queued_reads():
                for k in order:
                    ckpt.read_into(("a.gate", "a.up")[k], out[4 * k : 4 * (k + 1)])
        assert same_bits(out, want) and copied == runs, (order, copied)
    copied.clear()
    apart = torch.zeros(9, 128, dtype=torch.bfloat16)  # a row between the halves
    with HFCheckpoint(tmp_path, staging=StagingRing(2, 1 << 20, pin=False, cpu_destinations=True)) as ckpt:
        with ckpt.queued_reads():
            ckpt.read_into("a.gate", apart[:4])
            ckpt.read_into("a.up", apart[5:])
    assert same_bits(apart[:4], state["a.gate"]) and same_bits(apart[5:], state["a.up"]) and copied == [1024, 1024]


def test_raw_runs_never_span_two_allocations():
    """Destinations that follow each other in memory but lie in two storages (two parameters the
    allocator placed side by side) are copied apart; in one storage, and from one buffer, as one."""
    from mcore_zoo.weights.staging import _Piece, _raw_runs

    class Dest:
        def __init__(self, pointer, storage):
            self.pointer, self.storage = pointer, storage

        def data_ptr(self):
            return self.pointer

        def untyped_storage(self):
            return type("Storage", (), {"data_ptr": lambda _: self.storage})()

    def piece(address, pointer, storage, buffer=0, nbytes=512):
        return _Piece([], Dest(pointer, storage), None, buffer, nbytes, None, address=address)

    one = [piece(0, 1000, 1000), piece(512, 1512, 1000)]
    two = [piece(0, 1000, 1000), piece(512, 1512, 1512)]
    buffers = [piece(0, 1000, 1000), piece(512, 1512, 1000, buffer=1)]
    assert [n for _, n in _raw_runs(one)] == [1024]
    assert [n for _, n in _raw_runs(two)] == [512, 512]
    assert [n for _, n in _raw_runs(buffers)] == [512, 512]
