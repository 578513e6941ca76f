"""Parallel layouts on real gloo process groups: each layout's packed forward against the
single-process model and transformers, its export against the source checkpoint (bitwise), and
loading from HF files and from a distributed checkpoint written once by ``mcore-zoo convert``.

Two launches (2 and 4 ranks) run several layouts each, one after the other in the same processes,
to keep the suite fast; every check runs on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo.placement import Parallelism
from mcore_zoo.distributed import launch

from ..conftest import checkpoint_tensors, export_mismatches, random_sequences

LENGTHS = [23, 9, 40, 5, 17]
NUMERICS = "hf-exact"  # HF op order (HFRMSNorm also supports sequence parallel on the portable backend)
TOL = 1e-5  # fp32 logits; other summation orders (row-parallel reductions, CP chunked attention)


def _refusals_of_a_model_built_for_another_layout(ckpt: str, mcore_dir: str) -> list[str]:
    """A TP1 model under a TP2 parallel state: every entry point refuses before IO/collectives."""
    from megatron.core import parallel_state as ps

    from mcore_zoo.dist_checkpoint import load_mcore_checkpoint
    from mcore_zoo.errors import LayoutError
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel(Parallelism())
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS)
    ps.destroy_model_parallel()
    ensure_model_parallel(Parallelism(tp=2))
    calls = {
        "load_hf_weights": lambda: mcore_zoo.load_hf_weights(model, ckpt),
        "load_mcore_checkpoint": lambda: load_mcore_checkpoint(model, mcore_dir),
        "forward": lambda: mcore_zoo.packed_forward(model, random_sequences([5], 256)),
        "iter_hf_weights": lambda: next(mcore_zoo.iter_hf_weights(model)),
    }
    refused = []
    for name, call in calls.items():
        try:
            call()
        except LayoutError as exc:
            if "tp: model built for 1, parallel state has 2" in str(exc):
                refused.append(name)
    ps.destroy_model_parallel()
    return refused


def _run_layouts(ckpt: str, mcore_dir: str, out_dir: str, layouts: list, mismatch: bool = False) -> dict:
    """On every rank: for each layout, load / forward / export / save / reload; return findings."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.dist_checkpoint import load_mcore_checkpoint
    from mcore_zoo.parallel import ensure_model_parallel

    rank = dist.get_rank()
    source = checkpoint_tensors(ckpt)
    seqs = random_sequences(LENGTHS, 256)
    found: dict = {}
    if mismatch:
        found["refused"] = _refusals_of_a_model_built_for_another_layout(ckpt, mcore_dir)
    for name, parallel in layouts:
        r: dict = {}
        if name.startswith("trainer-"):
            model = _as_a_trainer_would(ckpt, parallel)
        else:
            ensure_model_parallel(parallel)
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel)
        report = mcore_zoo.load_hf_weights(model, ckpt)
        r["bytes_read"], r["bytes_received"] = report.bytes_read, report.bytes_received
        chunks = model if isinstance(model, list) else [model]
        for c in chunks:
            c.eval()
        if parallel.pp > 1 and ps.is_pipeline_last_stage() and chunks[-1].share_embeddings_and_output_weights:
            out_w = chunks[-1].output_layer.weight
            vocab = source["model.embed_tokens.weight"].chunk(parallel.tp)[ps.get_tensor_model_parallel_rank()]
            r["tied_output_equals_embedding"] = torch.equal(out_w, vocab)
        out = mcore_zoo.packed_forward(model, seqs)  # dispatches to distributed.forward for PP / CP
        r["logits"], r["logprobs"] = out.logits, out.logprobs
        r["cheap_logprobs"] = mcore_zoo.packed_forward(model, seqs, return_logits=False, num_microbatches=2).logprobs
        r["export"] = export_mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
        to_rank0 = dict(mcore_zoo.iter_hf_weights(model, ranks=[0], bucket_size=1))
        r["export_rank0"] = export_mismatches(to_rank0, source) if rank == 0 else sorted(to_rank0)
        shards = dict(mcore_zoo.iter_hf_shards(model, 2, target_rank=1))
        r["shards"] = [
            k for k, v in shards.items()
            if not torch.equal(v, _expected_shard(k, source[k]))
        ]  # fmt: skip
        mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, name), max_shard_size="200KB")
        fresh = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel)
        load_mcore_checkpoint(fresh, mcore_dir)
        r["from_dist_checkpoint"] = export_mismatches(dict(mcore_zoo.iter_hf_weights(fresh)), source)
        found[name] = r
        ps.destroy_model_parallel()
    return found


def _as_a_trainer_would(ckpt: str, parallel: Parallelism) -> list:
    """Megatron's parallel state initialised by the caller, chunks built from ``model_provider``
    the way Megatron's ``get_model`` does: the zoo reads the layout, it does not set it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mcore_zoo import cpu_shim

    cpu_shim.activate()  # a CPU-only process; a no-op with CUDA
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    provider = mcore_zoo.model_provider(ckpt, backend="portable", numerics=NUMERICS)
    return [
        provider(
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
        )
        for vp in range(parallel.vpp or 1)
    ]


def _expected_shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 1 of 2 of an HF tensor for an inference engine (vLLM's column / row split)."""
    if tensor.dim() == 1 and ("norm" in name):
        return tensor
    row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
    return tensor.chunk(2, dim=1 if row_parallel else 0)[1]


