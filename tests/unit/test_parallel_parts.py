"""The pieces of the parallel layouts that run in one process: context-parallel splitting,
micro-batching, chunked reads into strided destinations, transform views, layout errors before any
IO, target-TP export splits, and the streaming distributed-checkpoint writer / reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mcore_zoo
from mcore_zoo.placement import Parallelism
from mcore_zoo.errors import LayoutError, ZooError
from mcore_zoo.packing import pack_sequences, zigzag_index

from ..conftest import random_sequences


# ---------------------------------------------------------------------------- context parallel
@pytest.mark.parametrize("cp", [2, 3])
def test_zigzag_split_is_balanced_and_merges_back(cp):
    batch = pack_sequences(random_sequences([5, 31, 12], 100), align=2 * cp)
    bounds = batch.cu_seqlens_padded.tolist()
    parts = [batch.context_parallel_index(r, cp) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(batch.total))
    for r, index in enumerate(parts):
        assert index.numel() == batch.total // cp
        for i, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            chunk = (stop - start) // (2 * cp)
            local = index[start // cp : stop // cp]  # this sequence's rows on rank r
            assert local.tolist() == list(range(start + r * chunk, start + (r + 1) * chunk)) + list(
                range(start + (2 * cp - 1 - r) * chunk, start + (2 * cp - r) * chunk)
            ), (r, i)
    ids = [batch.context_parallel_shard(r, cp)[0][0] for r in range(cp)]
    assert torch.equal(batch.merge_context_parallel(ids), batch.input_ids[0])
    positions = torch.cat([batch.context_parallel_shard(r, cp)[1][0] for r in range(cp)])
    assert sorted(positions.tolist()) == sorted(batch.position_ids[0].tolist())  # kept, not renumbered


def test_zigzag_refuses_slots_that_do_not_split():
    batch = pack_sequences(random_sequences([5, 7], 100), align=2)
    with pytest.raises(ZooError, match="2\\*cp=4"):
        zigzag_index(batch.cu_seqlens_padded, 0, 2)


def test_microbatch_split():
    from mcore_zoo.distributed.forward import split_microbatches

    assert split_microbatches([10, 10, 10, 10], 2, None) == [[0, 1], [2, 3]]
    assert split_microbatches([5, 1, 1, 1], 3, None) == [[0], [1], [2, 3]]
    assert split_microbatches([3], 4, None) == [[0]]
    assert split_microbatches([4, 4, 9, 1], None, 8) == [[0, 1], [2], [3]]


def test_one_planner_for_forward_and_training():
    """The forward's and the training step's micro-batches come from one planner, with one
    contract: at least ``count`` groups, each within the budget unless it is one long sequence."""
    from mcore_zoo.distributed.forward import partition_by_tokens, split_microbatches
    from mcore_zoo.distributed.microbatches import plan_microbatches

    lengths = [40, 9, 23, 5, 17, 12, 30, 2]
    for count, budget in ((None, None), (3, None), (None, 48), (4, 48), (None, 20)):
        for keep_order in (True, False):
            groups = plan_microbatches(lengths, count=count, max_tokens=budget, keep_order=keep_order)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            assert len(groups) >= min(count or 1, len(lengths))
            assert all(len(g) == 1 or sum(lengths[i] for i in g) <= (budget or sum(lengths)) for g in groups)
            if keep_order:
                assert [i for g in groups for i in g] == list(range(len(lengths)))  # contiguous runs
        assert split_microbatches(lengths, count, budget) == plan_microbatches(lengths, count=count, max_tokens=budget, keep_order=True)
        assert partition_by_tokens(lengths, budget, count) == plan_microbatches(lengths, count=count, max_tokens=budget)
    assert plan_microbatches([5, 5, 5, 5], count=2, max_tokens=5, keep_order=True) == [[0], [1], [2], [3]]
    assert plan_microbatches([]) == []


def test_vocab_parallel_logprobs_single_rank_is_log_softmax():
    from mcore_zoo.distributed.forward import vocab_parallel_logprobs
    from mcore_zoo.placement import Placement
    from mcore_zoo.packing import next_token_logprobs

    logits = torch.randn(7, 50)
    tokens = torch.randint(0, 50, (7,))
    labels = torch.cat([tokens[1:], torch.tensor([-1])])
    got = vocab_parallel_logprobs(logits, labels, Placement.single())
    assert torch.allclose(got[:-1], next_token_logprobs(logits, tokens), rtol=0, atol=1e-6) and got[-1] == 0


# ---------------------------------------------------------------------------- reads
def test_read_into_strided_views_and_other_dtypes(tmp_path):
    from mcore_zoo.weights.io import HFCheckpoint

    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(12, 10, generator=gen), "b": torch.randn(6, 4, 8, generator=gen).bfloat16()}
    save_file(state, str(tmp_path / "model.safetensors"))
    with HFCheckpoint(tmp_path) as ckpt:
        for name, t in state.items():
            for axis in range(t.dim()):
                for rank in range(2):
                    want = t.chunk(2, axis)[rank]
                    assert torch.equal(ckpt.read(name, axis=axis, rank=rank, size=2), want)
                    holes = torch.zeros(want.shape[0] * 2, *want.shape[1:], dtype=t.dtype)
                    ckpt.read_into(name, holes[1::2], axis=axis, rank=rank, size=2)  # strided destination
                    assert torch.equal(holes[1::2], want) and not holes[0::2].any()
                    wide = torch.empty(want.shape, dtype=torch.float64)
                    ckpt.read_into(name, wide, axis=axis, rank=rank, size=2)  # cast on the way
                    assert torch.equal(wide, want.double())
        assert torch.equal(ckpt.read("w", axis=0, rank=1, size=2, select=(0, 2, 10)), state["w"][2:10].chunk(2)[1])
        with pytest.raises(mcore_zoo.ShapeMismatchError):
            ckpt.read_into("w", torch.empty(5, 10), axis=0, rank=0, size=2)


@pytest.mark.parametrize("threads", [1, 3])
def test_positional_reads_match_the_mapping_path(tmp_path, monkeypatch, threads):
    """Every chunk / destination layout the positional reads take (forced down to one-element
    runs, split over threads) gives what the mapping path gives; layouts they cannot express (a
    transposed destination, a cast) take the mapping path."""
    from mcore_zoo.weights import pread
    from mcore_zoo.weights.io import HFCheckpoint

    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(24, 10, generator=gen), "b": torch.randn(6, 4, 8, generator=gen).bfloat16(),
             "odd": torch.randn(7, 3, generator=gen).half()}  # fmt: skip
    save_file(state, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(pread, "MIN_RUN", 0)
    monkeypatch.setattr(pread, "SPLIT_MIN", 64)
    monkeypatch.setattr(pread, "SPLIT_ALIGN", 8)  # splits land inside these small tensors
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    taken = []
    plan = pread.plan_segments
    monkeypatch.setattr(pread, "plan_segments", lambda *a: taken.append(plan(*a) is not None) or plan(*a))
    with HFCheckpoint(tmp_path) as ckpt:
        for name, t in state.items():
            for axis in range(t.dim()):
                size = 2 if t.shape[axis] % 2 == 0 else 1
                for rank in range(size):
                    want = t.chunk(size, axis)[rank]
                    taken.clear()
                    got = ckpt.read(name, axis=axis, rank=rank, size=size)
                    assert torch.equal(got, want) and taken == [True]
                    holes = torch.zeros(want.shape[0] * 2, *want.shape[1:], dtype=t.dtype)
                    ckpt.read_into(name, holes[1::2], axis=axis, rank=rank, size=size)
                    assert torch.equal(holes[1::2], want) and not holes[0::2].any()
                    grouped = torch.zeros(want.numel() // want.shape[-1], want.shape[-1] + 3, dtype=t.dtype)
                    # another shape, rows apart
                    ckpt.read_into(name, grouped[:, 1:-2], axis=axis, rank=rank, size=size)
                    assert torch.equal(grouped[:, 1:-2].reshape(want.shape), want)
                    assert not grouped[:, :1].any() and not grouped[:, -2:].any()
                    taken.clear()
                    flipped = tuple(reversed(range(want.dim())))
                    transposed = torch.empty(want.shape[::-1], dtype=t.dtype).permute(*flipped)
                    ckpt.read_into(name, transposed, axis=axis, rank=rank, size=size)
                    wide = torch.empty(want.shape, dtype=torch.float64)
                    ckpt.read_into(name, wide, axis=axis, rank=rank, size=size)
                    assert torch.equal(transposed, want) and torch.equal(wide, want.double())
                    assert taken == [False, False]  # the transposed destination, the cast
        assert ckpt.bytes_read > 0
        taken.clear()
        with pytest.raises(RuntimeError, match="single memory location"):
            ckpt.read_into("w", torch.empty(1, 10).expand(12, 10), axis=0, rank=0, size=2)
        assert taken == [False]


def test_positional_read_of_a_file_truncated_after_opening(tmp_path):
    from mcore_zoo.errors import CheckpointFormatError
    from mcore_zoo.weights.io import HFCheckpoint

    save_file({"w": torch.randn(64, 1024)}, str(tmp_path / "model.safetensors"))
    with HFCheckpoint(tmp_path) as ckpt:
        with open(tmp_path / "model.safetensors", "r+b") as f:
            f.truncate(4096)
        with pytest.raises(CheckpointFormatError, match="'w'.*end of file"):
            ckpt.read("w")


def test_queued_reads_land_when_the_block_exits_and_their_errors_name_the_tensor(tmp_path, monkeypatch):
    """Inside ``queued_reads`` a read into a destination is cut into pieces for the read threads
    (here pieces of 4 KiB, several per tensor) and the bytes are all there when the block exits;
    ``read`` still returns its tensor complete. A read that fails (the file truncated after it was
    opened) raises when the block exits, naming the tensor: no parameter is left unwritten silently.
    A destination the caller drops at once is kept alive until its reads are done."""
    from mcore_zoo.errors import CheckpointFormatError
    from mcore_zoo.weights import pread
    from mcore_zoo.weights.io import HFCheckpoint

    monkeypatch.setattr(pread, "PIECE", 4096)
    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 1024, generator=gen), "b": torch.randn(32, 512, generator=gen).bfloat16()}
    save_file(state, str(tmp_path / "model.safetensors"))
    with HFCheckpoint(tmp_path) as ckpt:
        a, b_rows = torch.empty(64, 1024), torch.zeros(64, 512, dtype=torch.bfloat16)
        with ckpt.queued_reads():
            ckpt.read_into("a", a)
            ckpt.read_into("b", b_rows[1::2])  # strided destination
            assert torch.equal(ckpt.read("b", axis=0, rank=1, size=2), state["b"][16:])
            ckpt.finish_reads()
            assert torch.equal(a, state["a"])
        assert torch.equal(b_rows[1::2], state["b"]) and not b_rows[0::2].any()
        with open(tmp_path / "model.safetensors", "r+b") as f:
            f.truncate(4096)
        with pytest.raises(CheckpointFormatError, match="'a'.*end of file"):
            with ckpt.queued_reads():
                ckpt.read_into("a", torch.empty(64, 1024))  # queued: no error yet; the destination dropped at once


def test_transform_views_place_pieces_like_fuse(mpu, reference_checkpoint):
    from mcore_zoo.handle import handle_of
    from mcore_zoo.weights.rules import GATE_UP, QKV, FuseQKV, TransformContext, direct_views

    arch = handle_of(mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local")).arch_config
    ctx = TransformContext(arch)
    hd, groups = arch.head_dim, arch.num_query_groups
    q = torch.randn(groups * arch.heads_per_group * hd, 8)
    k, v = torch.randn(groups * hd, 8), torch.randn(groups * hd, 8)
    for transform, pieces in ((QKV, [q, k, v]), (GATE_UP, [torch.randn(6, 4), torch.randn(6, 4)])):
        out = torch.full_like(transform.fuse(pieces, ctx), float("nan"))
        for view, piece in zip(direct_views(transform, out, ctx), pieces):
            view.copy_(piece.view(view.shape))
        assert torch.equal(out, transform.fuse(pieces, ctx))

    class OwnFuse(FuseQKV):  # overrides fuse only: its inherited views cannot be trusted
        def fuse(self, pieces, ctx):
            return super().fuse(pieces, ctx)

    assert direct_views(OwnFuse(), torch.empty(1), ctx) is None


# ---------------------------------------------------------------------------- bad layouts
@pytest.mark.parametrize(
    "overrides,parallel,field",
    [
        ({}, Parallelism(tp=3), "num_attention_heads=4 is not divisible by tp=3"),
        ({"num_hidden_layers": 4}, Parallelism(pp=3), "num_hidden_layers=4 is not divisible by pp\\*vpp=3\\*1"),
        ({"num_hidden_layers": 4}, Parallelism(pp=2, vpp=3), "num_hidden_layers=4 is not divisible by pp\\*vpp=2\\*3"),
        ({"vocab_size": 255}, Parallelism(tp=2), "vocab_size=255 is not divisible by tp=2"),
    ],
)
def test_layout_that_does_not_divide_the_model_fails_before_any_io(
    mpu, reference_checkpoint, monkeypatch, overrides, parallel, field
):
    from mcore_zoo.weights import io

    ckpt = reference_checkpoint("LlamaForCausalLM", overrides)

    def no_io(*args, **kwargs):
        raise AssertionError("a checkpoint was opened before the layout was checked")

    monkeypatch.setattr(io.HFCheckpoint, "__init__", no_io)
    with pytest.raises(LayoutError, match=field):
        mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt)


def test_target_tp_that_does_not_divide_is_refused_up_front(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("LlamaForCausalLM")  # 2 KV heads
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by tp=4"):
        next(mcore_zoo.iter_hf_shards(model, 4))
    source = load_file(str(ckpt / "model.safetensors"))
    for name, shards in mcore_zoo.iter_hf_shards(model, 1):
        assert len(shards) == 1 and torch.equal(shards[0], source[name])


def test_fused_hf_tensor_is_split_part_by_part():
    from mcore_zoo.distributed.export import hf_shard
    from mcore_zoo.weights.rules import BoundRule, Rule, split_rows

    q, k, v = torch.arange(8.0), torch.arange(10.0, 14.0), torch.arange(20.0, 24.0)
    rule = Rule("linear_qkv.weight", split_rows("qkv_proj.weight", [8, 4, 4]))
    bound = BoundRule(rule, rule.mcore, ("qkv_proj.weight",) * 3)
    parts = [(bound, 0), (bound, 1), (bound, 2)]
    shards = [hf_shard(torch.cat([q, k, v]), parts, rank, 2, "qkv_proj.weight") for rank in range(2)]
    assert torch.equal(shards[1], torch.cat([q[4:], k[2:], v[2:]]))


# ---------------------------------------------------------------------------- dist checkpoints
def _metadata(directory: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {k: (type(v).__name__, tuple(getattr(v, "size", ())), getattr(getattr(v, "properties", None), "dtype", None)) for k, v in md.items()}


def test_streaming_writer_matches_megatron_and_reads_back(mpu, reference_checkpoint, tmp_path):
    """The streamed checkpoint has Megatron-Core's own keys, global shapes and dtypes; Megatron's
    loader reads it into a model; the streaming reader reads a checkpoint Megatron itself saved."""
    from megatron.core import dist_checkpointing

    from mcore_zoo.dist_checkpoint import hf_to_mcore, load_mcore_checkpoint, mcore_to_hf

    ckpt = reference_checkpoint("Qwen2ForCausalLM")
    source = load_file(str(ckpt / "model.safetensors"))
    hf_to_mcore(ckpt, tmp_path / "streamed")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt)
    (tmp_path / "mcore").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "mcore"))
    # Megatron-Core 0.19's own save also lists its non-tensor ``common_state`` object among the
    # entries; the streaming writer keeps that state in common.pt (docs/mcore-compat.md)
    mcore = {k: v for k, v in _metadata(tmp_path / "mcore").items()
             if not (k.startswith("common_state/") and v[0] == "BytesStorageMetadata")}  # fmt: skip
    assert _metadata(tmp_path / "streamed") == mcore
    fresh = mcore_zoo.build_model(ckpt, backend="local")
    load_mcore_checkpoint(fresh, tmp_path / "streamed")
    assert all(torch.equal(t, source[n]) for n, t in mcore_zoo.iter_hf_weights(fresh))
    # back to HF from the checkpoint Megatron wrote (a training job's output)
    (tmp_path / "mcore" / "mcore_zoo.json").write_text((tmp_path / "streamed" / "mcore_zoo.json").read_text())
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", max_shard_size="50KB")
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_dist_checkpoint_of_another_model_is_refused(mpu, reference_checkpoint, tmp_path):
    from mcore_zoo.dist_checkpoint import hf_to_mcore, load_mcore_checkpoint

    hf_to_mcore(reference_checkpoint("LlamaForCausalLM"), tmp_path / "llama")
    qwen = reference_checkpoint("Qwen2ForCausalLM")  # has QKV biases Llama lacks
    with pytest.raises(ZooError, match="linear_qkv.bias"):
        load_mcore_checkpoint(mcore_zoo.build_model(qwen, backend="local"), tmp_path / "llama")


@pytest.mark.parametrize(
    "offsets,message",
    [
        ([[0, 16], [24, 40]], "starts at byte 24 of the data section, expected 16"),  # a hole
        ([[0, 16], [8, 24]], "starts at byte 8"),  # overlap
        ([[0, 16], [16, 30]], "do not hold F32"),  # size does not match the shape
    ],
)
def test_safetensors_header_is_validated_without_mapping_the_file(tmp_path, offsets, message):
    import struct

    from mcore_zoo.errors import CheckpointFormatError
    from mcore_zoo.weights.io import HFCheckpoint

    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": offsets[0]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": offsets[1]}}  # fmt: skip
    blob = json.dumps(header).encode()
    data = bytes(max(end for _, end in offsets))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    with pytest.raises(CheckpointFormatError, match=message):
        HFCheckpoint(tmp_path)


def test_shard_writer_output_is_read_by_safetensors(tmp_path):
    from mcore_zoo.weights.io import write_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {"x": torch.randn(3, 5, generator=gen).bfloat16(), "y": torch.arange(7), "z": torch.ones(()), "e": torch.empty(0, 4)}
    write_safetensors(tmp_path / "t.safetensors", tensors, {"producer": "test"})
    back = load_file(str(tmp_path / "t.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
