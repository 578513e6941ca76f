"""Phi-3 specifics beyond the conformance suite: the published config, the values the plugin must
refuse, and mutations showing that the example config exercises the sliding window and partial
rotary embedding (a plugin that dropped either would fail parity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo.testing import random_sequences

CONFIGS = Path(__file__).parent / "configs"


def published(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_phi3_mini_4k_instruct_published_config():
    config = published("phi-3-mini-4k-instruct.json")
    plan = mcore_zoo.prepare(config)
    arch, tc = plan.arch_config, plan.transformer_config
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (32, 3072, 8192)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (32, 32, 96)
    assert tc.window_size == (2046, 0) and tc.hidden_dropout == 0.0
    assert not tc.add_bias_linear and not tc.add_qkv_bias and tc.layernorm_epsilon == 1e-5
    assert arch.vocab_size == 32064 and arch.rope.rope_type == "default" and arch.rope.theta == 10000.0
    kinds = {r.field: r.kind for r in arch.fields.records}
    assert kinds["sliding_window"] == "mapped" and kinds["resid_pdrop"] == "mapped"
    assert kinds["attention_bias"] == kinds["embd_pdrop"] == kinds["original_max_position_embeddings"] == "ignored"


def _longrope(rope_type: str) -> dict:
    """The shape of Phi-3.5-mini-instruct's config (factor values are placeholders)."""
    config = published("phi-3-mini-4k-instruct.json")
    config.update(max_position_embeddings=131072, sliding_window=262144, rope_scaling={
        "type": rope_type, "short_factor": [1.0] * 48, "long_factor": [1.5] * 48})  # fmt: skip
    return config


@pytest.mark.parametrize("rope_type", ["longrope", "su", "yarn"])  # transformers maps su/yarn to longrope for Phi-3
def test_longrope_is_refused_with_the_reason(rope_type):
    config = _longrope(rope_type)
    with pytest.raises(mcore_zoo.ConfigError, match="longrope") as err:
        mcore_zoo.lookup(config).config_from_hf(config)
    if isinstance(err.value, mcore_zoo.UnsupportedConfigError):
        assert err.value.field.endswith(".rope_type") and err.value.value == "longrope"
        assert "short_factor" in str(err.value) and "original_max_position_embeddings" in str(err.value)
    else:  # some transformers versions reject the legacy name themselves
        assert rope_type == "su" and "transformers rejects" in str(err.value)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("resid_pdrop", 0.1, "embedding output"),
        ("attention_bias", True, "without biases"),
        ("sliding_window", 0, "positive integer"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),  # disagrees with rope_parameters below
    ],
)
def test_values_the_model_cannot_honour_are_refused(field, value, needle):
    config = published("phi-3-mini-4k-instruct.json")
    config[field] = value
    if field == "partial_rotary_factor":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    with pytest.raises(mcore_zoo.ConfigError, match=needle):
        mcore_zoo.lookup(config).config_from_hf(config)


@pytest.mark.parametrize(
    "overrides,wrong",
    [({}, {"sliding_window": None}), ({"partial_rotary_factor": 0.5}, {"partial_rotary_factor": 1.0})],
    ids=["sliding-window-dropped", "partial-rotary-dropped"],
)
def test_the_example_config_catches_a_dropped_feature(zoo_mpu, zoo_reference_checkpoint, zoo_hf_reference, overrides, wrong):
    """Building the model with the feature switched off must break parity by a wide margin: the
    parity contract would catch a plugin that ignored it."""
    checkpoint = zoo_reference_checkpoint("Phi3ForCausalLM", overrides)
    hf = zoo_hf_reference("Phi3ForCausalLM", checkpoint)
    config = {**mcore_zoo.registry.read_config_dict(checkpoint), **wrong}
    config.pop("rope_parameters", None)  # keep rope_theta / partial_rotary_factor at the top level
    config.setdefault("rope_theta", 10000.0)
    numerics = mcore_zoo.get_profile("default").with_knobs(attention="eager")
    model = mcore_zoo.build_model(config, backend="portable", numerics=numerics, load=checkpoint).eval()
    seqs = random_sequences([50, 37], hf.config.vocab_size)
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs).logits
        diff = max((o - hf(s[None]).logits[0]).abs().max().item() for o, s in zip(out, seqs))
    assert diff > 1e-2
