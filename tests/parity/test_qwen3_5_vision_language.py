"""Qwen3.5's vision-language models (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): Qwen3-VL's vision tower without deepstack mergers before
the hybrid decoder (gated DeltaNet and gated attention layers) with interleaved multimodal RoPE.

The conformance suite (``test_builtin_conformance.py``) runs every contract on both example configs.
These tests add what it does not check, CPU fp32 against transformers' own models: every
``text_config`` and ``vision_config`` field is classified under its dotted name; a checkpoint
without pixels runs as a text model equal to transformers' on token ids bit for bit; the 3-D
position ids equal transformers' ``get_rope_index``; the ``hf-exact`` logits of a sample with one
image equal transformers' bit for bit and the export (language model and tower) equals the
checkpoint bitwise; a THD pack of three samples with different image counts and sizes equals each
sample run alone (the gated DeltaNet layers' state restarting per sequence) and transformers.
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed.load import load_hf_weights
from mcore_zoo.testing.common import assert_same

from ..conftest import random_sequences
from .vision_samples import (
    END,
    START,
    check_a_video_sample_in_a_pack,
    check_pack_of_three_samples,
    check_train_step_trains_the_tower,
    image_sample,
    image_token_types,
)

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
    for field in ("depth", "out_hidden_size", "num_position_embeddings", "deepstack_visual_indexes", "hidden_act"):
        assert records[f"vision_config.{field}"].kind == "mapped", field
    assert records["image_token_id"].kind == "mapped"
    assert "interleaved multimodal RoPE" in records["text_config.rope_parameters"].detail
    assert config.architecture == arch_name and config.gated_deltanet.projections == "split"
    assert config.hidden_size == 64 and config.num_layers == 4 and (config.moe is not None) == (arch_name == MOE)
    assert config.rope.mrope_interleaved and config.rope.mrope_section == (2, 1, 1)
    assert config.vision.kind == "qwen3_vl" and config.vision.deepstack_visual_indexes == ()


def test_the_tower_fields_that_describe_another_model_are_refused_by_name():
    """Deepstack levels (transformers' Qwen3.5 tower has none), a non-square position grid, merged
    features of another width than the decoder's, contiguous multimodal RoPE sections."""
    arch, example = mcore_zoo.lookup(DENSE), _example(DENSE)
    with pytest.raises(mcore_zoo.UnclassifiedConfigFieldsError, match="vision_config.new_field"):
        arch.config_from_hf({**example, "vision_config": {**example["vision_config"], "new_field": 1}})
    refused = {"deepstack_visual_indexes": [0], "num_position_embeddings": 15, "out_hidden_size": 32}
    for field, value in refused.items():
        with pytest.raises(mcore_zoo.UnsupportedConfigError, match=f"vision_config.{field}"):
            arch.config_from_hf({**example, "vision_config": {**example["vision_config"], field: value}})
    text = example["text_config"]
    contiguous = {**text["rope_parameters"], "mrope_interleaved": False}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_interleaved"):
        arch.config_from_hf({**example, "text_config": {**text, "rope_parameters": contiguous}})
    wrong_sections = {**text["rope_parameters"], "mrope_section": [2, 2, 1]}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_section"):
        arch.config_from_hf({**example, "text_config": {**text, "rope_parameters": wrong_sections}})


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


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, vision: dict) -> torch.Tensor:
    extra = dict(vision, mm_token_type_ids=image_token_types(ids)) if vision else {}
    with torch.no_grad():
        return hf(input_ids=ids[None], **extra).logits[0]


def _source(checkpoint) -> dict:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    source = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        source.update(load_file(str(shard)))
    return source


@ARCHS
def test_the_whole_checkpoint_loads_and_exports_and_text_alone_equals_transformers(mpu, reference_checkpoint,
                                                                                  hf_reference, arch_name, tmp_path):  # fmt: skip
    """Every tensor of the checkpoint loads (``model.visual.*`` into the tower); token ids without
    pixels give the ``local`` ``hf-exact`` logits of transformers' vision-language model bit for
    bit; the export writes exactly the checkpoint's tensors, bitwise, and transformers loads what
    ``save_hf_checkpoint`` writes into the same parameters as from the checkpoint (MoE: stacked
    in memory)."""
    ckpt = reference_checkpoint(arch_name)
    source = _source(ckpt)
    assert any(name.startswith("model.visual.") for name in source)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()
    report = load_hf_weights(model, ckpt)
    assert not any(name.startswith("model.visual.") for name in report.ignored)
    ids = torch.stack(random_sequences([40, 40], 248, seed=1))
    with torch.no_grad():
        logits = model(ids, torch.arange(40).expand(2, -1), None)
        assert_same(logits, hf_reference(arch_name, ckpt, "eager")(ids).logits, "local hf-exact logits", exact=True)
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(source) and any(name.startswith("model.visual.merger.") for name in exported)
    assert all(torch.equal(exported[name], source[name]) for name in exported)
    saved = tmp_path / "saved"
    mcore_zoo.save_hf_checkpoint(model, saved)
    hf = hf_reference(arch_name, ckpt, "eager")
    want, got = hf.state_dict(), type(hf).from_pretrained(saved, dtype=torch.float32).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)


