"""CPU fp32 parity of DeepSeek-V3 (multi-head latent attention + DeepSeek MoE) against the real
transformers model, with and without ``q_lora_rank``, with and without YaRN, and mutations the same
comparison must catch (a wrong YaRN mscale, the RoPE pairs not interleaved, the latent norm eps)."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo

from ..conftest import random_sequences

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
    ckpt, ids, ref = _reference(reference_checkpoint, hf_reference, CASES[case])
    assert torch.equal(_logits(_build(ckpt), ids), ref)


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
