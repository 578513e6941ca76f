"""Refit into an engine's own fused, pre-split layout (CPU).

The reference is an independent re-implementation of what vLLM 0.26's ``load_weights`` makes of an
HF checkpoint at tensor-parallel size ``tp``: its stacked-parameter and expert tables copied below
as data (``hf_to_vllm_mapper.orig_to_new_stacked`` of ``llama.py`` / ``qwen3_moe.py`` /
``qwen2_moe.py`` / ``glm4_moe.py``, ``stacked_params_mapping`` of ``deepseek_v2.py``;
``RoutedExperts.build_expert_params_mapping``), and the weight
loaders' slicing rules (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding`` padded to 64 rows with zero padding,
``RoutedExperts._load_w13`` / ``_load_w2``), applied to the HF safetensors file. It shares no
code with the zoo's rule table. A refit from the zoo-built model must reproduce those engine
tensors bit for bit.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.errors import LayoutError, ZooError
from mcore_zoo.rollout import HF_NAMES, VLLM, DictAdapter, VLLMAdapter, ZooWorkerExtension, get_engine_format, get_plan, plan_refit
from mcore_zoo.rollout.adapter import RefitBucket

# ---------------------------------------------------------------- vLLM 0.26's tables, as data
#: orig_to_new_stacked: weight_name -> (param_name, shard_id)
VLLM_STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}
#: deepseek_v2.py's stacked_params_mapping with its MLA part (no q/k/v fusion: MLA has no k_proj);
#: kv_a_proj_with_mqa joins fused_qkv_a_proj only when that parameter exists (q_lora_rank set)
VLLM_STACKED_MLA = {
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
    ".q_a_proj": (".fused_qkv_a_proj", 0),
    ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1),
    # DeepSeek sparse attention's indexer (``indexer_fused_mapping``): wk and weights_proj fused
    ".indexer.wk": (".indexer.wk_weights_proj", 0),
    ".indexer.weights_proj": (".indexer.wk_weights_proj", 1),
}
#: MergedColumnParallelLinear(disable_tp=True) of deepseek_v2.py: replicated, output sizes from the config
VLLM_REPLICATED_MERGED = {
    ".fused_qkv_a_proj": lambda c: (c["q_lora_rank"], c["kv_lora_rank"] + c["qk_rope_head_dim"]),
    ".indexer.wk_weights_proj": lambda c: (c["index_head_dim"], c["index_n_heads"]),
}
COLUMN_PARALLEL_MLA = re.compile(r".*\.(q_proj|q_b_proj|kv_b_proj)\.weight")  # ColumnParallelLinear
#: RoutedExperts.build_expert_params_mapping: per expert (shard_id, ckpt name) -> param prefix
VLLM_EXPERT_PARAM = {"w1": "experts.routed_experts.w13_", "w3": "experts.routed_experts.w13_", "w2": "experts.routed_experts.w2_"}
#: ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name per family
EXPERT_CKPT_NAMES = {"mixtral": ("w1", "w2", "w3"), "default": ("gate_proj", "down_proj", "up_proj")}
VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
ROW_PARALLEL = re.compile(r".*\.(o_proj|down_proj)\.weight")  # RowParallelLinear (input dim split)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_expert_map(experts: int, ep: int, rank: int, placement: str) -> list[int]:
    """vLLM 0.26's ``determine_expert_map``: global expert -> local index on ``rank`` (-1: not held)."""
    base, remainder = divmod(experts, ep)
    local = base + 1 if rank < remainder else base
    held = range(rank * base + min(rank, remainder), rank * base + min(rank, remainder) + local) if placement == "linear" \
        else range(rank, experts, ep)  # fmt: skip
    out = [-1] * experts
    for k, e in enumerate(held):
        out[e] = k
    return out


