"""HF config -> ArchConfig -> TransformerConfig: real published configs, both transformers forms,
field coverage, rejection of unsupported values, RoPE frequencies bitwise vs transformers."""

from __future__ import annotations

import json

import pytest
import torch

import mcore_zoo
from mcore_zoo.build import prepare
from mcore_zoo.placement import Parallelism
from mcore_zoo.config.common import GENERIC_IGNORED, classify_common_fields
from mcore_zoo.config.reader import ConfigReader
from mcore_zoo.config.rope import hf_rope_reference, inv_freq, read_rope
from mcore_zoo.errors import LayoutError, UnclassifiedConfigFieldsError, UnknownArchitectureError, UnsupportedConfigError

from ..conftest import CONFIGS, case_config

#: every built-in architecture (the zoo's own entry points)
BUILTIN_ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM",
                 "DeepseekV2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


def tconfig(source, **kw):
    plan = prepare(source, **kw)
    arch, config = plan.arch_config, plan.transformer_config
    return arch, config


# ---------------------------------------------------------------------------- full-size configs
def test_llama_3_1_8b_published_config():
    arch, tc = tconfig(str(CONFIGS / "llama-3.1-8b.json"))
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (32, 4096, 14336)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (32, 8, 128)
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and not tc.add_qkv_bias and not tc.qk_layernorm
    assert arch.vocab_size == 128256 and arch.max_position_embeddings == 131072
    assert not arch.tie_word_embeddings
    rope = arch.rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (1.0, 4.0, 8192)


def test_qwen2_5_7b_published_config():
    arch, tc = tconfig(str(CONFIGS / "qwen2.5-7b.json"))
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (28, 3584, 18944)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (28, 4, 128)
    assert tc.add_qkv_bias and not tc.add_bias_linear
    assert tc.layernorm_epsilon == 1e-6 and tc.window_size is None
    assert arch.rope.theta == 1e6 and arch.rope.rope_type == "default"
    assert arch.fields["use_sliding_window"].kind == "ignored"
    assert arch.fields["use_mrope"].kind == "ignored"


def _from_class(model_type, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


FULL_SIZE = [
    # (id, config kwargs as published, expected TransformerConfig / arch values)
    (
        "llama-2-7b",
        dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
             vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
        dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_query_groups=32, kv_channels=128,
             layernorm_epsilon=1e-5),
    ),
    (
        "llama-3.2-1b",
        dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
             vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
             rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_query_groups=8, kv_channels=64),
    ),
    (
        "mistral-7b-v0.1",
        dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
             vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096),
        dict(num_layers=32, ffn_hidden_size=14336, num_query_groups=8, kv_channels=128, window_size=(4095, 0)),
    ),
    (
        "qwen2.5-0.5b",
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
             vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
             use_sliding_window=False, sliding_window=32768, max_window_layers=21),
        dict(num_layers=24, hidden_size=896, num_query_groups=2, kv_channels=64, add_qkv_bias=True, window_size=None),
    ),
    (
        "qwen3-8b",
        dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
             vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
             attention_bias=False, use_sliding_window=False, max_window_layers=36),
        dict(num_layers=36, ffn_hidden_size=12288, kv_channels=128, qk_layernorm=True, add_qkv_bias=False),
    ),
    (
        "qwen3-0.6b",
        dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
             vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
             attention_bias=False, use_sliding_window=False, max_window_layers=28),
        dict(hidden_size=1024, num_attention_heads=16, kv_channels=128, qk_layernorm=True),
    ),
]  # fmt: skip


@pytest.mark.parametrize("case_id,kwargs,expected", FULL_SIZE, ids=[c[0] for c in FULL_SIZE])
def test_full_size_configs_from_transformers_classes(case_id, kwargs, expected):
    kwargs = dict(kwargs)
    config = _from_class(kwargs.pop("model_type"), **kwargs)
    arch, tc = tconfig(config)
    for field, value in expected.items():
        got = getattr(tc, field)
        assert (tuple(got) if isinstance(got, list) else got) == value, f"{case_id}: {field}"
    assert arch.tie_word_embeddings == kwargs.get("tie_word_embeddings", False)
    assert arch.vocab_size == kwargs["vocab_size"]


