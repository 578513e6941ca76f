"""CPU fp32 parity of the MoE families against the real transformers model, and mutations the same
comparison must catch (routing off by one expert, top-k, renormalisation, a dense layer routed).

The conformance suite (``test_builtin_conformance.py``) runs every contract on the MoE example
configs; these tests add the mutations and the stock Megatron-Core router (``router="mcore"``).
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.profiles import get_profile
from mcore_zoo.parity.reference import load_reference
from mcore_zoo.testing.common import REL_TOL, max_abs_diff, same_bits

from ..conftest import random_sequences
from .packs import assert_packs_equal_alone

MOE_ARCHS = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"]


def _build(source, checkpoint, backend="local", numerics="hf-exact"):
    return mcore_zoo.build_model(source, backend=backend, numerics=numerics, load=checkpoint,
                                 params_dtype=torch.float32).eval()  # fmt: skip


def _batch(vocab):
    return torch.stack(random_sequences([40, 40, 40], vocab, seed=1))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)


@pytest.mark.parametrize("arch_name", MOE_ARCHS)
def test_hf_exact_bitwise(mpu, reference_checkpoint, hf_reference, arch_name):
    """BSHD batches of several shapes (token counts that leave a tail after the last full vector:
    the shared-expert gate and sigmoid scores must run in HF's batch-major order), and THD packs of
    mixed and many short sequences, each sequence equal to transformers on it alone at one and two
    threads (``pack_gemms="each"``: every GEMM of the pack sees one sequence's rows)."""
    ckpt = reference_checkpoint(arch_name)
    hf = hf_reference(arch_name, ckpt, "eager")
    model = _build(ckpt, ckpt)
    for batch, length in [(3, 40), (3, 37), (7, 19)]:
        ids = torch.stack(random_sequences([length] * batch, hf.config.vocab_size, seed=batch))
        with torch.no_grad():
            ref = hf(ids).logits
        assert torch.equal(_logits(model, ids), ref), (batch, length)
    assert_packs_equal_alone(model, hf)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch_name", MOE_ARCHS + ["DeepseekV3ForCausalLM"])
def test_hf_exact_bitwise_bf16(mpu, reference_checkpoint, arch_name, experts):
    """bf16 on the CPU, against both of transformers' experts implementations (numerics knob
    ``moe_experts``): ``grouped_mm`` sums a token's weighted expert outputs in the routing weights'
    dtype (fp32 for Mixtral, GLM-4.5, DeepSeek-V3) and casts once, ``eager`` casts each to bf16
    and adds them in bf16. THD packs: each sequence against transformers on it alone."""
    ckpt = reference_checkpoint(arch_name)
    arch = mcore_zoo.lookup(arch_name)
    hf = load_reference(arch, ckpt, dtype=torch.bfloat16, experts_implementation=experts)
    profile = get_profile("hf-exact").with_knobs(moe_experts=experts)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics=profile, load=ckpt,
                                  params_dtype=torch.bfloat16).eval()  # fmt: skip
    for batch, length in [(3, 37), (1, 61)]:
        ids = torch.stack(random_sequences([length] * batch, hf.config.vocab_size, seed=batch))
        with torch.no_grad():
            ref = hf(ids).logits
        assert torch.equal(_logits(model, ids), ref), (batch, length)
    assert_packs_equal_alone(model, hf)


@pytest.mark.parametrize("arch_name", MOE_ARCHS)
def test_experts_off_by_one_fail(mpu, reference_checkpoint, hf_reference, arch_name):
    """Routing every token to the next expert (expert i computes with expert i+1's weights) must
    change the logits by O(1)."""
    ckpt = reference_checkpoint(arch_name)
    hf = hf_reference(arch_name, ckpt, "eager")
    ids = _batch(hf.config.vocab_size)
    model = _build(ckpt, ckpt)
    with torch.no_grad():
        for layer in model.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            params = [dict(e.named_parameters()) for e in experts.local_experts]
            saved = [{k: v.clone() for k, v in p.items()} for p in params]
            for i, p in enumerate(params):
                for k, v in p.items():
                    v.copy_(saved[(i + 1) % len(saved)][k])
        diff = max_abs_diff(_logits(model, ids), hf(ids).logits)
    assert diff > 1e-2, f"experts shifted by one still agree with transformers to {diff:.2e}"


@pytest.mark.parametrize(
    "arch_name,overrides",
    [
        ("Qwen3MoeForCausalLM", {"norm_topk_prob": False}),
        ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 1}),
        ("Qwen3MoeForCausalLM", {"mlp_only_layers": []}),
        ("Qwen2MoeForCausalLM", {"norm_topk_prob": True}),
        ("MixtralForCausalLM", {"num_experts_per_tok": 3}),
        ("Glm4MoeForCausalLM", {"routed_scaling_factor": 1.0}),
        ("Glm4MoeForCausalLM", {"topk_group": 2}),
        ("Glm4MoeForCausalLM", {"norm_topk_prob": False}),
    ],
    ids=["qwen3moe-no-renorm", "qwen3moe-top1", "qwen3moe-no-dense-layer", "qwen2moe-renorm", "mixtral-top3",
         "glm-unscaled", "glm-all-groups", "glm-no-renorm"],
)
def test_config_mutations_fail(mpu, reference_checkpoint, hf_reference, arch_name, overrides):
    """Building from a config that differs in one MoE field (weights of the real model) must
    disagree with transformers; ``mlp_only_layers=[]`` fails to load (a dense layer's tensors have
    no rule, the router's none in the checkpoint)."""
    ckpt = reference_checkpoint(arch_name)
    hf = hf_reference(arch_name, ckpt, "eager")
    config = {**mcore_zoo.lookup(arch_name).example_config(), **overrides}
    ids = _batch(hf.config.vocab_size)
    if "mlp_only_layers" in overrides:
        with pytest.raises(mcore_zoo.ZooError):
            _build(config, ckpt)
        return
    diff = max_abs_diff(_logits(_build(config, ckpt), ids), hf(ids).logits)
    assert diff > 1e-2, f"{overrides} still agrees with transformers to {diff:.2e}"