def vllm_engine_tensors(hf: dict[str, torch.Tensor], config: dict, tp: int, ep: str | None = None) -> list[dict[str, torch.Tensor]]:
    """What vLLM's load_weights leaves in the model's parameters on each TP rank; ``ep``: with
    ``enable_expert_parallel`` over the TP group and that ``expert_placement_strategy`` (experts whole
    on the rank holding them, FusedMoE's weight loader skipping the others)."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    gate, down, up = EXPERT_CKPT_NAMES["mixtral" if config["model_type"] == "mixtral" else "default"]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for rank in range(tp):
        params = out[rank]
        for name, w in hf.items():
            if "rotary_emb" in name or (config.get("tie_word_embeddings") and name == "lm_head.weight"):
                continue
            m = re.fullmatch(rf"(.*\.)experts\.(\d+)\.({gate}|{down}|{up})\.weight", name)
            if m:
                e = int(m.group(2))
                shard_id = {gate: "w1", down: "w2", up: "w3"}[m.group(3)]
                pname = m.group(1) + VLLM_EXPERT_PARAM[shard_id] + "weight"
                n_exp = sum(1 for k in hf if k.startswith(m.group(1) + "experts.") and k.endswith(f".{gate}.weight"))
                inter = w.shape[0] if shard_id != "w2" else w.shape[1]
                etp, erank = (1, 0) if ep else (tp, rank)  # FusedMoE: expert TP 1 under expert parallelism
                per = inter // etp
                expert_map = vllm_expert_map(n_exp, tp, rank, ep) if ep else list(range(n_exp))
                if pname not in params:
                    local = sum(k >= 0 for k in expert_map)
                    shape = (local, 2 * per, w.shape[1]) if shard_id != "w2" else (local, w.shape[0], per)
                    params[pname] = torch.full(shape, float("nan"), dtype=w.dtype)
                if expert_map[e] < 0:  # weight_loader: not this rank's expert
                    continue
                e = expert_map[e]
                if shard_id == "w2":  # _load_w2: shard_dim 1
                    params[pname][e].copy_(w.narrow(1, erank * per, per))
                else:  # _load_w13: w1 first half, w3 second half
                    half = 0 if shard_id == "w1" else per
                    params[pname][e].narrow(0, half, per).copy_(w.narrow(0, erank * per, per))
                continue
            stem, leaf = name.rsplit(".", 1)
            mla = "kv_lora_rank" in config  # deepseek_v2.py: DeepSeek-V2 / V3 / V3.2, GLM-5
            hit = next(((k, v) for k, v in (VLLM_STACKED_MLA if mla else VLLM_STACKED).items() if ("." + stem).endswith(k)), None)
            if hit is not None and hit[1][0] == ".fused_qkv_a_proj" and config.get("q_lora_rank") is None:
                hit = None  # no fused_qkv_a_proj parameter: kv_a_proj_with_mqa is a ReplicatedLinear
            if hit is not None:
                suffix, (new, shard_id) = hit
                pname = stem[: len(stem) - len(suffix) + 1] + new[1:] + "." + leaf
                if new in VLLM_REPLICATED_MERGED:  # MergedColumnParallelLinear(disable_tp=True)
                    sizes = VLLM_REPLICATED_MERGED[new](config)
                    offset, size, total = sum(sizes[:shard_id]), sizes[shard_id], sum(sizes)
                    if pname not in params:
                        params[pname] = torch.full((total, *w.shape[1:]), float("nan"), dtype=w.dtype)
                    params[pname].narrow(0, offset, size).copy_(w)
                    continue
                if shard_id in ("q", "k", "v"):  # QKVParallelLinear.weight_loader
                    q_size, kv_size = heads // tp * hd, kv // tp * hd
                    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
                    total = q_size + 2 * kv_size
                else:  # MergedColumnParallelLinear: output_sizes [I, I]
                    size = w.shape[0] // tp
                    offset, total = shard_id * size, 2 * size
                if pname not in params:
                    params[pname] = torch.full((total, *w.shape[1:]), float("nan"), dtype=w.dtype)
                params[pname].narrow(0, offset, size).copy_(w.narrow(0, rank * size, size))
                continue
            if name in VOCAB:  # VocabParallelEmbedding / ParallelLMHead
                padded = -(-w.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
                per = padded // tp
                start, stop = min(rank * per, w.shape[0]), min((rank + 1) * per, w.shape[0])
                p = torch.empty((per, *w.shape[1:]), dtype=w.dtype)
                p[: stop - start].copy_(w[start:stop])
                p[stop - start :].fill_(0)
                params[name] = p
                continue
            if mla and COLUMN_PARALLEL_MLA.fullmatch(name):
                size = w.shape[0] // tp
                params[name] = w.narrow(0, rank * size, size).clone()
                continue
            if ROW_PARALLEL.fullmatch(name):
                size = w.shape[1] // tp
                params[name] = w.narrow(1, rank * size, size).clone()
                continue
            params[name] = w.clone()  # replicated: norms, routers, biases of row-parallel layers
    return out


def assert_same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), (rank, sorted(set(g) ^ set(w)))
        for name in w:
            assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape, (rank, name, g[name].shape, w[name].shape)
            assert torch.equal(g[name], w[name]), f"rank {rank}: {name} differs"


CASES = [
    ("llama3", "LlamaForCausalLM", {}),
    ("llama-tied", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_scaling": None}),
    ("llama-bias", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("llama-vocab250", "LlamaForCausalLM", {"vocab_size": 250}),
    ("qwen2-tied", "Qwen2ForCausalLM", {}),
    ("qwen3", "Qwen3ForCausalLM", {}),
    ("qwen3-moe", "Qwen3MoeForCausalLM", {}),
    ("qwen2-moe", "Qwen2MoeForCausalLM", {}),
    ("mixtral", "MixtralForCausalLM", {}),
    ("glm4-moe", "Glm4MoeForCausalLM", {}),
    ("deepseek-v3", "DeepseekV3ForCausalLM", {}),  # q_lora_rank: fused_qkv_a_proj
    ("deepseek-v2-lite", "DeepseekV2ForCausalLM", {}),  # no q_lora_rank: q_proj, kv_a_proj_with_mqa apart
    ("deepseek-v3.2", "DeepseekV32ForCausalLM", {}),  # DSA indexer: wk_weights_proj, wq_b, k_norm
    ("glm-5", "GlmMoeDsaForCausalLM", {}),
]


def _setup(reference_checkpoint, arch, overrides, seed=0):
    ckpt = reference_checkpoint(arch, overrides, seed=seed)
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    import json

    config = json.loads((ckpt / "config.json").read_text())
    return ckpt, model, config, load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case,arch,overrides", CASES, ids=[c[0] for c in CASES])
def test_refit_reproduces_the_engine_loaders_bitwise(mpu, reference_checkpoint, case, arch, overrides, tp):
    _, model, config, hf = _setup(reference_checkpoint, arch, overrides)
    adapter = DictAdapter(tp_size=tp)
    stats = mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert stats.buckets > 1 and stats.tensors == len(get_plan(model, target_tp=tp, bucket_size="64KB").hf)
    assert_same(adapter.tensors, vllm_engine_tensors(hf, config, tp))


EP_CASES = [c for c in CASES if c[0] in ("qwen3-moe", "qwen2-moe", "mixtral", "glm4-moe", "deepseek-v3")] + [
    ("qwen3-moe-5-experts", "Qwen3MoeForCausalLM", {"num_experts": 5, "num_experts_per_tok": 2}),  # uneven: 3 + 2
]


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("case,arch,overrides", EP_CASES, ids=[c[0] for c in EP_CASES])
def test_refit_into_an_expert_parallel_engine(mpu, reference_checkpoint, case, arch, overrides, placement):
    """vLLM with ``enable_expert_parallel`` over its TP group (2 ranks): each rank holds its experts
    whole, as ``expert_placement_strategy`` places them (5 experts: an uneven split), the rest
    TP-split as without it."""
    _, model, config, hf = _setup(reference_checkpoint, arch, overrides)
    fmt = "vllm-ep" if placement == "linear" else "vllm-ep-round-robin"
    adapter = DictAdapter(tp_size=2, engine_format=get_engine_format(fmt))
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    want = vllm_engine_tensors(hf, config, 2, ep=placement)
    assert_same(adapter.tensors, want)
    w13 = [n for n in want[0] if n.endswith("w13_weight")]
    assert w13 and want[0][w13[0]].shape[0] + want[1][w13[0]].shape[0] == model_experts(config)


def model_experts(config: dict) -> int:
    return config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_vllm_adapter_writes_an_expert_parallel_engine(mpu, reference_checkpoint, placement):
    """An engine started with ``enable_expert_parallel``: the adapter reads it (and the placement)
    from the engine's config, and the worker extension writes each rank's own experts in place."""
    _, model, config, hf = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {"num_experts": 5, "num_experts_per_tok": 2})
    want = vllm_engine_tensors(hf, config, 2, ep=placement)
    workers = [FakeWorker({k: torch.zeros_like(v) for k, v in want[r].items()}, r) for r in range(2)]
    llm = FakeLLM(workers, parallel={"enable_expert_parallel": True, "expert_placement_strategy": placement})
    adapter = VLLMAdapter(llm, transport="inproc")
    assert adapter.engine_format.expert_parallel == placement and adapter.tp_size == 2
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert_same(_engine_params(workers), want)
    # an engine without expert parallelism has other shapes: the plan for it is refused, nothing written
    flat = [FakeWorker({k: torch.zeros_like(v) for k, v in vllm_engine_tensors(hf, config, 2)[r].items()}, r) for r in range(2)]
    with pytest.raises(ZooError, match="begin failed"):
        mcore_zoo.refit(model, VLLMAdapter(FakeLLM(flat), tp_size=2, transport="inproc", engine_format=adapter.engine_format),
                        bucket_size="64KB")  # fmt: skip


@pytest.mark.parametrize("parallel,match", [({"enable_eplb": True}, "EPLB"), ({"data_parallel_size": 2}, "data-parallel ranks"),
                                            ({"expert_placement_strategy": "other"}, "expert_placement_strategy 'other'")])  # fmt: skip
def test_vllm_adapter_refuses_expert_layouts_it_cannot_plan(parallel, match):
    llm = FakeLLM([object(), object()], parallel={"enable_expert_parallel": True, **parallel})
    with pytest.raises(ZooError, match=match):
        VLLMAdapter(llm)
    assert VLLMAdapter(llm, mode="load_weights").engine_format.presplit is False  # whole tensors: vLLM places them


def test_expert_parallel_engine_refuses_stacked_experts_and_too_few_experts(mpu, reference_checkpoint):
    from mcore_zoo.rollout import VLLM_EP

    _, model, _, _ = _setup(reference_checkpoint, "GptOssForCausalLM", {})
    with pytest.raises(ZooError, match="stacks every routed expert.*'vllm-ep'.*per-expert tensors only"):
        mcore_zoo.refit(model, DictAdapter(tp_size=2, engine_format=VLLM_EP), bucket_size="64KB")
    _, model, _, _ = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {"num_experts": 1, "num_experts_per_tok": 1})
    with pytest.raises(LayoutError, match="has 1 routed experts, fewer than the engine's 2 expert-parallel ranks"):
        mcore_zoo.refit(model, DictAdapter(tp_size=2, engine_format=VLLM_EP), bucket_size="64KB")


def test_qkv_shard_of_rank_1_is_q1_k1_v1(mpu, reference_checkpoint):
    _, model, config, hf = _setup(reference_checkpoint, "LlamaForCausalLM", {})
    adapter = DictAdapter(tp_size=2)
    mcore_zoo.refit(model, adapter)
    a = "model.layers.1.self_attn."
    q, k, v = (hf[a + f"{p}_proj.weight"] for p in "qkv")
    want = torch.cat([q.chunk(2)[1], k.chunk(2)[1], v.chunk(2)[1]])
    assert torch.equal(adapter.tensors[1][a + "qkv_proj.weight"], want)
    m = "model.layers.0.mlp."
    want = torch.cat([hf[m + "gate_proj.weight"].chunk(2)[0], hf[m + "up_proj.weight"].chunk(2)[0]])
    assert torch.equal(adapter.tensors[0][m + "gate_up_proj.weight"], want)
    assert torch.equal(adapter.tensors[1][m + "down_proj.weight"], hf[m + "down_proj.weight"].chunk(2, dim=1)[1])


class DroppingAdapter(DictAdapter):
    def __init__(self, *args, drop: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop = drop

    def load_bucket(self, bucket: RefitBucket) -> None:
        if bucket.index != self.drop:
            super().load_bucket(bucket)


@pytest.mark.parametrize("drop", [0, 3, -1])
def test_a_dropped_bucket_fails(mpu, reference_checkpoint, drop):
    _, model, config, hf = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {})
    plan = get_plan(model, target_tp=2, bucket_size="64KB")
    drop = drop % len(plan.buckets)
    # the engine holds another model's weights (a previous step): a skipped bucket leaves them
    _, _, _, stale = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {}, seed=1)
    engine = vllm_engine_tensors(stale, config, 2)
    adapter = DroppingAdapter(tp_size=2, tensors=engine, drop=drop)
    with pytest.raises(ZooError, match="refit incomplete"):
        mcore_zoo.refit(model, adapter, plan=plan)
    # and without the completeness check, the bitwise comparison catches it
    with pytest.raises(AssertionError, match="differs"):
        assert_same(adapter.tensors, vllm_engine_tensors(hf, config, 2))
    # the same plan with no bucket dropped is exact
    mcore_zoo.refit(model, DictAdapter(tp_size=2, tensors=engine), plan=plan)
    assert_same(engine, vllm_engine_tensors(hf, config, 2))


def test_the_plan_is_computed_once_and_reused(mpu, reference_checkpoint, monkeypatch):
    from mcore_zoo.distributed import export

    _, model, config, hf = _setup(reference_checkpoint, "Qwen2ForCausalLM", {})
    calls = []
    real = export.export_plan
    monkeypatch.setattr(export, "export_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    adapter = DictAdapter(tp_size=2)
    stats = [mcore_zoo.refit(model, adapter, bucket_size="32KB") for _ in range(3)]
    assert len(calls) == 1 and [s.planned for s in stats] == [True, False, False]
    assert adapter.calls.count("begin") == 3 and adapter.calls.count("end") == 3
    assert_same(adapter.tensors, vllm_engine_tensors(hf, config, 2))
    plan = get_plan(model, target_tp=2, bucket_size="32KB")
    mcore_zoo.refit(model, DictAdapter(tp_size=2), plan=plan)
    assert len(calls) == 1
    # another engine TP size is another plan
    mcore_zoo.refit(model, DictAdapter(tp_size=1), bucket_size="32KB")
    assert len(calls) == 2


def test_a_plan_for_another_model_is_refused(mpu, reference_checkpoint):
    _, llama, _, _ = _setup(reference_checkpoint, "LlamaForCausalLM", {})
    _, qwen, _, _ = _setup(reference_checkpoint, "Qwen3ForCausalLM", {})
    with pytest.raises(ZooError, match="plan is for"):
        mcore_zoo.refit(qwen, DictAdapter(), plan=get_plan(llama))
    _, llama_tied, _, _ = _setup(reference_checkpoint, "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_scaling": None})
    with pytest.raises(ZooError, match="plan"):
        mcore_zoo.refit(llama_tied, DictAdapter(), plan=get_plan(llama))
    with pytest.raises(ZooError, match="plan made for the 'vllm' engine format, adapter wants 'hf'"):
        mcore_zoo.refit(llama, DictAdapter(engine_format=HF_NAMES), plan=get_plan(llama))


def test_engine_tp_that_does_not_divide_is_refused_before_any_transfer(mpu, reference_checkpoint):
    _, model, _, _ = _setup(reference_checkpoint, "LlamaForCausalLM", {})  # 2 KV heads
    adapter = DictAdapter(tp_size=4)
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by tp=4"):
        mcore_zoo.refit(model, adapter)
    assert adapter.calls == []


def test_hf_names_layout_sends_whole_hf_tensors(mpu, reference_checkpoint):
    _, model, config, hf = _setup(reference_checkpoint, "MixtralForCausalLM", {})
    adapter = DictAdapter(tp_size=4, engine_format=HF_NAMES)  # the engine splits: its TP does not matter
    mcore_zoo.refit(model, adapter)
    want = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    assert_same(adapter.tensors, [want])


def test_plan_describes_engine_tensors(mpu, reference_checkpoint):
    _, model, config, _ = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {})
    plan = plan_refit(mcore_zoo.handle_of(model), VLLM, target_tp=2, bucket_size="1MB")
    shapes = {t.name: t.shape for t in plan.engine_tensors[1]}
    assert shapes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (8, 32, 64)
    assert shapes["model.layers.0.mlp.experts.routed_experts.w2_weight"] == (8, 64, 16)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes
    assert "Qwen3MoeForCausalLM -> vllm TP2" in plan.describe()


# ---------------------------------------------------------------- the vLLM worker extension, on CPU
class FakeWorker(ZooWorkerExtension):
    """What the extension is mixed into: a worker with ``model_runner.model`` (parameters named
    and shaped as vLLM's) and a TP rank."""

    def __init__(self, params: dict[str, torch.Tensor], rank: int):
        module = torch.nn.Module()
        for i, (name, t) in enumerate(params.items()):
            holder = module
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(holder, part):
                    holder.add_module(part, torch.nn.Module())
                holder = getattr(holder, part)
            holder.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
        self.model_runner = type("Runner", (), {"model": module})()
        self.rank = rank

    def _zoo_tp_rank(self) -> int:
        return self.rank


class FakeLLM:
    def __init__(self, workers, prefix_caching=None, parallel=None):
        self.workers = workers
        self.prefix_cache_resets = 0
        self.calls = []
        if prefix_caching is not None or parallel is not None:  # as vLLM exposes them: llm.llm_engine.vllm_config
            cache = type("CacheConfig", (), {"enable_prefix_caching": bool(prefix_caching)})()
            parallel_config = type("ParallelConfig", (), {"tensor_parallel_size": len(workers), **(parallel or {})})()
            config = type("VllmConfig", (), {"cache_config": cache, "parallel_config": parallel_config})()
            self.llm_engine = type("Engine", (), {"vllm_config": config})()

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]