def test_unsupported_published_architectures_are_named():
    config = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64}
    with pytest.raises(UnknownArchitectureError) as err:
        mcore_zoo.lookup(config)
    assert "FalconForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)


# ---------------------------------------------------------------------------- transformers 4.x / 5.x
def test_rope_reader_accepts_both_transformers_forms():
    v4 = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip
    r4, r5 = ConfigReader(v4, "X"), ConfigReader(v5, "X")
    spec4 = read_rope(r4, max_position_embeddings=131072)
    spec5 = read_rope(r5, max_position_embeddings=131072)
    assert spec4 == spec5
    assert not r4.unclassified() and not r5.unclassified()


def test_transformers_4_style_raw_dict_converts():
    raw = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())  # rope_theta + rope_scaling
    arch = mcore_zoo.lookup(raw).config_from_hf(raw)
    assert arch.rope.rope_type == "llama3" and arch.rope.theta == 500000.0


# ---------------------------------------------------------------------------- fail closed
def test_unclassified_field_is_an_error_naming_it():
    config = case_config("LlamaForCausalLM", {"shiny_new_knob": 3})
    with pytest.raises(UnclassifiedConfigFieldsError) as err:
        mcore_zoo.lookup(config).config_from_hf(config)
    assert "shiny_new_knob" in str(err.value) and "LlamaForCausalLM" in str(err.value)
    arch = mcore_zoo.lookup(config).config_from_hf(config, ignore_fields={"shiny_new_knob": "known harmless"})
    assert arch.fields["shiny_new_knob"].kind == "ignored"


