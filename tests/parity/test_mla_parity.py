"""CPU fp32 parity of DeepSeek-V3 (multi-head latent attention + DeepSeek MoE) against the real
transformers model, with and without ``q_lora_rank``, with and without YaRN, and mutations the same
comparison must catch (a wrong YaRN mscale, the RoPE pairs not interleaved, the latent norm eps)."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo

from ..conftest import random_sequences, require_current_deepseek_v2_reference
from .packs import assert_packs_equal_alone

ARCH = "DeepseekV3ForCausalLM"
NO_YARN = {"rope_scaling": None}
CASES = {
    "q_lora+yarn": {},
    "no_q_lora+yarn": {"q_lora_rank": None},
    "q_lora+default_rope": NO_YARN,
    "yarn_mscale_ratio": {"rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                           "mscale": 0.707, "mscale_all_dim": 1.0}},  # fmt: skip
}


def _build(ckpt):
    return mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", load=ckpt, params_dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)


def _reference(reference_checkpoint, hf_reference, overrides):
    ckpt = reference_checkpoint(ARCH, overrides)
    hf = hf_reference(ARCH, ckpt, "eager")
    ids = torch.stack(random_sequences([48, 48], hf.config.vocab_size, seed=1))
    with torch.no_grad():
        ref = hf(ids).logits
    return ckpt, ids, ref


@pytest.mark.parametrize("case", list(CASES))
def test_hf_exact_bitwise(mpu, reference_checkpoint, hf_reference, case):
    """A BSHD batch; with and without q_lora (two sets of linears), THD packs of mixed and many short
    sequences too, each sequence equal to transformers on it alone (``pack_gemms="each"``)."""
    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, CASES[case])
    model = _build(ckpt)
    assert torch.equal(_logits(model, ids), ref)
    if case in ("q_lora+yarn", "no_q_lora+yarn"):
        assert_packs_equal_alone(model, hf_reference(ARCH, ckpt, "eager"))


def test_no_q_lora_layer_is_built_as_the_spec_names(mpu, reference_checkpoint):
    """Without ``q_lora_rank``: one plain ``linear_q_proj`` (no q norm, none fused into it), the kv
    latent norm a separate module at HF's 1e-6 - on 0.19 too, whose own resolver would fuse a norm
    into ``linear_q_proj`` or refuse. A layer built with other up projections is refused."""
    from types import SimpleNamespace

    from megatron.core.transformer.identity_op import IdentityOp

    from mcore_zoo.errors import ZooError
    from mcore_zoo.families.mla.spec import _check_built_as_specified

    model = _build(reference_checkpoint(ARCH, {"q_lora_rank": None, "rms_norm_eps": 1e-2}))
    attn = model.decoder.layers[0].self_attention
    children = dict(attn.named_children())
    assert "q_layernorm" not in children and "linear_q_up_proj" not in children
    assert not hasattr(attn.linear_q_proj, "layer_norm_weight")
    assert attn.kv_layernorm.variance_epsilon == 1e-6
    spec = SimpleNamespace(linear_q_proj=type(attn.linear_q_proj), linear_kv_up_proj=type(attn.linear_kv_up_proj))
    _check_built_as_specified(attn, spec)
    attn.linear_q_proj = IdentityOp()
    with pytest.raises(ZooError, match="linear_q_proj"):
        _check_built_as_specified(attn, spec)


def test_wrong_mscale_fails(mpu, reference_checkpoint, hf_reference):
    """The softmax scale without YaRN's mscale(factor, mscale_all_dim)**2 must move the logits."""
    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, {})
    model = _build(ckpt)
    for layer in model.decoder.layers:
        attn = layer.self_attention
        attn.core_attention.scale = attn.q_head_dim ** -0.5
    assert (_logits(model, ids) - ref).abs().max() > 1e-3


def test_wrong_rope_attention_factor_fails(mpu, reference_checkpoint, hf_reference):
    """cos / sin without HF's YaRN attention factor (mscale / mscale_all_dim != 1 here) must fail."""
    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, CASES["yarn_mscale_ratio"])
    model = _build(ckpt)
    for layer in model.decoder.layers:
        layer.self_attention.rotary_pos_emb.attention_scaling = 1.0
    assert (_logits(model, ids) - ref).abs().max() > 1e-3


def test_rope_pairs_not_interleaved_fails(mpu, reference_checkpoint, hf_reference, monkeypatch):
    """Rotating the rope dims as halves instead of interleaved pairs must fail."""
    from megatron.core.models.common.embeddings import rope_utils

    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, {})
    model = _build(ckpt)
    plain = rope_utils._apply_rotary_pos_emb_bshd
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd",
                        lambda *a, **kw: plain(*a, **dict(kw, multi_latent_attention=False)))  # fmt: skip
    assert (_logits(model, ids) - ref).abs().max() > 1e-3