@pytest.mark.parametrize("transport", ["inproc", "packed"])
def test_vllm_worker_extension_writes_parameters_in_place(mpu, reference_checkpoint, transport):
    _, model, config, hf = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {"vocab_size": 250})
    want = vllm_engine_tensors(hf, config, 2)
    stale = [{k: torch.zeros_like(v) for k, v in w.items()} for w in want]
    workers = [FakeWorker(stale[r], r) for r in range(2)]
    llm = FakeLLM(workers)
    adapter = VLLMAdapter(llm, tp_size=2, transport="inproc" if transport == "inproc" else "ipc")
    params_before = [dict(w.model_runner.model.named_parameters()) for w in workers]
    for _ in range(2):  # the manifest travels once, the second refit reuses it
        mcore_zoo.refit(model, adapter, bucket_size="64KB")
    got = [{k: p.data for k, p in w.model_runner.model.named_parameters()} for w in workers]
    assert_same(got, want)
    assert llm.prefix_cache_resets == 2  # KV blocks of the old weights are dropped at each refit
    # the reset (host work) runs while the GPU finishes the copies: before the worker's end synchronises
    assert llm.calls[-2:] == ["reset_prefix_cache", "zoo_refit_end"]
    uncached = FakeLLM(workers, prefix_caching=False)  # an engine without a prefix cache has none to drop
    mcore_zoo.refit(model, VLLMAdapter(uncached, tp_size=2, transport="inproc"), bucket_size="64KB")
    assert uncached.prefix_cache_resets == 0
    cached = FakeLLM(workers, prefix_caching=True)
    mcore_zoo.refit(model, VLLMAdapter(cached, tp_size=2, transport="inproc"), bucket_size="64KB")
    assert cached.prefix_cache_resets == 1
    for before, w in zip(params_before, workers):  # in place: the same parameter objects
        assert all(before[k] is p for k, p in w.model_runner.model.named_parameters())


def test_vllm_worker_extension_refuses_a_mismatched_engine(mpu, reference_checkpoint):
    _, model, config, hf = _setup(reference_checkpoint, "LlamaForCausalLM", {})
    want = vllm_engine_tensors(hf, config, 1)[0]
    want.pop("model.layers.1.mlp.gate_up_proj.weight")
    want["model.norm.weight"] = torch.zeros(3)
    adapter = VLLMAdapter(FakeLLM([FakeWorker(want, 0)]), tp_size=1, transport="inproc")
    with pytest.raises(ZooError, match="2 plan/engine mismatch") as err:
        mcore_zoo.refit(model, adapter)
    assert "no parameter 'model.layers.1.mlp.gate_up_proj.weight'" in str(err.value)
    assert "model.norm.weight: engine (3,), plan rows 64" in str(err.value)


def test_vllm_worker_extension_reports_a_skipped_bucket(mpu, reference_checkpoint):
    _, model, config, hf = _setup(reference_checkpoint, "LlamaForCausalLM", {})
    workers = [FakeWorker(vllm_engine_tensors(hf, config, 1)[0], 0)]

    class Skipping(VLLMAdapter):
        def load_bucket(self, bucket):
            if bucket.index != 1:
                super().load_bucket(bucket)

    with pytest.raises(ZooError, match="refit incomplete: [0-9]+ parameter"):
        mcore_zoo.refit(model, Skipping(FakeLLM(workers), tp_size=1, transport="inproc"), bucket_size="16KB")