@pytest.mark.parametrize("arch_name", MOE_ARCHS)
def test_stock_mcore_router_within_tolerance(mpu, reference_checkpoint, hf_reference, arch_name):
    """Megatron-Core's own TopKRouter / SequentialMLP (numerics router='mcore'): same experts, the
    weights rounded differently (softmax over the top-k logits; weight applied before fc2)."""
    ckpt = reference_checkpoint(arch_name)
    hf = hf_reference(arch_name, ckpt, "eager")
    ids = _batch(hf.config.vocab_size)
    model = _build(ckpt, ckpt, numerics=get_profile("hf-exact").with_knobs(router="mcore"))
    ref = hf(ids).logits
    got = _logits(model, ids)
    assert max_abs_diff(got, ref) <= 10 * REL_TOL * max(1.0, ref.abs().max().item())


def test_glm_expert_bias_matters(mpu, reference_checkpoint, hf_reference):
    """GLM-4.5's e_score_correction_bias (loaded into the router's expert_bias buffer) changes
    which experts are chosen: zeroing it must break parity."""
    ckpt = reference_checkpoint("Glm4MoeForCausalLM")
    hf = hf_reference("Glm4MoeForCausalLM", ckpt, "eager")
    ids = _batch(hf.config.vocab_size)
    model = _build(ckpt, ckpt)
    with torch.no_grad():
        biases = [layer.mlp.router.expert_bias for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
        assert biases and all(b.abs().sum() > 0 for b in biases)
        ref = hf(ids).logits
        assert torch.equal(_logits(model, ids), ref)
        for b in biases:
            b.zero_()
        diff = max_abs_diff(_logits(model, ids), ref)
    assert diff > 1e-2, f"zeroed expert bias still agrees with transformers to {diff:.2e}"


def test_glm_mtp_built_one_depth_only():
    """One MTP layer is built (tests/parity/test_mtp_parity.py); more are refused, naming the field."""
    arch = mcore_zoo.lookup("Glm4MoeForCausalLM")
    config = {**arch.example_config(), "num_nextn_predict_layers": 1}
    assert arch.config_from_hf(config).mtp_num_layers == 1
    with pytest.raises(mcore_zoo.ConfigError, match="num_nextn_predict_layers"):
        arch.config_from_hf(dict(config, num_nextn_predict_layers=2))


@pytest.mark.slow
@pytest.mark.parametrize("config", ["qwen3-30b-a3b.json", "mixtral-8x7b-v0.1.json", "qwen1.5-moe-a2.7b.json",
                                    "kimi-k2-instruct.json"])  # fmt: skip
def test_published_config_converts_and_parity_report_passes(tmp_path, capsys, config):
    """Published MoE configs: every field classified, ``show --json`` carries the MoE block, and
    ``parity-report --random-weights --scale tiny`` passes on the CPU. Qwen1.5-MoE-A2.7B carries the
    legacy ``expert_interval``; Kimi-K2's ``model_type: kimi_k2`` names remote code (``auto_map``),
    which never runs: the DeepSeek-V3 classes read it."""
    import json

    from mcore_zoo.cli import main

    from ..conftest import CONFIGS

    published = json.loads((CONFIGS / config).read_text())
    assert main(["show", "--config", str(CONFIGS / config), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    experts = published.get("num_experts", published.get("num_local_experts", published.get("n_routed_experts")))
    assert shown["moe"]["num_experts"] == experts
    assert shown["moe"]["top_k"] == published["num_experts_per_tok"]
    assert shown["moe"]["expert_ffn_hidden_size"] == published.get("moe_intermediate_size", published["intermediate_size"])
    assert shown["transformer_config"]["num_moe_experts"] == experts
    assert all(f["kind"] in ("mapped", "ignored") and f["detail"] for f in shown["fields"])  # all classified
    code = main(["parity-report", "--config", str(CONFIGS / config), "--random-weights", "--scale", "tiny",
                 "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    assert code == 0


@pytest.mark.parametrize("arch_name", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_fused_expert_shards_for_an_engine(mpu, reference_checkpoint, arch_name):
    """vLLM-style fused experts (w13 / w2) for an engine at TP2 x EP2: the four ranks' shards put
    back together are the checkpoint's experts, bit for bit; other tensors pass through."""
    import re

    from safetensors.torch import load_file

    from mcore_zoo.distributed.experts import iter_fused_experts

    ckpt = reference_checkpoint(arch_name)
    source = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        source.update(load_file(str(f)))
    model = _build(ckpt, ckpt)
    moe = mcore_zoo.handle_of(model).arch_config.moe
    shards = {(ep, tp): dict(iter_fused_experts(model, tp=2, ep=2, tp_rank=tp, ep_rank=ep)) for ep in (0, 1) for tp in (0, 1)}
    expert = re.compile(r"^(.*\.)experts\.(\d+)\.(\w+)\.weight$")
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
    checked = 0
    for name, want in source.items():
        m = expert.match(name)
        if not m or m.group(3) not in names:
            assert all(torch.equal(s[name], want) for s in shards.values()), name
            continue
        e, which = int(m.group(2)), names[m.group(3)]
        ep, local = divmod(e, moe.num_experts // 2)
        inter = moe.expert_ffn_hidden_size // 2
        parts = []
        for tp in (0, 1):
            if which == "down":
                parts.append(shards[(ep, tp)][m.group(1) + "experts.w2_weight"][local])
            else:
                w13 = shards[(ep, tp)][m.group(1) + "experts.w13_weight"][local]
                parts.append(w13[:inter] if which == "gate" else w13[inter:])
        got = torch.cat(parts, dim=1 if which == "down" else 0)
        assert torch.equal(got, want), name
        checked += 1
    assert checked == 3 * moe.num_experts * sum(moe.is_moe_layer(i) for i in range(len(model.decoder.layers)))


def test_the_combine_adds_each_tokens_experts_in_hf_order():
    """``hf_order_unpermute`` (the token combine of ``router="hf"`` MoE layers) equals HF's loop of
    per-expert ``index_add_`` in bf16, bit for bit, and its gradient is the gather of the upstream
    gradient. An fp32 accumulation (one rounding at the end) and Megatron-Core's ``scatter_add_``
    are not HF's order: with three experts per token and bf16 outputs they differ here."""
    from mcore_zoo.families.moe.spec import hf_order_unpermute

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts, topk = 50, 16, 8, 3
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        routing_map[t, torch.randperm(experts, generator=gen)[:topk]] = True
    rows = routing_map.T.nonzero()  # expert-major: (expert, token), as the dispatchers permute
    sorted_indices = rows[:, 1]
    x = (torch.randn(len(rows), hidden, generator=gen) * 10).bfloat16()
    hf = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    for e in range(experts):
        sel = rows[:, 0] == e
        hf.index_add_(0, sorted_indices[sel], x[sel])
    got = hf_order_unpermute(x, sorted_indices, (tokens, hidden), topk)
    assert torch.equal(got, hf)
    fp32 = torch.zeros(tokens, hidden).index_add_(0, sorted_indices, x.float()).bfloat16()
    stock = torch.zeros(tokens, hidden, dtype=torch.bfloat16).scatter_add_(0, sorted_indices[:, None].expand(-1, hidden), x)
    assert not torch.equal(fp32, hf) and not torch.equal(stock, hf)
    leaf = x.clone().requires_grad_()
    upstream = torch.randn(tokens, hidden, generator=gen).bfloat16()
    (hf_order_unpermute(leaf, sorted_indices, (tokens, hidden), topk).float() * upstream.float()).sum().backward()
    assert torch.equal(leaf.grad, upstream[sorted_indices])


def test_the_grouped_combine_sums_in_hf_top_k_order():
    """``experts="grouped_mm"``: fp32 weighted outputs placed at each token's top-k position and
    summed there (transformers' ``grouped_mm`` experts: ``.view(T, K, H).sum(dim=1)``), cast to bf16
    once; differentiable."""
    from mcore_zoo.families.moe.spec import hf_order_unpermute

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts, topk = 50, 16, 8, 3
    topk_indices = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, topk_indices, True)
    rows = routing_map.T.nonzero()  # expert-major: (expert, token)
    sorted_indices = rows[:, 1]
    x = torch.randn(len(rows), hidden, generator=gen) * 10
    by_slot = torch.zeros(tokens, topk, hidden)
    for i, (e, t) in enumerate(rows.tolist()):
        by_slot[t, (topk_indices[t] == e).nonzero().item()] = x[i]
    want = by_slot.sum(dim=1).bfloat16()
    got = hf_order_unpermute(x, sorted_indices, (tokens, hidden), topk, "grouped_mm", topk_indices,
                             torch.bfloat16)  # fmt: skip
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    eager = hf_order_unpermute(x.bfloat16(), sorted_indices, (tokens, hidden), topk)
    assert not torch.equal(eager, want)
    leaf = x.clone().requires_grad_()
    upstream = torch.randn(tokens, hidden, generator=gen)
    out = hf_order_unpermute(leaf, sorted_indices, (tokens, hidden), topk, "grouped_mm", topk_indices)
    (out * upstream).sum().backward()
    assert torch.equal(leaf.grad, upstream[sorted_indices])


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_parity_report_loads_the_reference_with_the_profiles_experts_kernel(experts, capsys):
    """``parity-report`` loads the transformers reference with the experts implementation the mcore
    model's ``moe_experts`` knob follows (Mixtral, bf16: the two kernels round differently), so the
    bitwise run passes with either."""
    from mcore_zoo.cli import main

    args = ["parity-report", "--arch", "MixtralForCausalLM", "--dtype", "bfloat16", "--device", "cpu", "--bitwise",
            "--backend", "local", "-q", "--no-layers", "--no-baseline", "--knob", f"moe_experts={experts}"]  # fmt: skip
    assert main(args) == 0
    assert f"experts_implementation={experts!r}" in capsys.readouterr().out


def test_remote_code_model_type_checkpoint_works_in_every_command(mpu, reference_checkpoint, tmp_path, capsys):
    """A checkpoint whose config says ``model_type: kimi_k2`` (remote code named in ``auto_map``,
    never run): ``show``, ``convert --hf`` / ``--mcore`` and ``parity-report --model`` all read it
    with the built-in DeepSeek-V3 classes."""
    import json
    import shutil

    from safetensors.torch import load_file

    from mcore_zoo.cli import main

    source = reference_checkpoint("DeepseekV3ForCausalLM")
    kimi = tmp_path / "kimi"
    shutil.copytree(source, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})  # fmt: skip
    (kimi / "config.json").write_text(json.dumps(config))
    assert main(["show", "--config", str(kimi), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "DeepseekV3ForCausalLM"
    assert main(["convert", "--hf", str(kimi), "--out", str(tmp_path / "mcore")]) == 0
    assert main(["convert", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(str(kimi / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["parity-report", "--model", str(kimi), "-q", "--no-layers", "--no-baseline"]) == 0


def test_a_packs_sequences_share_one_stack_of_expert_weights(mpu, reference_checkpoint, monkeypatch):
    """``hf-exact`` runs a THD pack's MoE block one sequence at a time; transformers' ``grouped_mm``
    experts take the experts' weights stacked (a copy of them all, kept for the backward): one stack
    per projection and layer for the whole pack, not one per sequence - with the same logits and
    parameter gradients, bit for bit, as stacking per sequence."""
    import contextlib

    from mcore_zoo.families.moe import grouped_mm, spec

    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", load=ckpt, params_dtype=torch.bfloat16)
    layers = sum(1 for m in model.modules() if type(m).__name__ == "HFOrderSequentialMLP")
    seqs = random_sequences([9, 1, 5, 12, 3], 200, seed=4)
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(grouped_mm.torch, "stack", lambda *a, **k: stacks.append(1) or stack(*a, **k))

    def run():
        stacks.clear()
        model.zero_grad(set_to_none=True)
        logits = mcore_zoo.packed_forward(model, seqs).logits
        sum(x.float().sum() for x in logits).backward()
        return ([x.detach() for x in logits], {n: p.grad.clone() for n, p in model.named_parameters()}, len(stacks))

    shared = run()
    monkeypatch.setattr(spec, "shared_expert_stacks", contextlib.nullcontext)
    each = run()
    assert layers > 0 and shared[2] == 2 * layers and each[2] == 2 * layers * len(seqs), (layers, shared[2], each[2])
    assert all(torch.equal(a, b) for a, b in zip(shared[0], each[0]))
    assert shared[1].keys() == each[1].keys()
    assert all(same_bits(shared[1][n], each[1][n]) for n in shared[1])