def _reference_logits(ckpt: Path) -> list[torch.Tensor]:
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, load=ckpt).eval()
    with torch.no_grad():
        return mcore_zoo.packed_forward(model, random_sequences(LENGTHS, 256)).logits


def _check(found: list[dict], ckpt: Path, hf, ref: list[torch.Tensor], out_dir: Path, world: int) -> dict[str, float]:
    """Assert every finding; return the largest logit difference per layout."""
    source = checkpoint_tensors(str(ckpt))
    seqs = random_sequences(LENGTHS, 256)
    with torch.no_grad():
        hf_logits = [hf(s[None]).logits[0] for s in seqs]
    worst: dict[str, float] = {}
    for name in found[0]:
        for rank in range(world):
            r = found[rank][name]
            where = f"{name} rank {rank}"
            diff = max((a - b).abs().max().item() for a, b in zip(r["logits"], ref))
            diff_hf = max((a - b).abs().max().item() for a, b in zip(r["logits"], hf_logits))
            assert diff <= TOL and diff_hf <= TOL, f"{where}: logits differ by {diff} (single process) / {diff_hf} (HF)"
            for lp, cheap, logits, seq in zip(r["logprobs"], r["cheap_logprobs"], ref, seqs):
                want = torch.log_softmax(logits[:-1].float(), -1).gather(-1, seq[1:, None]).squeeze(-1)
                assert (lp - want).abs().max() <= TOL and (cheap - want).abs().max() <= TOL, where
            assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
            assert r["export_rank0"] == [], f"{where}: ranks=[0] export: {r['export_rank0'][:5]}"
            assert r["shards"] == [], f"{where}: target-TP shards differ: {r['shards'][:5]}"
            assert r["from_dist_checkpoint"] == [], f"{where}: dist checkpoint load: {r['from_dist_checkpoint'][:5]}"
            assert r.get("tied_output_equals_embedding", True), f"{where}: tied output layer != embedding"
            worst[name] = max(worst.get(name, 0.0), diff)
        saved = checkpoint_tensors(str(out_dir / name))
        assert export_mismatches(saved, source) == [], f"{name}: save_hf_checkpoint"
    return worst


@pytest.mark.slow
def test_two_ranks_pp2_cp2_tp2sp(reference_checkpoint, hf_reference, mpu, tmp_path):
    """PP2 (tied embeddings across stages), CP2 (portable K/V all-gather; the two CP ranks are one
    data-parallel-like replica group, so the second is fed by broadcast) and TP2 + SP; first, a
    model built for TP1 is refused under a TP2 parallel state by every entry point."""
    from mcore_zoo.dist_checkpoint import hf_to_mcore

    ckpt = reference_checkpoint("Qwen2ForCausalLM", {"num_hidden_layers": 4})
    hf_to_mcore(ckpt, tmp_path / "mcore")
    layouts = [
        ("pp2", Parallelism(pp=2)),
        ("cp2", Parallelism(cp=2)),
        ("tp2sp", Parallelism(tp=2, sequence_parallel=True)),
    ]
    found = launch(_run_layouts, 2, str(ckpt), str(tmp_path / "mcore"), str(tmp_path), layouts, True)
    for rank in found:
        assert rank.pop("refused") == ["load_hf_weights", "load_mcore_checkpoint", "forward", "iter_hf_weights"]
    worst = _check(found, ckpt, hf_reference("Qwen2ForCausalLM", ckpt), _reference_logits(ckpt), tmp_path, 2)
    print("max |dlogit| vs the single-process model:", worst)
    assert found[0]["pp2"]["bytes_read"] and found[1]["pp2"]["bytes_read"]  # stages read their own halves
    assert found[0]["cp2"]["bytes_read"] and found[0]["cp2"]["bytes_received"] == 0
    assert found[1]["cp2"]["bytes_read"] == 0 and found[1]["cp2"]["bytes_received"] > 0
    total = sum(t.numel() * t.element_size() for t in checkpoint_tensors(str(ckpt)).values())
    assert found[0]["cp2"]["bytes_read"] == total  # one replica reads the checkpoint, once


@pytest.mark.slow
def test_four_ranks_tp2pp2_pp2vpp2_tp2cp2(reference_checkpoint, hf_reference, mpu, tmp_path):
    """TP2 x PP2, PP2 x VPP2 (parallel state initialised by the caller, as in a trainer; two
    data-parallel replicas: one reads, one receives) and TP2 x CP2 with sequence parallel;
    Llama 3 RoPE scaling, untied embeddings."""
    from mcore_zoo.dist_checkpoint import hf_to_mcore

    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 4})
    hf_to_mcore(ckpt, tmp_path / "mcore")
    layouts = [
        ("tp2pp2", Parallelism(tp=2, pp=2)),
        ("trainer-pp2vpp2", Parallelism(pp=2, vpp=2)),
        ("tp2cp2sp", Parallelism(tp=2, cp=2, sequence_parallel=True)),
    ]
    found = launch(_run_layouts, 4, str(ckpt), str(tmp_path / "mcore"), str(tmp_path), layouts)
    worst = _check(found, ckpt, hf_reference("LlamaForCausalLM", ckpt), _reference_logits(ckpt), tmp_path, 4)
    print("max |dlogit| vs the single-process model:", worst)
    # PP2 x VPP2 on 4 ranks: ranks 0/1 and 2/3 are data-parallel replicas (one reads, one receives)
    assert [f["trainer-pp2vpp2"]["bytes_received"] > 0 for f in found] == [False, True, False, True]