def test_vllm_worker_extension_refuses_direct_writes_into_a_relaid_out_moe(mpu, reference_checkpoint):
    """A MoE kernel that keeps experts in its own layout (FlashInfer on Blackwell) must not get
    loader-layout bytes written straight into its parameters."""
    import enum

    _, model, config, hf = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {})
    worker = FakeWorker(vllm_engine_tensors(hf, config, 1)[0], 0)
    backend = enum.Enum("UnquantizedMoeBackend", {"FLASHINFER_CUTLASS": "FlashInfer CUTLASS"}).FLASHINFER_CUTLASS
    experts = worker.model_runner.model.get_submodule("model.layers.0.mlp.experts.routed_experts")
    experts.quant_method = type("Method", (), {"unquantized_backend": backend})()
    with pytest.raises(ZooError, match="re-lays out expert weights.*mode='load_weights'"):
        mcore_zoo.refit(model, VLLMAdapter(FakeLLM([worker]), tp_size=1, transport="inproc"))


def test_vllm_worker_extension_converts_into_engine_dtypes(mpu, reference_checkpoint):
    """bf16 shards into an engine whose router and correction bias are fp32 (vLLM's GLM-4.5):
    ``copy_`` upcasts the bf16 router weight exactly as vLLM's default loader does with the bf16
    export; the correction bias (a checkpoint-state buffer) is sent in its own fp32, unrounded."""
    _, model, config, hf = _setup(reference_checkpoint, "Glm4MoeForCausalLM", {})
    biases = [k for k in hf if k.endswith("e_score_correction_bias")]
    assert biases and all(hf[k].dtype == torch.float32 for k in biases)
    assert any(not torch.equal(hf[k].to(torch.bfloat16).float(), hf[k]) for k in biases)  # rounding would show
    sent = {k: v if k in biases else v.to(torch.bfloat16) for k, v in hf.items()}
    want = vllm_engine_tensors(sent, config, 1)[0]
    fp32 = [k for k in want if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
    assert fp32
    for k in fp32:
        want[k] = want[k].float()
    worker = FakeWorker({k: torch.zeros_like(v) for k, v in want.items()}, 0)
    mcore_zoo.refit(model, VLLMAdapter(FakeLLM([worker]), tp_size=1, transport="inproc"), dtype=torch.bfloat16)
    assert_same([{k: p.data for k, p in worker.model_runner.model.named_parameters()}], [want])


def test_sglang_adapter_sends_hf_names_and_flushes_once(mpu, reference_checkpoint):
    from mcore_zoo.rollout import SGLangAdapter

    _, model, _, hf = _setup(reference_checkpoint, "Qwen2ForCausalLM", {})

    class FakeEngine:
        def __init__(self):
            self.calls = []

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            self.calls.append(([(n, t.clone()) for n, t in named_tensors], flush_cache))
            return True, "Success"  # what sglang.Engine returns

    engine = FakeEngine()
    stats = mcore_zoo.refit(model, SGLangAdapter(engine, tp_size=2), bucket_size="64KB")
    assert len(engine.calls) == stats.buckets > 1
    assert [flush for _, flush in engine.calls] == [False] * (stats.buckets - 1) + [True]
    got = dict(item for named, _ in engine.calls for item in named)
    assert_same([got], [{k: v for k, v in hf.items() if "rotary_emb" not in k}])


def test_sglang_adapter_fails_on_a_refused_or_skipped_bucket(mpu, reference_checkpoint):
    from mcore_zoo.errors import ZooError
    from mcore_zoo.rollout import SGLangAdapter

    _, model, _, _ = _setup(reference_checkpoint, "LlamaForCausalLM", {})

    class RefusingEngine:
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            return False, "Failed to update weights: boom"

    with pytest.raises(ZooError, match="SGLang refused bucket 0 .*boom"):
        mcore_zoo.refit(model, SGLangAdapter(RefusingEngine()), bucket_size="64KB")

    class Engine:
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            return True, "Success"

    class SkipsOne(SGLangAdapter):
        def load_bucket(self, bucket):
            if bucket.index != 1:
                super().load_bucket(bucket)

    with pytest.raises(ZooError, match="refit incomplete: [1-9][0-9]* tensor\\(s\\) never sent"):
        mcore_zoo.refit(model, SkipsOne(Engine()), bucket_size="64KB")


# ---------------------------------------------------------------- the bound data path (rollout/program.py)
def _engine_params(workers) -> list[dict[str, torch.Tensor]]:
    return [{k: p.data for k, p in w.model_runner.model.named_parameters()} for w in workers]


def _vllm_setup(reference_checkpoint, arch, overrides, tp, **adapter_kwargs):
    """A model, its HF config, the engine tensors vLLM would load, stand-in workers holding zeros
    and a VLLMAdapter over them."""
    _, model, config, hf = _setup(reference_checkpoint, arch, overrides)
    want = vllm_engine_tensors(hf, config, tp)
    workers = [FakeWorker({k: torch.zeros_like(v) for k, v in want[r].items()}, r) for r in range(tp)]
    return model, config, want, workers, VLLMAdapter(FakeLLM(workers), tp_size=tp, **adapter_kwargs)


def test_raw_shards_are_views_of_the_trainer_parameters(mpu, reference_checkpoint):
    """TP1 trainer, in-process vLLM adapter: every shard the engine copies from is a view of a
    trainer parameter (no trainer-side copy, q / k / v included); a bucket-taking adapter gets each
    shard in exactly the slot's shape and dtype instead."""
    _, model, config, hf = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {})
    want = vllm_engine_tensors(hf, config, 2)
    workers = [FakeWorker({k: torch.zeros_like(v) for k, v in want[r].items()}, r) for r in range(2)]
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []

    class Recording(VLLMAdapter):
        def load_bucket(self, bucket):
            seen.extend(t for per in bucket.items for _, t in per)
            super().load_bucket(bucket)

    stats = mcore_zoo.refit(model, Recording(FakeLLM(workers), tp_size=2, transport="inproc"), bucket_size="64KB")
    assert stats.source == "local" and len(seen) > stats.tensors
    assert all(t.untyped_storage().data_ptr() in storages for t in seen)
    assert any(t.dim() == 3 for t in seen)  # q / k / v rows as [groups, rows, hidden] views of linear_qkv
    assert_same(_engine_params(workers), want)

    class Checking(DictAdapter):
        def load_bucket(self, bucket):
            for per in bucket.items:
                for slot, t in per:
                    assert tuple(t.shape) == slot.shape and t.dtype == slot.dtype, (slot.name, t.shape, t.dtype)
            super().load_bucket(bucket)

    adapter = Checking(tp_size=2)
    mcore_zoo.refit(model, adapter, bucket_size="64KB", dtype=torch.bfloat16)
    assert_same(adapter.tensors, vllm_engine_tensors({k: v.to(torch.bfloat16) for k, v in hf.items()}, config, 2))


def _walked(fn) -> int:
    """Modules yielded by ``named_modules`` walks while ``fn`` runs (trainer and engine alike)."""
    real = torch.nn.Module.named_modules
    count = [0]

    def counting(self, *args, **kwargs):
        top = (args[1] if len(args) > 1 else kwargs.get("prefix", "")) == ""  # not a recursive call
        for item in real(self, *args, **kwargs):
            count[0] += top
            yield item

    torch.nn.Module.named_modules = counting
    try:
        fn()
    finally:
        torch.nn.Module.named_modules = real
    return count[0]


@pytest.mark.parametrize("source", ["local", "stream"])
def test_a_steady_state_refit_walks_neither_model(mpu, reference_checkpoint, monkeypatch, source):
    """After the first refit of a plan, the trainer's export and the engine's parameter lookup are
    bound: a refit walks no module tree (a few modules for the model's device, against hundreds)."""
    from mcore_zoo.rollout import program

    if source == "stream":
        monkeypatch.setattr(program, "local_source", lambda handle: False)
    model, _, want, workers, adapter = _vllm_setup(reference_checkpoint, "LlamaForCausalLM", {}, 2, transport="inproc")
    first = _walked(lambda: mcore_zoo.refit(model, adapter, bucket_size="16KB"))
    for w in workers:  # stale engine values: the second refit must write everything again
        for p in w.model_runner.model.parameters():
            p.data.zero_()
    stats = []
    later = _walked(lambda: stats.append(mcore_zoo.refit(model, adapter, bucket_size="16KB")))
    assert first > 100 and later < 10, (first, later)
    assert stats[0].source == source and stats[0].buckets > 2
    assert_same(_engine_params(workers), want)


