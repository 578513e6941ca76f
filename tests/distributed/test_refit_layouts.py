"""Refit from TP2, PP2 and EP2 source layouts on real gloo process groups: rank 0 receives every
engine rank's shards (engine TP 2), the other rank only takes part in the gathers. The engine
tensors must equal the independent vLLM-loader emulation of ``tests/unit/test_refit.py`` bit for
bit, on the first refit (plan computed) and the second (plan reused); and with ``receiver="all"``
(every trainer rank feeds its own engine rank) on both ranks. A receiver whose engine refuses
the plan raises, and the other rank's gathers still complete."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.placement import Parallelism

from ..conftest import SharedLaunch
from ..unit.test_refit import assert_same, vllm_engine_tensors, vllm_gpt_oss_tensors


def _refit_layouts(ckpt: str, layouts: list) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.errors import ZooError
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import HF_NAMES, DictAdapter

    found: dict = {}
    for name, parallel in layouts:
        ensure_model_parallel(parallel)
        model = mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt)
        adapter = DictAdapter(tp_size=2) if dist.get_rank() == 0 else None
        runs = [mcore_zoo.refit(model, adapter, target_tp=2, bucket_size="32KB") for _ in range(2)]
        class Refusing(DictAdapter):
            def begin(self, plan):
                raise ZooError("the engine refuses")

        try:  # the receiver fails before its first tensor: the other rank's gathers must still end
            mcore_zoo.refit(model, Refusing(tp_size=2) if dist.get_rank() == 0 else None, target_tp=2, bucket_size="32KB")
            refused = None
        except ZooError as exc:
            refused = str(exc)
        every = DictAdapter(tp_size=2)  # receiver="all": one engine rank per trainer rank
        mcore_zoo.refit(model, every, receiver="all", bucket_size="32KB")
        # an engine format other than vLLM's, known only to the receiver (docs/rollout.md's pattern):
        # the other rank learns the plan from it instead of issuing other collectives
        named = DictAdapter(engine_format=HF_NAMES) if dist.get_rank() == 0 else None
        mcore_zoo.refit(model, named, bucket_size="32KB")
        try:  # a receiver without an adapter: every rank fails with its message, none waits
            mcore_zoo.refit(model, None, bucket_size="32KB")
            missing = None
        except ZooError as exc:
            missing = str(exc)
        found[name] = {
            "hf_names": named.tensors[0] if named is not None else None,
            "missing": missing,
            "planned": [r.planned for r in runs],
            "tensors": adapter.tensors if adapter is not None else None,
            "calls": adapter.calls if adapter is not None else None,
            "all": every.tensors,
            "refused": refused,
        }
        ps.destroy_model_parallel()
    return found


#: the source layouts of Qwen3-MoE
LAYOUTS = [("tp2", Parallelism(tp=2)), ("pp2", Parallelism(pp=2)), ("ep2", Parallelism(ep=2))]
#: the source layouts of gpt-oss: experts with biases at expert TP 1 in training (the engine splits
#: them itself)
GPT_OSS_LAYOUTS = [("tp2", Parallelism(tp=2, etp=1)), ("pp2", Parallelism(pp=2)), ("ep2", Parallelism(ep=2)),
                   ("tp2-ep2", Parallelism(tp=2, ep=2, etp=1))]  # fmt: skip


def _tp_local_checkpoints(reference_checkpoint) -> dict:
    """``{name: (checkpoint, build arguments)}`` of the trainer-TP-equals-engine-TP refit."""
    return {
        # the engine pads 250 to 256 (128 rows per rank), the trainer splits 125 / 125
        "llama-vocab-250": (reference_checkpoint("LlamaForCausalLM", {"vocab_size": 250, "num_hidden_layers": 2}), {}),
        # the trainer pads 384 to 512 (make_vocab_size_divisible_by), the engine splits 192 / 192:
        # a rank's padded rows are not its engine rows, though the cuts alone would fit
        "llama-vocab-384-padded": (reference_checkpoint("LlamaForCausalLM", {"vocab_size": 384, "num_hidden_layers": 2}),
                                   {"make_vocab_size_divisible_by": 128}),
        "qwen3-moe": (reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2}), {}),
        # experts whole on every rank (expert TP 1): the engine's expert TP rows are cut from them
        "qwen3-moe-etp1": (reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2}), {"etp": 1}),
        # MLA: the engine keeps fused_qkv_a_proj = [q_a; kv_a] whole on every rank (ReplicatedLinear)
        "deepseek-v3": (reference_checkpoint("DeepseekV3ForCausalLM", {"num_hidden_layers": 2}), {}),
    }  # fmt: skip


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint, mpu) -> SharedLaunch:
    """One two-rank launch for this module's tests: Qwen3-MoE and gpt-oss refit from their source
    layouts, then the trainer-TP-equals-engine-TP refits."""
    return SharedLaunch(2, lambda: {
        "qwen3-moe": (_refit_layouts, str(reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2})), LAYOUTS),
        "gpt-oss": (_refit_layouts, str(reference_checkpoint("GptOssForCausalLM", {"num_hidden_layers": 2})),
                    GPT_OSS_LAYOUTS),
        "tp-local": (_refit_tp_local, {k: (str(v), kw) for k, (v, kw) in _tp_local_checkpoints(reference_checkpoint).items()}),
    })  # fmt: skip


def test_refit_from_tp2_pp2_ep2_sources(reference_checkpoint, two_rank_runs):
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2})
    layouts = LAYOUTS
    found = two_rank_runs["qwen3-moe"]
    config = json.loads((ckpt / "config.json").read_text())
    want = vllm_engine_tensors(load_file(str(ckpt / "model.safetensors")), config, 2)
    for name, _ in layouts:
        assert found[0][name]["planned"] == [True, False], name
        assert found[1][name]["tensors"] is None
        assert found[0][name]["calls"].count("end") == 2
        assert_same(found[0][name]["tensors"], want)
        assert_same(found[0][name]["all"], want)
        assert_same(found[1][name]["all"], want)
        assert found[0][name]["refused"] == "the engine refuses" and found[1][name]["refused"] is None
        source = load_file(str(ckpt / "model.safetensors"))
        got = found[0][name]["hf_names"]
        assert set(got) == set(source) and all(torch.equal(got[k], source[k]) for k in source), name
        assert all("rank 0 receives but has no engine adapter" in found[r][name]["missing"] for r in (0, 1))


def test_gpt_oss_refit_from_tp2_pp2_ep2_sources(reference_checkpoint, two_rank_runs):
    """gpt-oss's stacked experts (one HF tensor from one parameter per expert, gathered over TP / EP
    and stacked by the export) land in vLLM's ``gpt_oss.py`` layout at engine TP 2 from every
    source layout; ``receiver="all"`` takes the export stream too (no rank holds a stacked tensor)."""
    ckpt = reference_checkpoint("GptOssForCausalLM", {"num_hidden_layers": 2})
    layouts = GPT_OSS_LAYOUTS
    found = two_rank_runs["gpt-oss"]
    config = json.loads((ckpt / "config.json").read_text())
    source = load_file(str(ckpt / "model.safetensors"))
    want = vllm_gpt_oss_tensors(source, config, 2)
    for name, _ in layouts:
        assert found[0][name]["planned"] == [True, False], name
        assert_same(found[0][name]["tensors"], want)
        assert_same(found[0][name]["all"], want)
        assert_same(found[1][name]["all"], want)
        got = found[0][name]["hf_names"]
        assert set(got) == set(source) and all(torch.equal(got[k], source[k]) for k in source), name


def _refit_tp_local(ckpts: dict) -> dict:
    """Each rank feeds its own engine rank and says so (``engine_rank``): trainer TP2 into engine
    TP2 cuts each rank's shards from its own TP chunks. Also: one rank's adapter without
    ``engine_rank`` puts both ranks on the gathered export (the vote)."""
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import VLLM_EP, DictAdapter
    from mcore_zoo.rollout.vllm import VLLMAdapter

    from ..unit.test_refit import FakeLLM, FakeWorker

    rank = dist.get_rank()
    found: dict = {}
    for name, (ckpt, build) in ckpts.items():
        build = dict(build)
        parallel = Parallelism(tp=2, etp=build.pop("etp", None))
        ensure_model_parallel(parallel)
        model = mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt, **build)
        mine = DictAdapter(tp_size=2, engine_rank=rank)
        runs = [mcore_zoo.refit(model, mine, receiver="all", bucket_size="32KB") for _ in range(2)]
        program = next(iter(model_programs(model).values()))
        gathered = sorted(p.step.bound.mcore for p in program._params if p.gathered)
        # the vLLM adapter (direct mode: raw shards, views of the chunks) into this rank's worker
        want = vllm_engine_tensors(load_file(str(Path(ckpt) / "model.safetensors")),
                                   json.loads((Path(ckpt) / "config.json").read_text()), 2)  # fmt: skip
        worker = FakeWorker({k: torch.zeros_like(v) for k, v in want[rank].items()}, rank)
        raw = VLLMAdapter(FakeLLM([worker]), tp_size=2, transport="inproc", engine_rank=rank)
        raw_runs = [mcore_zoo.refit(model, raw, receiver="all", bucket_size="32KB") for _ in range(2)]
        mixed = DictAdapter(tp_size=2, engine_rank=rank if rank == 0 else None)
        voted = mcore_zoo.refit(model, mixed, receiver="all", bucket_size="32KB")
        found[name] = {"sources": [r.source for r in runs + raw_runs], "tensors": mine.tensors[rank],
                       "raw": {k: p.data for k, p in worker.model_runner.model.named_parameters()},
                       "gathered": gathered, "voted": voted.source, "mixed": mixed.tensors}  # fmt: skip
        if name in EP_ENGINE_CASES:  # an engine with expert parallelism: this rank's experts whole
            want_ep = vllm_engine_tensors(load_file(str(Path(ckpt) / "model.safetensors")),
                                          json.loads((Path(ckpt) / "config.json").read_text()), 2, ep="linear")  # fmt: skip
            ep = DictAdapter(tp_size=2, engine_rank=rank, engine_format=VLLM_EP)
            ep_runs = [mcore_zoo.refit(model, ep, receiver="all", bucket_size="32KB") for _ in range(2)]
            ep_worker = FakeWorker({k: torch.zeros_like(v) for k, v in want_ep[rank].items()}, rank)
            ep_llm = FakeLLM([ep_worker], parallel={"enable_expert_parallel": True, "tensor_parallel_size": 2})
            ep_raw = VLLMAdapter(ep_llm, transport="inproc", engine_rank=rank)
            ep_runs += [mcore_zoo.refit(model, ep_raw, receiver="all", bucket_size="32KB") for _ in range(2)]
            found[name]["ep"] = {"sources": [r.source for r in ep_runs], "tensors": ep.tensors[rank],
                                 "raw": {k: p.data for k, p in ep_worker.model_runner.model.named_parameters()}}  # fmt: skip
        ps.destroy_model_parallel()
    return found


#: the trainer-TP-equals-engine-TP cases also refit into an engine with expert parallelism over
#: its TP2 (vLLM's ``enable_expert_parallel``): each rank's experts whole
EP_ENGINE_CASES = ("qwen3-moe", "qwen3-moe-etp1", "deepseek-v3")


def model_programs(model):
    from mcore_zoo.handle import handle_of

    return handle_of(model).derived("refit_programs", dict)


def test_refit_from_tp_chunks_when_trainer_tp_equals_engine_tp(reference_checkpoint, two_rank_runs):
    """Dense (vocabularies the engine pads differently: their rows are gathered) and MoE (experts
    under expert TP2 from their chunks, and whole under expert TP1): bit for bit the vLLM-loader emulation's tensors of each
    rank, on the first refit and the reused plan, through the reference adapter and through the vLLM
    worker extension (raw shards: views of the chunks)."""
    import torch

    ckpts = _tp_local_checkpoints(reference_checkpoint)
    found = two_rank_runs["tp-local"]
    for name, (ckpt, _) in ckpts.items():
        config = json.loads((ckpt / "config.json").read_text())
        want = vllm_engine_tensors(load_file(str(ckpt / "model.safetensors")), config, 2)
        for rank in (0, 1):
            got = found[rank][name]
            assert got["sources"] == ["tp-local"] * 4, (name, rank)
            assert got["voted"] == "stream", (name, rank)  # rank 1 named no engine rank
            for key in ("tensors", "raw"):
                assert sorted(got[key]) == sorted(want[rank]), (name, rank, key)
                for tensor, ref in ((got[key][t], want[rank][t]) for t in want[rank]):
                    assert torch.equal(tensor, ref), (name, rank, key)
        if name in EP_ENGINE_CASES:  # into an expert-parallel engine: experts whole on their rank
            want_ep = vllm_engine_tensors(load_file(str(ckpt / "model.safetensors")), config, 2, ep="linear")
            for rank in (0, 1):
                got = found[rank][name]["ep"]
                assert got["sources"] == ["tp-local"] * 4, (name, rank, got["sources"])
                for key in ("tensors", "raw"):
                    assert sorted(got[key]) == sorted(want_ep[rank]), (name, rank, key)
                    for t in want_ep[rank]:
                        assert torch.equal(got[key][t], want_ep[rank][t]), (name, rank, key, t)
        vocab_rules = {"embedding.word_embeddings.weight", "output_layer.weight"}
        assert set(found[0][name]["gathered"]) == set(found[1][name]["gathered"])
        if name.startswith("llama-vocab"):
            assert vocab_rules <= set(found[0][name]["gathered"]), found[0][name]["gathered"]
        assert not [g for g in found[0][name]["gathered"] if "linear_qkv" in g or "linear_fc" in g or "experts" in g]
        # the vote: rank 0 fed engine rank 0 only, from the gathered export; rank 1 fed both
        assert set(found[0][name]["mixed"][0]) == set(want[0]) and not found[0][name]["mixed"][1]
        assert_same(found[1][name]["mixed"], want)