def test_latent_norm_eps_matters(mpu, reference_checkpoint, hf_reference):
    """HF's latent norms use 1e-6 whatever rms_norm_eps says; a model built with rms_norm_eps=1e-2
    stays bitwise only because the zoo keeps them at 1e-6 (mcore would use layernorm_epsilon)."""
    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, {"rms_norm_eps": 1e-2})
    model = _build(ckpt)
    assert torch.equal(_logits(model, ids), ref)
    for layer in model.decoder.layers:
        layer.self_attention.kv_layernorm.variance_epsilon = 1e-2
    assert not torch.equal(_logits(model, ids), ref)


def test_published_config_every_field_classified(mpu):
    """DeepSeek-V3's published config (remote code named in auto_map, FP8 quantization_config, one MTP
    layer): read with transformers' built-in config class, every field classified, the MTP layer
    built (``model.layers.61.*`` mapped) or dropped explicitly (ignored); the remote code is named,
    never run."""
    from pathlib import Path

    from mcore_zoo.registry import get_registry, lookup

    path = Path(__file__).parents[1] / "fixtures" / "configs" / "deepseek-v3.json"
    arch = lookup(str(path))
    assert arch.name == ARCH
    converted = arch.config_from_hf(str(path))
    assert converted.mtp_num_layers == 1 and converted.mtp_layer_moe
    built = get_registry().get(ARCH).weight_map(converted)
    assert {"model.layers.61.eh_proj.weight", "model.layers.61.mlp.experts.255.down_proj.weight"} <= built.hf_names()
    assert built.copies_of("lm_head.weight") == ["model.layers.61.shared_head.head.weight"]
    converted = arch.config_from_hf(str(path), ignore_fields={"num_nextn_predict_layers": "not trained"})
    fields = converted.fields
    assert "configuration_deepseek.DeepseekV3Config" in fields["auto_map"].detail
    assert "never executed" in fields["auto_map"].detail
    assert fields["quantization_config"].kind == "mapped" and "dequantized" in fields["quantization_config"].detail
    assert converted.mla.q_lora_rank == 1536 and converted.mla.kv_lora_rank == 512
    assert converted.moe.num_groups == 8 and converted.moe.group_topk == 4 and converted.moe.layer_pattern[:4] == (
        False, False, False, True)
    wmap = get_registry().get(ARCH).weight_map(converted)
    assert wmap.is_ignored("model.layers.61.eh_proj.weight") and not wmap.is_ignored("model.layers.60.mlp.gate.weight")


def test_export_config_states_the_v3_routing_the_model_computes(mpu, tmp_path):
    """A DeepSeek-V3 config without ``scoring_func`` / ``topk_method`` (transformers' own config class
    has neither) is read as transformers' model computes it, and the export's config.json says so:
    vLLM reads their absence as softmax scoring without the score-correction bias, then fails on the
    bias tensor the export carries. A stated value is kept as it is."""
    import json

    from mcore_zoo.registry import get_registry
    from mcore_zoo.weights.export import hf_config_for_export

    arch = get_registry().get(ARCH)
    source = {k: v for k, v in arch.example_config().items() if k not in ("scoring_func", "topk_method")}
    converted = arch.config_from_hf(source)
    assert converted.hf_config["scoring_func"] == "sigmoid" and converted.hf_config["topk_method"] == "noaux_tc"
    assert not converted.fields["scoring_func"].present  # still reported as absent from the source
    model = mcore_zoo.build_model(source, backend="portable")
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["scoring_func"] == "sigmoid" and written["topk_method"] == "noaux_tc"
    assert hf_config_for_export(mcore_zoo.handle_of(model).arch_config)["topk_method"] == "noaux_tc"
    stated = arch.config_from_hf({**source, "scoring_func": "sigmoid"})
    assert stated.fields["scoring_func"].present


def test_foreign_model_type_read_with_builtin_config(mpu):
    """Kimi-K2 names model_type 'kimi_k2' (remote code): read with transformers' DeepseekV3Config."""
    from mcore_zoo.registry import get_registry

    arch = get_registry().get(ARCH)
    config = dict(arch.entry.example_config, model_type="kimi_k2",
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})  # fmt: skip
    config.pop("rope_scaling")
    converted = arch.config_from_hf(config)
    assert "DeepseekV3Config" in converted.fields["model_type"].detail
    assert converted.fields["rope_interleave"].value is True  # a DeepseekV3Config default: the class was used


# ---------------------------------------------------------------------------- DeepSeek-V2
V2 = "DeepseekV2ForCausalLM"
V2_CASES = {
    "lite_greedy": {},
    "group_limited": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1},
    "q_lora": {"q_lora_rank": 32, "routed_scaling_factor": 16.0},
}


def _v2(reference_checkpoint, hf_reference, overrides):
    require_current_deepseek_v2_reference()
    ckpt = reference_checkpoint(V2, overrides)
    hf = hf_reference(V2, ckpt, "eager")
    ids = torch.stack(random_sequences([48, 48], hf.config.vocab_size, seed=1))
    with torch.no_grad():
        ref = hf(ids).logits
    return ckpt, ids, ref