def test_parameters_are_read_when_their_first_bucket_is_due(mpu, reference_checkpoint):
    """The local source reads a parameter when the first bucket that needs it is handed over, not
    all of them before the first bucket: the engine copies bucket 0 while the host reads the rest."""
    model, _, want, workers, adapter = _vllm_setup(reference_checkpoint, "LlamaForCausalLM", {}, 1, transport="inproc")
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    (program,) = mcore_zoo.handle_of(model).derived("refit_programs", dict).values()
    read = []

    class Watching(VLLMAdapter):
        def load_bucket(self, bucket):
            read.append(sum(b is not None for b in program._bases))
            super().load_bucket(bucket)

    stats = mcore_zoo.refit(model, Watching(adapter.llm, tp_size=1, transport="inproc"), bucket_size="16KB")
    assert stats.buckets > 2 and len(read) == stats.buckets
    assert read == sorted(read) and read[0] < read[-1] == len(program._params), read
    assert_same(_engine_params(workers), want)


@pytest.mark.parametrize("adapter_kind", ["dict", "vllm"])
def test_refit_follows_parameters_the_trainer_replaced(mpu, reference_checkpoint, adapter_kind):
    """Views bound on the first refit must not outlive the tensors they view: a parameter object
    replaced, a parameter's ``.data`` swapped and one updated in place are all seen by the next
    refit, bit for bit; so is an engine parameter replaced under the worker."""
    from mcore_zoo.distributed.export import iter_hf_weights

    model, config, _, workers, vllm_adapter = _vllm_setup(reference_checkpoint, "LlamaForCausalLM", {}, 2, transport="inproc")
    adapter = DictAdapter(tp_size=2) if adapter_kind == "dict" else vllm_adapter
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    chunk = mcore_zoo.handle_of(model).chunks[0]
    qkv = chunk.decoder.layers[1].self_attention.linear_qkv
    qkv.weight = torch.nn.Parameter(torch.randn_like(qkv.weight))  # a new parameter object
    fc2 = chunk.decoder.layers[0].mlp.linear_fc2
    fc2.weight.data = torch.randn_like(fc2.weight)  # new storage under the same parameter
    with torch.no_grad():
        chunk.embedding.word_embeddings.weight.mul_(3)  # in place
    if adapter_kind == "vllm":  # the engine swaps a parameter's storage
        engine = workers[1].model_runner.model.get_submodule("model.layers.0.mlp.gate_up_proj")
        engine.weight = torch.nn.Parameter(torch.zeros_like(engine.weight), requires_grad=False)
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    want = vllm_engine_tensors({k: v.clone() for k, v in iter_hf_weights(model)}, config, 2)
    got = adapter.tensors if adapter_kind == "dict" else _engine_params(workers)
    assert_same(got, want)


@pytest.mark.parametrize("tp", [1, 2])
def test_stream_and_local_sources_write_the_same_engine(mpu, reference_checkpoint, monkeypatch, tp):
    """The export stream (any layout; forced here at TP1) and the local source, into the vLLM
    worker (raw shards, packed and in-process) and the dict adapter, with and without a cast (which
    leaves the fp32 score-correction bias, a checkpoint-state buffer, as it is)."""
    from mcore_zoo.rollout import program

    _, model, config, hf = _setup(reference_checkpoint, "Glm4MoeForCausalLM", {})
    for dtype in (None, torch.bfloat16):
        sent = {k: v if dtype is None or k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in hf.items()}
        want = vllm_engine_tensors(sent, config, tp)
        for source in ("local", "stream"):
            monkeypatch.setattr(program, "local_source", lambda handle, s=source: s == "local")
            for transport in ("inproc", "ipc"):
                workers = [FakeWorker({k: torch.zeros_like(v) for k, v in want[r].items()}, r) for r in range(tp)]
                stats = mcore_zoo.refit(model, VLLMAdapter(FakeLLM(workers), tp_size=tp, transport=transport),
                                        bucket_size="32KB", dtype=dtype)  # fmt: skip
                assert stats.source == source
                assert_same(_engine_params(workers), want)
            adapter = DictAdapter(tp_size=tp)
            mcore_zoo.refit(model, adapter, bucket_size="32KB", dtype=dtype)
            assert_same(adapter.tensors, want)


def test_a_padded_vocabulary_is_exported_per_refit(mpu, reference_checkpoint):
    """A padded vocabulary's transform has no views (its padding rows are cut after the gather):
    the local source exports it per refit, and follows its values."""
    ckpt = reference_checkpoint("LlamaForCausalLM", {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, make_vocab_size_divisible_by=100)
    config = json.loads((ckpt / "config.json").read_text())
    hf = load_file(str(ckpt / "model.safetensors"))
    want = vllm_engine_tensors(hf, config, 2)
    workers = [FakeWorker({k: torch.zeros_like(v) for k, v in want[r].items()}, r) for r in range(2)]
    adapter = VLLMAdapter(FakeLLM(workers), tp_size=2, transport="inproc")
    mcore_zoo.refit(model, adapter)
    assert_same(_engine_params(workers), want)
    with torch.no_grad():
        mcore_zoo.handle_of(model).chunks[0].output_layer.weight.add_(1)
    mcore_zoo.refit(model, adapter)
    want = vllm_engine_tensors({**hf, "lm_head.weight": hf["lm_head.weight"] + 1}, config, 2)
    assert_same(_engine_params(workers), want)


def test_no_parameter_storage_is_held_between_refits(mpu, reference_checkpoint):
    """The bound data path keeps view recipes, not views: after a refit neither the trainer-side
    program nor the engine-side binding references a trainer or engine parameter's storage (a
    trainer that offloads its parameters between rollouts gets their memory back)."""
    model, _, want, workers, adapter = _vllm_setup(reference_checkpoint, "Qwen3MoeForCausalLM", {}, 2, transport="inproc")
    tensors = list(model.parameters()) + [p for w in workers for p in w.model_runner.model.parameters()]

    def uses() -> list[int]:
        return [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]

    before = uses()
    for _ in range(2):
        mcore_zoo.refit(model, adapter, bucket_size="64KB")
        mcore_zoo.refit(model, DictAdapter(tp_size=2), bucket_size="64KB")
    assert uses() == before
    assert_same(_engine_params(workers), want)


def test_cuts_map_onto_a_view_whose_first_dimension_is_split():
    """A slot's cuts, given in the HF piece's coordinates, applied to a ``[groups, rows, ...]`` view
    of the piece: whole groups map to a narrow of the view, anything else is refused (the shard is
    then exported and cut instead)."""
    from mcore_zoo.weights.rules import narrow_view as _cut_view

    piece = torch.arange(6 * 4 * 3).reshape(6 * 4, 3)  # the HF piece: 6 groups of 4 rows
    view = torch.arange(6 * 4 * 3).reshape(6, 4, 3)  # the same elements, first dimension split
    got = _cut_view(view, (24, 3), ((0, 8, 12), (1, 1, 2)))
    assert got is not None and torch.equal(got.reshape(12, 2), piece.narrow(0, 8, 12).narrow(1, 1, 2))
    assert _cut_view(view, (24, 3), ((0, 2, 12),)) is None  # not on a group boundary
    assert _cut_view(view, (24, 4), ()) is None  # not a refinement of the piece's shape
    assert torch.equal(_cut_view(piece, (24, 3), ((0, 5, 7),)), piece.narrow(0, 5, 7))
    scalar = torch.tensor(1.0)
    assert _cut_view(scalar, (), ()) is scalar and _cut_view(scalar, (), ((0, 0, 1),)) is None


def test_chunk_cuts_translate_a_slot_into_the_rank_chunk():
    """``tp-local``: a slot's cuts of the gathered piece, in the coordinates of the TP chunk a rank
    holds - or ``None`` where the slot reaches outside that chunk (the rule is then gathered)."""
    from mcore_zoo.weights.rules import TPSlice

    def _chunk_cuts(shape, cuts, axis, rank, size):
        return TPSlice(axis, rank, size).within_chunk(shape, cuts)

    shape = (8, 6)  # split over 2 ranks along axis 0: rows 0-3 on rank 0, 4-7 on rank 1
    assert _chunk_cuts(shape, ((0, 4, 4),), 0, 1, 2) == ((4, 6), ())  # exactly rank 1's rows
    assert _chunk_cuts(shape, ((0, 4, 4), (1, 2, 3)), 0, 1, 2) == ((4, 6), ((1, 2, 3),))  # other axes kept
    assert _chunk_cuts(shape, ((0, 5, 2),), 0, 1, 2) == ((4, 6), ((0, 1, 2),))  # inside the chunk
    assert _chunk_cuts(shape, ((0, 2, 4),), 0, 1, 2) is None  # starts in rank 0's rows
    assert _chunk_cuts(shape, ((0, 4, 4),), 0, 0, 2) is None  # rank 1's rows asked of rank 0
    assert _chunk_cuts(shape, ((1, 0, 3),), 0, 0, 2) is None  # all rows needed: not one chunk
    assert _chunk_cuts(shape, ((0, 4, 4), (0, 0, 2)), 0, 1, 2) is None  # the split axis cut twice
    assert _chunk_cuts((7, 6), ((0, 0, 3),), 0, 0, 2) is None  # no even split
    assert _chunk_cuts(shape, ((0, 4, 4),), None, 1, 2) == (shape, ((0, 4, 4),))  # replicated: as is
    assert _chunk_cuts(shape, ((0, 4, 4),), 0, 0, 1) == (shape, ((0, 4, 4),))  # TP 1: as is


def test_worker_compares_its_parameters_bit_for_bit():
    """``zoo_compare_parameters`` (the GPU refit benchmark's exactness check): None when equal;
    otherwise it names the parameter - a one-ulp change, a shape, a name the engine lacks."""
    params = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.arange(6.0).reshape(3, 2)}
    worker = FakeWorker(params, 0)
    assert worker.zoo_compare_parameters({k: v.clone() for k, v in params.items()}) is None
    nudged = params["lm_head.weight"].clone()
    nudged[1, 1] = torch.nextafter(nudged[1, 1], torch.tensor(10.0))
    assert "lm_head.weight: values differ" in worker.zoo_compare_parameters({"lm_head.weight": nudged})
    assert "expected (5,)" in worker.zoo_compare_parameters({"model.norm.weight": torch.ones(5)})
    assert "not a parameter" in worker.zoo_compare_parameters({"model.embed.weight": torch.ones(1)})