@pytest.mark.parametrize(
    "arch_name,overrides,field",
    [
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "rope_type"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": False}, "mlp_bias"),
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("Qwen2ForCausalLM", {"use_mrope": True}, "use_mrope"),
        ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("MistralForCausalLM", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_values_raise_naming_field_and_value(arch_name, overrides, field):
    config = case_config(arch_name, overrides)
    with pytest.raises((UnsupportedConfigError, mcore_zoo.ConfigError)) as err:
        mcore_zoo.lookup(config).config_from_hf(config)
    assert field in str(err.value)
    assert arch_name in str(err.value) or "transformers rejects" in str(err.value)


def test_every_generic_pretrained_config_field_is_classified():
    """A new PretrainedConfig base field must be classified before it can pass silently."""
    from transformers import PretrainedConfig

    fields = PretrainedConfig().to_dict()
    reader = ConfigReader(fields, "Base")
    classify_common_fields(reader)
    assert not reader.unclassified(), f"unclassified generic fields: {sorted(reader.unclassified())}"
    assert "architectures" in GENERIC_IGNORED


def test_every_field_of_each_example_config_has_a_classification():
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        a = mcore_zoo.lookup(name)
        arch = a.config_from_hf(a.example_config())
        assert {r.kind for r in arch.fields.records} <= {"mapped", "ignored"}
        assert {r.field for r in arch.fields.records if r.present or r.field in arch.hf_config} == set(arch.hf_config)


# ---------------------------------------------------------------------------- RoPE
ROPE_CASES = [
    ("default", {"rope_scaling": None}),
    ("linear", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama3", {}),
    ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    ("yarn-mscale", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                       "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}}),
    ("partial", {"rope_scaling": None, "partial_rotary_factor": 0.5}),
]  # fmt: skip


@pytest.mark.parametrize("case_id,overrides", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_frequencies_bitwise_vs_transformers(case_id, overrides):
    from mcore_zoo.parity.reference import hf_config_object

    config = case_config("LlamaForCausalLM", overrides)
    arch = mcore_zoo.lookup(config).config_from_hf(config)
    ours, scale = inv_freq(arch.rope, arch.head_dim, arch.max_position_embeddings)
    ref, ref_scale = hf_rope_reference(hf_config_object(config))
    assert torch.equal(ours, ref.float()), case_id
    assert scale == ref_scale


def test_yarn_attention_factor_reaches_mcore_config():
    config = case_config("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 128}})  # fmt: skip
    arch, tc = tconfig(config)
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from mcore_zoo.config.rope import yarn_attention_factor

    assert _yarn_get_concentration_factor_from_config(tc) == yarn_attention_factor(arch.rope)


# ---------------------------------------------------------------------------- layouts and overrides
@pytest.mark.parametrize(
    "parallel,needle",
    [
        (Parallelism(tp=3), "num_attention_heads=4 is not divisible by tp=3"),
        (Parallelism(tp=4), "num_key_value_heads=2 is not divisible by tp=4"),
        (Parallelism(pp=3), "num_hidden_layers=2 is not divisible"),
        (Parallelism(pp=2, vpp=2), "num_hidden_layers=2 is not divisible by pp*vpp=2*2"),
        (Parallelism(sequence_parallel=True), "sequence_parallel needs tp > 1"),
    ],
)
def test_layout_that_does_not_divide_the_model_is_rejected(parallel, needle):
    with pytest.raises(LayoutError, match=needle.replace("*", r"\*")):
        prepare(case_config("LlamaForCausalLM", {}), parallel=parallel)


def test_vocab_not_divisible_by_tp():
    with pytest.raises(LayoutError, match="vocab_size=255 is not divisible by tp=2"):
        prepare(case_config("LlamaForCausalLM", {"vocab_size": 255}), parallel=Parallelism(tp=2))


def test_parallel_sizes_and_overrides_apply():
    plan = prepare(
        case_config("LlamaForCausalLM", {}),
        parallel=Parallelism(tp=2, pp=2, cp=2, sequence_parallel=True),
        overrides={"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    )
    tc = plan.transformer_config
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size, tc.context_parallel_size) == (2, 2, 2)
    assert tc.sequence_parallel and tc.recompute_granularity == "full"
    with pytest.raises(mcore_zoo.ConfigError, match="no_such_field"):
        prepare(case_config("LlamaForCausalLM", {}), overrides={"no_such_field": 1})


def test_one_build_request_serves_prepare_build_model_model_provider_and_meta_model():
    """The build options are one typed object: a ``BuildRequest`` and the same options as keywords
    give the same plan; keywords amend a request; an unknown option is a TypeError naming it."""
    from dataclasses import fields

    from mcore_zoo.build import BuildRequest, model_provider
    from mcore_zoo.distributed.build import build_model
    from mcore_zoo.dist_checkpoint import meta_model

    config = case_config("Qwen3ForCausalLM", {})
    request = BuildRequest(backend="portable", numerics="hf-exact", params_dtype=torch.bfloat16,
                           overrides={"recompute_granularity": "full", "recompute_method": "uniform",
                                      "recompute_num_layers": 1})  # fmt: skip
    by_request, by_keywords = prepare(config, request), prepare(config, **{f.name: getattr(request, f.name) for f in fields(request)})
    assert by_request.options == by_keywords.options and by_request.arch_config == by_keywords.arch_config
    assert by_request.options.backend == "portable" and by_request.options.numerics.name == "hf-exact"
    assert by_request.transformer_config.recompute_granularity == "full"
    assert prepare(config, request, backend="local").options.backend == "local"
    with pytest.raises(TypeError, match=r"unknown build option\(s\) \['bakend'\]"):
        prepare(config, request, bakend="te")
    with pytest.raises(TypeError, match="unknown build option"):
        build_model(config, request, bakend="te")
    with pytest.raises(TypeError, match="perform_initialization"):
        build_model(config, request, perform_initialization=False)
    provider = model_provider(config, request, backend="local")
    assert provider.transformer_config.recompute_granularity == "full" and provider.transformer_config.bf16
    model = meta_model(config, request)
    assert next(model.parameters()).device.type == "meta" and next(model.parameters()).dtype is torch.bfloat16
    assert model.mcore_zoo.options.backend == "portable"


def test_bf16_sets_mixed_precision_flags():
    tc = prepare(case_config("Qwen3ForCausalLM", {}), params_dtype=torch.bfloat16).transformer_config
    assert tc.bf16 and tc.params_dtype is torch.bfloat16 and not tc.fp16


def test_partial_rotary_factor_duplicated_in_rope_parameters():
    """transformers 5 copies a top-level ``partial_rotary_factor`` into ``rope_parameters``: the copy
    is classified as a duplicate; a disagreeing copy is refused (transformers would use the inner one)."""
    base = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    reader = ConfigReader({**base, "partial_rotary_factor": 0.5}, "X")
    assert read_rope(reader, max_position_embeddings=64).partial_rotary_factor == 0.5
    assert reader.records["partial_rotary_factor"].kind == "ignored"
    with pytest.raises(UnsupportedConfigError, match="partial_rotary_factor=0.25"):
        read_rope(ConfigReader({**base, "partial_rotary_factor": 0.25}, "X"), max_position_embeddings=64)


def test_config_class_validation_errors_become_config_errors():
    """transformers' own validators raise KeyError / ValueError; the zoo reports a ConfigError."""
    config = case_config("LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn"}})  # yarn needs a factor
    with pytest.raises(mcore_zoo.ConfigError, match="transformers rejects"):
        mcore_zoo.lookup(config).config_from_hf(config)


@pytest.mark.parametrize("arch_name", BUILTIN_ARCHS)
def test_every_field_the_installed_transformers_saves_is_classified(arch_name, tmp_path):
    """Each built-in's transformers config class, saved by the installed transformers
    (``save_pretrained`` writes the fields that version adds, e.g. 5.17's ``expert_interval``
    for Qwen2-MoE), converts: every field it serialises is classified, none is left over."""
    from transformers import CONFIG_MAPPING

    arch = mcore_zoo.lookup(arch_name)
    example = arch.example_config()
    config = CONFIG_MAPPING[example.pop("model_type")](**example)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    converted = arch.config_from_hf(str(tmp_path))  # raises UnclassifiedConfigFieldsError naming any left over
    classified = set(converted.fields.fields()) | set(GENERIC_IGNORED)
    assert set(saved) <= classified | {"model_type"}, sorted(set(saved) - classified)
    assert {r.kind for r in converted.fields.records} <= {"mapped", "ignored"}


@pytest.mark.parametrize("config_file, arch_name", [("qwen1.5-moe-a2.7b.json", "Qwen2MoeForCausalLM"),
                                                    ("kimi-k2-instruct.json", "DeepseekV3ForCausalLM")])  # fmt: skip
def test_published_configs_with_legacy_or_remote_code_fields(config_file, arch_name):
    """Qwen1.5-MoE-A2.7B (``expert_interval``) and Kimi-K2 (``model_type: kimi_k2`` with remote
    code in ``auto_map``), fields as published, convert without remote code."""
    raw = json.loads((CONFIGS / config_file).read_text())
    arch = mcore_zoo.lookup(raw)
    assert arch.name == arch_name
    converted = arch.config_from_hf(raw)
    assert converted.moe is not None and converted.num_layers == raw["num_hidden_layers"]
    assert "model_type" in converted.hf_config


def test_expert_interval_that_contradicts_the_sparse_step_is_refused():
    raw = json.loads((CONFIGS / "qwen1.5-moe-a2.7b.json").read_text())
    with pytest.raises(UnsupportedConfigError, match="expert_interval"):
        mcore_zoo.lookup(raw).config_from_hf(dict(raw, expert_interval=2))
