"""The language model of Qwen3.5's vision-language checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``).

The conformance suite (``test_builtin_conformance.py``) runs every contract on both example configs
(a tiny vision tower beside the text model). These tests add what it does not check: every
``text_config`` and ``vision_config`` field is classified under its dotted name, the vision tower's
tensors are reported as not loaded by name, the logits equal the text path of transformers'
vision-language model bit for bit, and the export writes the checkpoint's language-model tensors.
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed.load import load_hf_weights
from mcore_zoo.testing.common import assert_same

from ..conftest import random_sequences

DENSE, MOE = "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"
ARCHS = pytest.mark.parametrize("arch_name", [DENSE, MOE])


def _example(arch_name: str) -> dict:
    return mcore_zoo.lookup(arch_name).example_config()


@ARCHS
def test_every_text_and_vision_field_is_classified_under_its_dotted_name(arch_name):
    config = mcore_zoo.lookup(arch_name).config_from_hf(_example(arch_name))
    records = {r.field: r for r in config.fields.records}
    assert records["text_config"].kind == "mapped" and records["vision_config"].kind == "mapped"
    assert records["text_config.hidden_size"].kind == "mapped"
    assert records["text_config.linear_num_value_heads"].kind == "mapped"
    vision = [r for name, r in records.items() if name.startswith("vision_config.")]
    assert {"vision_config.depth", "vision_config.out_hidden_size"} <= {r.field for r in vision}
    assert all(r.kind == "ignored" and "vision tower" in r.detail for r in vision)
    assert records["image_token_id"].kind == "ignored"
    assert config.architecture == arch_name and config.gated_deltanet.projections == "split"
    assert config.hidden_size == 64 and config.num_layers == 4 and (config.moe is not None) == (arch_name == MOE)


def test_text_config_fields_are_named_with_their_prefix_in_errors_and_dropped_by_either_name():
    arch = mcore_zoo.lookup(DENSE)
    example = _example(DENSE)
    with pytest.raises(mcore_zoo.UnclassifiedConfigFieldsError, match="text_config.new_field"):
        arch.config_from_hf({**example, "text_config": {**example["text_config"], "new_field": 1}})
    with_mtp = {**example, "text_config": {**example["text_config"], "mtp_num_hidden_layers": 1}}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="text_config.mtp_num_hidden_layers"):
        arch.config_from_hf(with_mtp)
    for name in ("text_config.mtp_num_hidden_layers", "mtp_num_hidden_layers"):
        config = arch.config_from_hf(with_mtp, ignore_fields={name: "MTP layer not trained here"})
        assert config.fields["text_config.mtp_num_hidden_layers"].kind == "ignored"
        assert arch.weight_map(config).is_ignored("mtp.layers.0.mlp.gate_proj.weight")


@ARCHS
def test_language_model_loads_reports_the_vision_tower_and_matches_transformers(mpu, reference_checkpoint,
                                                                                hf_reference, arch_name):  # fmt: skip
    """Every ``model.visual.*`` tensor of the checkpoint is reported as not loaded, by name; the
    ``local`` ``hf-exact`` logits equal transformers' vision-language model on token ids bit for
    bit; the export writes exactly the checkpoint's other tensors, bitwise."""
    from safetensors.torch import load_file

    ckpt = reference_checkpoint(arch_name)
    source = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        source.update(load_file(str(shard)))
    vision = {name for name in source if name.startswith("model.visual.")}
    assert vision and any(name.startswith("model.language_model.layers.") for name in source)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()
    report = load_hf_weights(model, ckpt)
    assert vision <= set(report.ignored) and all("vision tower" in report.ignored[n] for n in vision)
    ids = torch.stack(random_sequences([40, 40], 256, seed=1))
    with torch.no_grad():
        logits = model(ids, torch.arange(40).expand(2, -1), None)
        assert_same(logits, hf_reference(arch_name, ckpt, "eager")(ids).logits, "local hf-exact logits", exact=True)
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(source) - vision
    assert all(torch.equal(exported[name], source[name]) for name in exported)


@pytest.mark.parametrize("config, arch_name", [("qwen3.5-9b.json", DENSE), ("qwen3.5-35b-a3b.json", MOE)])
def test_published_configs_convert_with_every_field_classified(config, arch_name):
    """The published Qwen3.5-9B and Qwen3.5-35B-A3B ``config.json`` (``tests/fixtures/configs/``): every
    top-level, ``text_config`` and ``vision_config`` field is classified; the MTP layer they declare
    is refused by name unless dropped on request."""
    import json

    from ..conftest import CONFIGS

    path = CONFIGS / config
    published = json.loads(path.read_text())
    arch = mcore_zoo.lookup(path)
    assert arch.name == arch_name
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="text_config.mtp_num_hidden_layers"):
        arch.config_from_hf(str(path))
    converted = arch.config_from_hf(str(path), ignore_fields={"mtp_num_hidden_layers": "MTP layer not trained here"})
    kinds = {r.field: r.kind for r in converted.fields.records}
    assert set(kinds.values()) <= {"mapped", "ignored"}
    assert set(published) <= set(kinds)
    renamed = {"full_attention_interval", "partial_rotary_factor"}  # transformers turns them into layer_types, rope_parameters
    assert {f"text_config.{k}" for k in published["text_config"]} - {f"text_config.{k}" for k in renamed} <= set(kinds)
    assert {f"vision_config.{k}" for k in published["vision_config"]} <= set(kinds)
    text = published["text_config"]
    assert (converted.num_layers, converted.hidden_size, converted.vocab_size) == (
        text["num_hidden_layers"], text["hidden_size"], text["vocab_size"])
    assert converted.gated_deltanet.layer_types == tuple(text["layer_types"])
    assert converted.rope.theta == 1e7 and converted.rope.partial_rotary_factor == 0.25
    if arch_name == MOE:
        assert (converted.moe.num_experts, converted.moe.top_k) == (256, 8)