@pytest.mark.parametrize("case", list(V2_CASES))
def test_v2_hf_exact_bitwise(mpu, reference_checkpoint, hf_reference, case):
    ckpt, ids, ref = _v2(reference_checkpoint, hf_reference, V2_CASES[case])
    assert torch.equal(_logits(_build(ckpt), ids), ref)


def test_v2_real_rope_is_not_bitwise(mpu, reference_checkpoint, hf_reference):
    """Megatron-Core's own MLA RoPE (real arithmetic, pairs de-interleaved) on V2: the same rotation,
    the scores summed in another order - float32-close (measured max |dlogit| 4e-6 on logits ~4),
    not bitwise; the zoo's complex RoPE is what makes V2 exact."""
    ckpt, ids, ref = _v2(reference_checkpoint, hf_reference, {})
    model = _build(ckpt)
    for layer in model.decoder.layers:
        layer.self_attention.rope_complex = False
    diff = (_logits(model, ids) - ref).abs().max()
    assert 0 < diff < 1e-4


def test_v2_group_limited_routing_matters(mpu, reference_checkpoint, hf_reference):
    """The group-limited checkpoint run with greedy routing (the group restriction dropped) must fail."""
    from mcore_zoo.registry import get_registry

    ckpt, ids, ref = _v2(reference_checkpoint, hf_reference, V2_CASES["group_limited"])
    model = _build(ckpt)
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.zoo_moe = get_registry().get(V2).config_from_hf(get_registry().get(V2).entry.example_config).moe
    assert (_logits(model, ids) - ref).abs().max() > 1e-3


def _hf_checkpoint_grads(hf) -> dict:
    """transformers' gradients under the checkpoint's names: its fused routed experts
    (``experts.gate_up_proj`` ``[E, 2I, H]``, gate rows first; ``experts.down_proj`` ``[E, H, I]``)
    split per expert."""
    grads = {}
    for name, param in hf.named_parameters():
        if param.grad is None:
            continue
        if name.endswith(".experts.gate_up_proj"):
            gate, up = param.grad.chunk(2, dim=1)
            for e in range(param.shape[0]):
                grads[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                grads[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith(".experts.down_proj"):
            for e in range(param.shape[0]):
                grads[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = param.grad[e]
        else:
            grads[name] = param.grad
    return grads


@pytest.mark.parametrize("arch,overrides", [(ARCH, {}), (ARCH, {"q_lora_rank": None}), (V2, {})],
                         ids=["v3-q_lora-yarn", "v3-no_q_lora", "v2-lite"])  # fmt: skip
def test_train_step_gradients_match_transformers(mpu, reference_checkpoint, hf_reference, arch, overrides):
    """Training: ``train_step`` on a packed (THD) batch gives every HF tensor the gradient that
    transformers' autograd gives for the same loss (the sum of the next-token log-probs), fp32,
    1e-5 of the largest: MLA with and without ``q_lora_rank`` (latent norms, YaRN RoPE, the V2
    complex RoPE), the DeepSeek router and the routed and shared experts."""
    from mcore_zoo.distributed.train import train_step

    if arch == V2:
        require_current_deepseek_v2_reference()
    ckpt = reference_checkpoint(arch, overrides)
    hf = hf_reference(arch, ckpt, "eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt,
                                  params_dtype=torch.float32).train()  # fmt: skip
    seqs = random_sequences([23, 9, 31], hf.config.vocab_size, seed=5)
    result = train_step(model, seqs, lambda t: (-(t.logprobs * t.mask).sum(), {}))
    ref_loss = 0
    for seq in seqs:
        logits = hf(seq[None]).logits[0]
        ref_loss = ref_loss - torch.log_softmax(logits[:-1].float(), -1).gather(-1, seq[1:, None]).sum()
    ref_loss.backward()
    assert abs(result.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    ref_grads = _hf_checkpoint_grads(hf)
    grads = dict(mcore_zoo.iter_hf_weights(model, grads=True))
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = max(1.0, ref.abs().max().item())
        assert (grad - ref).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.slow
def test_published_config_parity_report(tmp_path):
    """`parity-report --config deepseek-v3.json --random-weights --scale tiny` passes; the report
    records how it treated the FP8 quantization_config and the MTP layer (not carried by random
    weights)."""
    import json
    from pathlib import Path

    from mcore_zoo.cli import main

    config = Path(__file__).parents[1] / "fixtures" / "configs" / "deepseek-v3.json"
    code = main(["parity-report", "--config", str(config), "--random-weights", "--scale", "tiny", "--lengths", "40,9",
                 "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / f"{ARCH}.json").read_text())
    changes = report["model"]["changes"]
    assert changes["quantization_config"][1] is None and changes["quantization_config"][0]["quant_method"] == "fp8"
    assert changes["num_nextn_predict_layers"] == [1, 0] and changes["first_k_dense_replace"] == [3, 1]