def test_vllm_worker_extension_rederives_mla_weights_after_a_refit(mpu, reference_checkpoint):
    """vLLM's MLA attention keeps ``W_UK_T`` / ``W_UV`` computed from ``kv_b_proj`` after loading;
    a refit must have them recomputed from the new ``kv_b_proj`` (in place), or the engine attends
    with the old weights."""
    import types

    _, model, config, hf = _setup(reference_checkpoint, "DeepseekV3ForCausalLM", {})
    want = vllm_engine_tensors(hf, config, 1)[0]
    worker = FakeWorker({k: torch.zeros_like(v) for k, v in want.items()}, 0)
    worker.model_config = types.SimpleNamespace(dtype=torch.float32)

    class MLAAttention(torch.nn.Module):  # vLLM's class name: what the worker looks for
        def __init__(self, kv_b_proj):
            super().__init__()
            self.kv_b_proj = kv_b_proj
            self.W_UK_T = torch.nn.Parameter(torch.zeros(kv_b_proj.weight.shape[::-1]), requires_grad=False)
            self.dtypes = []

        def process_weights_after_loading(self, act_dtype):
            self.dtypes.append(act_dtype)
            self.W_UK_T.copy_(self.kv_b_proj.weight.t())  # in place, as replace_parameter(prefer_copy=True)

    layers = [worker.model_runner.model.get_submodule(f"model.layers.{i}") for i in range(config["num_hidden_layers"])]
    attns = [MLAAttention(layer.self_attn.kv_b_proj) for layer in layers]
    for layer, attn in zip(layers, attns):
        layer.self_attn.add_module("mla_attn", attn)
    derived_before = [a.W_UK_T for a in attns]
    mcore_zoo.refit(model, VLLMAdapter(FakeLLM([worker]), tp_size=1, transport="inproc"), bucket_size="16KB")
    for i, attn in enumerate(attns):
        kv_b = want[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        assert attn.dtypes == [torch.float32]
        assert attn.W_UK_T is derived_before[i] and torch.equal(attn.W_UK_T, kv_b.t())


def test_vllm_adapter_takes_a_plugins_engine_format(mpu, reference_checkpoint):
    """A plugin whose vLLM model class fuses differently passes its own format: the plan follows
    it (here: no gate / up fusion), and the default format's plan is refused by that engine."""
    from dataclasses import replace

    _, model, config, hf = _setup(reference_checkpoint, "LlamaForCausalLM", {})
    unfused = replace(VLLM, name="vllm-unfused-mlp", fusions=tuple(f for f in VLLM.fusions if "gate_up" not in f.engine_suffix))
    want = vllm_engine_tensors(hf, config, 1)[0]
    engine = {k: v for k, v in want.items() if "gate_up_proj" not in k}
    for i in range(config["num_hidden_layers"]):
        for proj in ("gate_proj", "up_proj"):
            engine[f"model.layers.{i}.mlp.{proj}.weight"] = hf[f"model.layers.{i}.mlp.{proj}.weight"]
    worker = FakeWorker({k: torch.zeros_like(v) for k, v in engine.items()}, 0)
    with pytest.raises(ZooError, match="no parameter 'model.layers.0.mlp.gate_up_proj.weight'"):
        mcore_zoo.refit(model, VLLMAdapter(FakeLLM([worker]), tp_size=1, transport="inproc"))
    mcore_zoo.refit(model, VLLMAdapter(FakeLLM([worker]), tp_size=1, transport="inproc", engine_format=unfused))
    got = {k: p.data for k, p in worker.model_runner.model.named_parameters()}
    assert_same([got], [engine])
    with pytest.raises(ValueError, match="mode='direct' only"):
        VLLMAdapter(FakeLLM([worker]), tp_size=1, mode="load_weights", engine_format=unfused)


@pytest.fixture
def fused_on(monkeypatch):
    """The worker's fused copies on the CPU: ``copy_runs.supported`` says yes, so each bucket's
    byte copies go into a RunTable, executed here with ``memmove`` (on CUDA: the Triton kernel)."""
    from mcore_zoo.kernels import copy_runs

    monkeypatch.setattr(copy_runs, "supported", lambda device: True)
    launches = []
    launch = copy_runs.RunTable.launch

    def counted(self):
        launches.append(len(self.runs))
        return launch(self)

    monkeypatch.setattr(copy_runs.RunTable, "launch", counted)
    return launches


FUSED_CASES = [c for c in CASES if c[0] in ("llama3", "llama-vocab250", "qwen3-moe", "glm4-moe", "deepseek-v3")]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case,arch,overrides", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_copies_write_the_engine_bitwise(mpu, reference_checkpoint, fused_on, case, arch, overrides, tp):
    """Every bucket's byte copies in one table per bucket (padded vocabulary rows, GLM's fp32
    router and other casts shard by shard): the engine equals vLLM's loaders' result, on the
    first refit (tables built) and the next (tables reused) after the trainer's weights changed."""
    from mcore_zoo.distributed.export import iter_hf_weights

    model, config, want, workers, adapter = _vllm_setup(reference_checkpoint, arch, overrides, tp, transport="inproc")
    stats = mcore_zoo.refit(model, adapter, bucket_size="32KB")
    assert_same(_engine_params(workers), want)
    assert len(fused_on) == stats.buckets * tp and sum(fused_on) > 0
    bindings = [w._zoo_binding for w in workers]
    assert all(b.fused and len(b.tables) == stats.buckets for b in bindings)
    tables = [dict(b.tables) for b in bindings]
    with torch.no_grad():
        for p in mcore_zoo.handle_of(model).chunks[0].parameters():
            p.mul_(-2)
    mcore_zoo.refit(model, adapter, bucket_size="32KB")
    assert all(b.tables[i] is t[i] for b, t in zip(bindings, tables) for i in t)  # reused, not rebuilt
    want = vllm_engine_tensors({k: v.clone() for k, v in iter_hf_weights(model)}, config, tp)
    assert_same(_engine_params(workers), want)


def test_fused_copies_follow_moved_tensors_and_fall_back_when_the_kernel_fails(mpu, reference_checkpoint, fused_on,
                                                                               monkeypatch):  # fmt: skip
    """A table is keyed on where the shards and the engine's storage are: a trainer parameter
    given new storage and an engine parameter replaced rebuild it, bitwise. A launch that raises
    (no kernel on this machine) turns fused copies off for the binding and copies shard by shard."""
    from mcore_zoo.distributed.export import iter_hf_weights
    from mcore_zoo.kernels import copy_runs

    model, config, _, workers, adapter = _vllm_setup(reference_checkpoint, "LlamaForCausalLM", {}, 2, transport="inproc")
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    chunk = mcore_zoo.handle_of(model).chunks[0]
    fc2 = chunk.decoder.layers[0].mlp.linear_fc2
    fc2.weight.data = torch.randn_like(fc2.weight)  # new storage under the same parameter
    engine = workers[1].model_runner.model.get_submodule("model.layers.0.mlp.gate_up_proj")
    engine.weight = torch.nn.Parameter(torch.zeros_like(engine.weight), requires_grad=False)
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    want = vllm_engine_tensors({k: v.clone() for k, v in iter_hf_weights(model)}, config, 2)
    assert_same(_engine_params(workers), want)

    def broken(self):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(copy_runs.RunTable, "launch", broken)
    with torch.no_grad():
        fc2.weight.add_(1)
    with pytest.warns(UserWarning, match="fused copies off"):
        mcore_zoo.refit(model, adapter, bucket_size="16KB")
    assert not any(w._zoo_binding.fused for w in workers)
    want = vllm_engine_tensors({k: v.clone() for k, v in iter_hf_weights(model)}, config, 2)
    assert_same(_engine_params(workers), want)
    mcore_zoo.refit(model, adapter, bucket_size="16KB")  # stays off, no second warning needed
    assert not any(w._zoo_binding.fused for w in workers)


def test_fused_copies_only_where_asked_and_supported(mpu, reference_checkpoint, monkeypatch):
    """Off on a device without the kernel (this CPU: ``copy_runs.supported`` is CUDA with Triton),
    off for the packed transport and when the adapter opts out; on otherwise."""
    from mcore_zoo.kernels import copy_runs

    assert not copy_runs.supported(torch.device("cpu"))
    cases = [({"transport": "inproc"}, False, False), ({"transport": "inproc"}, True, True),
             ({"transport": "ipc"}, True, False), ({"transport": "inproc", "fused_copies": False}, True, False)]  # fmt: skip
    for kwargs, kernel, fused in cases:
        model, _, _, workers, adapter = _vllm_setup(reference_checkpoint, "LlamaForCausalLM", {}, 1, **kwargs)
        monkeypatch.setattr(copy_runs, "supported", lambda device, k=kernel: k)
        mcore_zoo.refit(model, adapter)
        assert workers[0]._zoo_binding.fused == fused, kwargs


class SwappingAdapter(DictAdapter):
    """Writes the first slot of a bucket in place of the second one of the same size: every
    element count still adds up, one region is written twice and another never."""

    def load_bucket(self, bucket: RefitBucket) -> None:
        items = bucket.items[0]
        for i in range(len(items) - 1):
            (a, ta), (b, tb) = items[i], items[i + 1]
            if a.name == b.name and a.expert == b.expert and ta.shape == tb.shape:
                items[i] = (b, ta)  # b's region twice, a's never
                break
        super().load_bucket(bucket)


def test_a_region_written_twice_and_one_never_fails_though_counts_add_up(mpu, reference_checkpoint):
    """Completeness is checked by row spans, not element counts (DictAdapter, the plan, and the
    vLLM worker's binding of a manifest)."""
    from mcore_zoo.rollout.vllm import _manifest_tiling_problems

    _, model, _, _ = _setup(reference_checkpoint, "Qwen3MoeForCausalLM", {})
    plan = get_plan(model, target_tp=1, bucket_size="64KB")
    with pytest.raises(ZooError, match="twice"):
        mcore_zoo.refit(model, SwappingAdapter(tp_size=1), plan=plan)
    # the engine side: a manifest with one slot planned twice and its neighbour never
    manifest = plan.manifest(0)
    i = next(i for i in range(len(manifest) - 1) if manifest[i][0] == manifest[i + 1][0]
             and manifest[i][1] == manifest[i + 1][1] and manifest[i][3] == manifest[i + 1][3])  # fmt: skip
    params = {t.name: torch.empty(t.shape) for t in plan.engine_tensors[0]}
    assert _manifest_tiling_problems(manifest, params) == []
    bad = list(manifest)
    bad[i + 1] = bad[i]
    assert any("twice" in p for p in _manifest_tiling_problems(bad, params))
    # the plan itself: an export plan naming an HF tensor twice, or leaving one out
    from mcore_zoo.distributed.export import export_plan

    handle = mcore_zoo.handle_of(model)
    entries = list(export_plan(handle))
    with pytest.raises(ZooError, match="named twice"):
        plan_refit(handle, VLLM, entries=entries + entries[:1])
    with pytest.raises(ZooError, match="misses"):
        plan_refit(handle, VLLM, entries=entries[1:])


# ---------------------------------------------------------------- gated DeltaNet (Qwen3.5 / Qwen3-Next)
def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    size = t.shape[0] // tp
    return t.narrow(0, rank * size, size)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_refit_lays_tensors_out_as_vllm_does(mpu, reference_checkpoint, tp):
    """vLLM 0.26's ``qwen3_5.py``: the split projections stacked into ``in_proj_qkvz`` (output sizes
    key, key, value, value: each rank ``[q_r; k_r; v_r; z_r]``) and ``in_proj_ba`` (``[b_r; a_r]``),
    ``conv1d`` by ``mamba_v2_sharded_weight_loader`` (``[q_r; k_r; v_r]`` channels), and the
    language model of the vision-language checkpoint under ``language_model.model.`` /
    ``language_model.lm_head.`` and the vision tower under ``visual.`` (``qwen3_vl.py``'s
    ``orig_to_new_prefix``)."""
    _, model, config, hf = _setup(reference_checkpoint, "Qwen3_5ForConditionalGeneration", {})
    adapter = DictAdapter(tp_size=tp)
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    text = config["text_config"]
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    hf_layer, engine_layer = "model.language_model.layers.0.linear_attn.", "language_model.model.layers.0.linear_attn."
    for rank, got in enumerate(adapter.tensors):
        assert not any(name.startswith("model.") for name in got), sorted(got)[:4]
        assert "language_model.lm_head.weight" in got and "language_model.model.embed_tokens.weight" in got
        assert torch.equal(got["visual.patch_embed.proj.weight"], hf["model.visual.patch_embed.proj.weight"])
        q, k, v = hf[hf_layer + "in_proj_qkv.weight"].split([key, key, value])
        z, b, a = (hf[hf_layer + f"in_proj_{p}.weight"] for p in ("z", "b", "a"))
        want_qkvz = torch.cat([_rows(t, rank, tp) for t in (q, k, v, z)])
        assert torch.equal(got[engine_layer + "in_proj_qkvz.weight"], want_qkvz)
        assert torch.equal(got[engine_layer + "in_proj_ba.weight"], torch.cat([_rows(b, rank, tp), _rows(a, rank, tp)]))
        cq, ck, cv = hf[hf_layer + "conv1d.weight"].split([key, key, value])
        assert torch.equal(got[engine_layer + "conv1d.weight"], torch.cat([_rows(t, rank, tp) for t in (cq, ck, cv)]))
        assert torch.equal(got[engine_layer + "A_log"], _rows(hf[hf_layer + "A_log"], rank, tp))
        assert not any(n.endswith(("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight")) for n in got)


def test_qwen3_next_refit_keeps_its_fused_projections_and_names(mpu, reference_checkpoint):
    """Qwen3-Next's checkpoint already holds vLLM's ``in_proj_qkvz`` / ``in_proj_ba`` (one output
    shard each, head-interleaved): the engine receives them as they are, under their HF names."""
    _, model, _, hf = _setup(reference_checkpoint, "Qwen3NextForCausalLM", {})
    adapter = DictAdapter(tp_size=1)
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    got = adapter.tensors[0]
    for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "out_proj.weight"):
        full = "model.layers.0.linear_attn." + name
        assert torch.equal(got[full], hf[full]), full
    assert "lm_head.weight" in got and not any(n.startswith("language_model.") for n in got)


