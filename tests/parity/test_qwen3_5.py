"""Qwen3.5 text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) on the gated DeltaNet family.

The conformance suite (``test_builtin_conformance.py``) runs every contract on both example configs
(bitwise ``hf-exact`` vs transformers on BSHD and THD); ``test_gated_deltanet.py`` checks that the
split input projections reset their convolution window and state at every sequence start of a THD
pack. These tests add the config side: the fields transformers does not read are refused when they
describe another model, Qwen3.5's text M-RoPE is accepted only for these architectures, the
published form of the configs converts with every field classified, and the layouts the layer does
not split (context parallelism) are refused by name.
"""

from __future__ import annotations

import pytest

import mcore_zoo

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"


def _config(arch_name: str, **overrides):
    arch = mcore_zoo.lookup(arch_name)
    return arch.config_from_hf({**arch.example_config(), **overrides})


@pytest.mark.parametrize("arch_name", [DENSE, MOE])
def test_example_converts_to_split_projections_and_their_weight_table(arch_name):
    config = _config(arch_name)
    assert config.gated_deltanet.projections == "split"
    assert config.attention_output_gate and config.zero_centered_norm and config.qk_norm
    assert config.rope.partial_rotary_factor == 0.25 and config.rope.rope_type == "default"
    names = mcore_zoo.lookup(arch_name).weight_map(config).hf_names()
    for tensor in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert f"model.layers.0.linear_attn.{tensor}.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" not in names
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.layers.1.linear_attn.A_log" not in names
    if arch_name == MOE:
        moe = config.moe
        assert moe.layer_pattern is None and moe.normalize_topk and moe.shared_expert_gate
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
        assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    else:
        assert config.moe is None and config.ffn_hidden_size == 128


@pytest.mark.parametrize("arch_name, field, value", [
    (DENSE, "attn_output_gate", False),
    (DENSE, "mlp_only_layers", [1]),
    (MOE, "norm_topk_prob", False),
    (MOE, "decoder_sparse_step", 2),
    (MOE, "mlp_only_layers", [0]),
])  # fmt: skip
def test_fields_transformers_does_not_read_are_refused_when_they_describe_another_model(arch_name, field, value):
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match=field):
        _config(arch_name, **{field: value})


def test_text_mrope_is_checked_and_refused_for_other_architectures():
    rope = dict(mcore_zoo.lookup(DENSE).example_config()["rope_parameters"])
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_section"):
        _config(DENSE, rope_parameters={**rope, "mrope_section": [2, 2]})
    next_rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [2, 1, 1]}  # fmt: skip
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_section"):
        _config("Qwen3NextForCausalLM", rope_parameters=next_rope)


@pytest.mark.parametrize("field", ["vision_config", "text_config"])
def test_vision_language_configs_are_refused_by_name(field):
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match=field):
        _config(DENSE, **{field: {"hidden_size": 64}})


@pytest.mark.parametrize("arch_name", [DENSE, MOE])
def test_published_form_converts_with_every_field_classified(arch_name):
    """A text config in the published form of the Qwen3.5 releases (``full_attention_interval`` with
    ``layer_types``, ``attn_output_gate``, the ``mtp_*`` fields, M-RoPE ``rope_parameters``; sizes
    of the example): every field is classified, and the MTP layer is refused by name unless
    dropped on request."""
    layers = 8
    published = {
        "full_attention_interval": 4, "num_hidden_layers": layers,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        "attn_output_gate": True, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "mlp_only_layers": [], "dtype": "bfloat16", "eos_token_id": 248044, "use_cache": True,
        "initializer_range": 0.02, "attention_dropout": 0.0,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    }  # fmt: skip
    if arch_name == MOE:
        published.update(norm_topk_prob=True, decoder_sparse_step=1)
    arch = mcore_zoo.lookup(arch_name)
    source = {**arch.example_config(), **published}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mtp_num_hidden_layers"):
        arch.config_from_hf(source)
    config = arch.config_from_hf(source, ignore_fields={"mtp_num_hidden_layers": "MTP layer not trained here"})
    assert config.gated_deltanet.layer_types == tuple(published["layer_types"])
    kinds = {r.field: r.kind for r in config.fields.records}
    assert set(published) - {"full_attention_interval"} <= set(kinds)
    assert set(kinds.values()) <= {"mapped", "ignored"}
    assert mcore_zoo.lookup(arch_name).weight_map(config).is_ignored("mtp.layers.0.mlp.gate_proj.weight")


@pytest.mark.parametrize("arch_name", [DENSE, MOE])
@pytest.mark.parametrize("layout, overrides", [({"cp": 2}, {}), ({"tp": 2}, {"linear_num_key_heads": 1})])
def test_layouts_the_layer_does_not_split_are_refused_by_name(arch_name, layout, overrides):
    """Context parallelism and a tensor-parallel size that does not divide the key heads are refused
    by name; TP2 (the MoE model with sequence parallelism) and PP2 of the examples are accepted."""
    from mcore_zoo.config.transformer import validate_layout
    from mcore_zoo.placement import Parallelism

    (field, size), = layout.items()
    with pytest.raises(mcore_zoo.UnsupportedLayoutError, match=f"{field}={size}: the gated DeltaNet layer"):
        validate_layout(_config(arch_name, **overrides), Parallelism(**layout))
    validate_layout(_config(arch_name), Parallelism(pp=2))
    validate_layout(_config(arch_name), Parallelism(tp=2, sequence_parallel=arch_name == MOE))