def test_position_ids_equal_transformers_get_rope_index(reference_checkpoint, hf_reference):
    """Images of different sizes, and a video whose frames are separate runs of video tokens."""
    from mcore_zoo.families.vision_language.positions import mrope_position_ids

    ckpt = reference_checkpoint(DENSE)
    hf = hf_reference(DENSE, ckpt, "eager")
    spec = mcore_zoo.lookup(DENSE).config_from_hf(_example(DENSE)).vision
    for seed, grids in enumerate([[(1, 4, 8)], [(1, 6, 4), (1, 4, 4)]]):
        ids, vision = image_sample(seed, grids)
        theirs, _ = hf.model.get_rope_index(ids[None], image_token_types(ids), vision["image_grid_thw"])
        assert torch.equal(mrope_position_ids(ids, spec, vision["image_grid_thw"]), theirs[:, 0])
    video = spec.video_token_id
    frame = lambda: [torch.tensor([7, START]), torch.full((4,), video), torch.tensor([END])]
    ids = torch.cat([torch.arange(3), *frame(), *frame(), torch.arange(5)])
    grid = torch.tensor([[2, 4, 4]])
    theirs, _ = hf.model.get_rope_index(ids[None], 2 * (ids == video).int()[None], None, grid.clone())
    assert torch.equal(mrope_position_ids(ids, spec, video_grid_thw=grid.clone()), theirs[:, 0])


@ARCHS
def test_one_image_and_a_pack_of_three_samples_equal_transformers(mpu, reference_checkpoint, hf_reference, arch_name):
    """``local`` ``hf-exact``: a sample with one image equals transformers bit for bit; in a THD pack
    of three samples (two images, none, one) each sample equals itself alone bitwise (the MoE
    model's too: ``hf-exact`` runs a pack's MoE blocks one sequence at a time), and each alone
    equals transformers bitwise."""
    ckpt = reference_checkpoint(arch_name)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()
    load_hf_weights(model, ckpt)
    hf = hf_reference(arch_name, ckpt, "eager")
    ids, vision = image_sample(0, [(1, 4, 8)])
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision], return_logprobs=False)
    assert_same(out.logits[0], _hf_logits(hf, ids, vision), "hf-exact logits, one image", exact=True)
    check_pack_of_three_samples(model, lambda i, v: _hf_logits(hf, i, v))


@pytest.mark.parametrize("config, arch_name", [("qwen3.5-9b.json", DENSE), ("qwen3.5-35b-a3b.json", MOE)])
def test_published_configs_convert_with_every_field_classified(config, arch_name):
    """The published Qwen3.5-9B and Qwen3.5-35B-A3B ``config.json`` (``tests/fixtures/configs/``): every
    top-level, ``text_config`` and ``vision_config`` field is classified, the tower as published
    (27 blocks, no deepstack levels); the MTP layer they declare is refused by name unless dropped
    on request."""
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
    assert converted.rope.mrope_section == (11, 11, 10) and converted.rope.mrope_interleaved
    assert kinds["vision_config.deepstack_visual_indexes"] == "mapped" and kinds["image_token_id"] == "mapped"
    vision = converted.vision
    assert (vision.depth, vision.hidden_size, vision.num_position_embeddings, vision.patch_size) == (27, 1152, 2304, 16)
    assert vision.deepstack_visual_indexes == () and vision.out_hidden_size == converted.hidden_size
    if arch_name == MOE:
        assert (converted.moe.num_experts, converted.moe.top_k) == (256, 8)


def test_train_step_trains_the_tower_with_the_hybrid_decoder(mpu, reference_checkpoint, hf_reference):
    """``train_step`` with images per sample on the dense model: the loss equals transformers' and
    every tower gradient is within 1e-5 of transformers' (through the gated DeltaNet layers)."""
    ckpt = reference_checkpoint(DENSE)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.float32)
    load_hf_weights(model, ckpt)
    check_train_step_trains_the_tower(model, hf_reference(DENSE, ckpt, "eager"))


def test_a_video_sample_equals_transformers_bitwise(mpu, reference_checkpoint, hf_reference):
    """Qwen3.5's videos as Qwen3-VL's: each frame its own run of video tokens (time interval 1)."""
    ckpt = reference_checkpoint(DENSE)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()
    load_hf_weights(model, ckpt)
    check_a_video_sample_in_a_pack(model, hf_reference(DENSE, ckpt, "eager"))