# ---------------------------------------------------------------- DeepSeek sparse attention (DeepSeek-V3.2 / GLM-5)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_dsa_indexer_refit_lays_tensors_out_as_vllm_does(mpu, reference_checkpoint, arch, tp):
    """vLLM 0.26's ``deepseek_v2.py`` ``Indexer``: ``wk`` and ``weights_proj`` stacked into one
    replicated ``wk_weights_proj`` (``[wk; weights_proj]`` whole on every rank), ``wq_b`` replicated
    and ``k_norm`` (a LayerNorm, weight and bias) under their HF names."""
    _, model, config, hf = _setup(reference_checkpoint, arch, {})
    adapter = DictAdapter(tp_size=tp)
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    layer = "model.layers.0.self_attn.indexer."
    for got in adapter.tensors:
        fused = got[layer + "wk_weights_proj.weight"]
        assert fused.shape == (config["index_head_dim"] + config["index_n_heads"], config["hidden_size"])
        assert torch.equal(fused, torch.cat([hf[layer + "wk.weight"], hf[layer + "weights_proj.weight"]]))
        for name in ("wq_b.weight", "k_norm.weight", "k_norm.bias"):
            assert torch.equal(got[layer + name], hf[layer + name]), name
        assert not any(n.endswith(("indexer.wk.weight", "indexer.weights_proj.weight")) for n in got)


