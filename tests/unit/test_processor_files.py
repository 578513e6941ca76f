"""A random-weight vision-language checkpoint carries the transformers processor files an engine
builds at start-up, and the zoo's export carries a checkpoint's processor files over."""

from __future__ import annotations

import json

import pytest

import mcore_zoo

ARCHS = ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration"]


@pytest.mark.parametrize("name", ARCHS)
def test_reference_checkpoint_of_a_vision_language_model_has_its_processor_files(tmp_path, name):
    from transformers import AutoTokenizer

    from mcore_zoo.parity.reference import write_reference_checkpoint

    architecture = mcore_zoo.lookup(name)
    config = architecture.example_config()
    write_reference_checkpoint(architecture, config, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    for field, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                         ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):  # fmt: skip
        assert tokenizer.convert_tokens_to_ids(token) == config[field], token
    image = json.loads((tmp_path / "preprocessor_config.json").read_text())
    vision = config["vision_config"]
    assert image["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (image["patch_size"], image["merge_size"]) == (vision["patch_size"], vision["spatial_merge_size"])


def test_a_text_model_gets_no_processor_files(tmp_path):
    from mcore_zoo.parity.reference import write_reference_checkpoint

    architecture = mcore_zoo.lookup("Qwen3ForCausalLM")
    write_reference_checkpoint(architecture, architecture.example_config(), tmp_path)
    assert not (tmp_path / "preprocessor_config.json").exists() and not (tmp_path / "tokenizer.json").exists()


def test_exports_carry_the_processor_configs(tmp_path):
    from mcore_zoo.hf_assets import copy_assets

    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "config.json"):
        (source / name).write_text("{}")
    assert sorted(copy_assets(source, target)) == ["preprocessor_config.json", "processor_config.json",
                                                   "video_preprocessor_config.json"]  # fmt: skip