# ---------------------------------------------------------------- stacked experts (gpt-oss)
#: gpt_oss.py's hf_to_vllm_mapper (bf16 weights): substrings, then suffixes
GPT_OSS_SUBSTR = {".self_attn.": ".attn."}
GPT_OSS_SUFFIX = {".embed_tokens.weight": ".embedding.weight", ".gate_up_proj": ".w13_weight", ".down_proj": ".w2_weight",
                  ".gate_up_proj_bias": ".w13_bias", ".down_proj_bias": ".w2_bias"}  # fmt: skip


def vllm_gpt_oss_tensors(hf: dict[str, torch.Tensor], config: dict, tp: int) -> list[dict[str, torch.Tensor]]:
    """What vLLM 0.26's ``GptOssModel._load_weights_other`` (bf16, no expert parallelism) leaves on
    each TP rank: the mapper's names, experts under ``routed_experts.`` (``remap_moe_expert_weights``),
    ``w13_weight = gate_up_proj[:, :, 2s:2e].permute(0, 2, 1)``, ``w13_bias = gate_up_proj_bias[:, 2s:2e]``,
    ``w2_weight = down_proj[:, s:e, :].permute(0, 2, 1)``, ``w2_bias`` whole on rank 0 and zeros
    elsewhere, ``sinks`` narrowed to the rank's heads; q / k / v into ``qkv_proj``
    (``QKVParallelLinear``), ``o_proj`` by ``RowParallelLinear`` (bias whole), the vocabulary padded to 64."""
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for rank in range(tp):
        per = -(-inter // tp)  # cdiv
        s, e = rank * per, min((rank + 1) * per, inter)
        params = out[rank]
        for name, w in hf.items():
            if config.get("tie_word_embeddings") and name == "lm_head.weight":
                continue
            vname = name
            for old, new in GPT_OSS_SUBSTR.items():
                vname = vname.replace(old, new)
            for old, new in GPT_OSS_SUFFIX.items():
                if vname.endswith(old):
                    vname = vname[: len(vname) - len(old)] + new
                    break
            vname = vname.replace(".experts.w", ".experts.routed_experts.w")
            if vname.endswith(".w13_weight"):
                params[vname] = w[:, :, 2 * s : 2 * e].permute(0, 2, 1).contiguous()
            elif vname.endswith(".w2_weight"):
                params[vname] = w[:, s:e, :].permute(0, 2, 1).contiguous()
            elif vname.endswith(".w13_bias"):
                params[vname] = w[:, 2 * s : 2 * e].clone()
            elif vname.endswith(".w2_bias"):
                params[vname] = w.clone() if rank == 0 else torch.zeros_like(w)
            elif vname.endswith(".sinks"):
                params[vname] = w.narrow(0, rank * (heads // tp), heads // tp).clone()
            elif re.search(r"\.attn\.[qkv]_proj\.", vname):
                stem, leaf = vname.rsplit(".", 1)
                fused = stem[:-len("q_proj")] + "qkv_proj." + leaf
                q_size, kv_size = heads // tp * hd, kv // tp * hd
                shard = stem[-6]
                offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard]
                if fused not in params:
                    params[fused] = torch.full((q_size + 2 * kv_size, *w.shape[1:]), float("nan"), dtype=w.dtype)
                params[fused].narrow(0, offset, size).copy_(w.narrow(0, rank * size, size))
            elif name in VOCAB:
                padded = -(-w.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
                rows = padded // tp
                lo, hi = min(rank * rows, w.shape[0]), min((rank + 1) * rows, w.shape[0])
                p = torch.zeros((rows, *w.shape[1:]), dtype=w.dtype)
                p[: hi - lo].copy_(w[lo:hi])
                params[vname] = p
            elif vname.endswith(".o_proj.weight"):
                size = w.shape[1] // tp
                params[vname] = w.narrow(1, rank * size, size).clone()
            else:  # norms, the router (ReplicatedLinear), o_proj's bias
                params[vname] = w.clone()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_refit_reproduces_vllms_loader_bitwise(mpu, reference_checkpoint, tp):
    """gpt-oss's stacked experts refit into vLLM 0.26's ``gpt_oss.py`` layout (transposed, gate and
    up still interleaved, the down bias on rank 0 only) and names (``attn``, ``embedding``), equal
    bit for bit to vLLM's loader applied to the checkpoint - at engine TP 2 too, although the
    trainer builds experts with biases at expert TP 1 only."""
    _, model, config, hf = _setup(reference_checkpoint, "GptOssForCausalLM", {})
    adapter = DictAdapter(tp_size=tp)
    stats = mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert stats.source == "stream" and stats.buckets > 1
    want = vllm_gpt_oss_tensors(hf, config, tp)
    assert_same(adapter.tensors, want)
    w2_bias = "model.layers.0.mlp.experts.routed_experts.w2_bias"
    assert tp == 1 or (adapter.tensors[1][w2_bias] == 0).all()


@pytest.mark.parametrize("transport", ["inproc", "packed"])
def test_gpt_oss_refit_writes_vllm_parameters_in_place(mpu, reference_checkpoint, transport):
    """The vLLM worker extension (direct mode) at engine TP 2: transposed expert shards written into
    ``w13_weight`` / ``w2_weight`` in place, and rank 1's ``w2_bias`` zeroed (its stale values were
    ones), on the first refit and the second."""
    _, model, config, hf = _setup(reference_checkpoint, "GptOssForCausalLM", {})
    want = vllm_gpt_oss_tensors(hf, config, 2)
    workers = [FakeWorker({k: torch.ones_like(v) for k, v in want[r].items()}, r) for r in range(2)]
    adapter = VLLMAdapter(FakeLLM(workers), tp_size=2, transport="inproc" if transport == "inproc" else "ipc")
    for _ in range(2):
        mcore_zoo.refit(model, adapter, bucket_size="64KB")
        assert_same(_engine_params(workers), want)


def test_gpt_oss_hf_names_refit_sends_the_stacked_tensors_whole(mpu, reference_checkpoint):
    """Engines that split and fuse on their side get the stacked HF tensors whole, under their names."""
    _, model, _, hf = _setup(reference_checkpoint, "GptOssForCausalLM", {})
    adapter = DictAdapter(tp_size=1, engine_format=HF_NAMES)
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    got = adapter.tensors[0]
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        full = "model.layers.0.mlp.experts." + name
        assert torch.equal(got[full], hf[full]), full


def test_stacked_experts_without_an_engine_layout_are_refused_before_any_transfer(mpu, reference_checkpoint):
    """A pre-split engine format with no layout for stacked experts (an MXFP4 engine's
    ``*_blocks`` / ``*_scales`` are not refit tensors either): the plan refuses the model naming
    the tensor, before anything is sent."""
    import dataclasses

    _, model, _, _ = _setup(reference_checkpoint, "GptOssForCausalLM", {})
    no_layout = dataclasses.replace(VLLM, name="vllm-no-stacked-experts", stacked_experts=None)
    adapter = DictAdapter(tp_size=1, engine_format=no_layout)
    with pytest.raises(ZooError, match=r"mlp\.experts\.down_proj.*stacks every routed expert"):
        mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert all(not tensors for tensors in adapter.tensors)
