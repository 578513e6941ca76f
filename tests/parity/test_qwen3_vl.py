"""Qwen3-VL, dense (``Qwen3VLForConditionalGeneration``) and MoE
(``Qwen3VLMoeForConditionalGeneration``): vision tower with deepstack, interleaved multimodal RoPE.

CPU fp32, the tiny example configs with random pixels: every config field classified; the
interleaved rotary angles equal transformers' ``Qwen3VLTextRotaryEmbedding``; the 3-D position ids
equal transformers' ``get_rope_index`` (videos split into frames); the ``hf-exact`` logits of a
sample with one image equal transformers' bit for bit and the export (language model, tower,
stacked experts) equals the checkpoint bitwise; a THD pack of three samples with different image
counts and sizes equals each sample run alone and transformers, bitwise.
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed.load import load_hf_weights
from mcore_zoo.testing.common import assert_same

from .vision_samples import (
    END,
    IMAGE,
    START,
    VIDEO,
    check_a_video_sample_in_a_pack,
    check_pack_of_three_samples,
    check_train_step_trains_the_tower,
    image_sample,
)

DENSE, MOE = "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"


def _example(arch: str = DENSE) -> dict:
    return mcore_zoo.lookup(arch).example_config()


def _types(ids: torch.Tensor) -> torch.Tensor:
    return ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None]


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, vision: dict) -> torch.Tensor:
    extra = dict(vision, mm_token_type_ids=_types(ids)) if vision else {}
    with torch.no_grad():
        return hf(input_ids=ids[None], **extra).logits[0]


def _build(checkpoint, backend: str = "local"):  # type: ignore[no-untyped-def]
    model = mcore_zoo.build_model(checkpoint, backend=backend, numerics="hf-exact", params_dtype=torch.float32).eval()
    load_hf_weights(model, checkpoint)
    return model


def test_every_top_level_text_and_vision_field_is_classified():
    for name in (DENSE, MOE):
        config = mcore_zoo.lookup(name).config_from_hf(_example(name))
        records = {r.field: r for r in config.fields.records}
        for field in ("num_position_embeddings", "deepstack_visual_indexes", "hidden_act", "patch_size"):
            assert records[f"vision_config.{field}"].kind == "mapped", field
        assert "interleaved multimodal RoPE" in records["text_config.rope_parameters"].detail
        assert config.rope.mrope_interleaved and config.rope.mrope_section == (6, 3, 3) and config.qk_norm
        assert config.vision.deepstack_visual_indexes == (0, 2) and (config.moe is not None) == (name == MOE)
    example = _example()
    with pytest.raises(mcore_zoo.UnclassifiedConfigFieldsError, match="vision_config.new_field"):
        mcore_zoo.lookup(DENSE).config_from_hf({**example, "vision_config": {**example["vision_config"], "new_field": 1}})
    refused = {"deepstack_visual_indexes": [0, 3], "num_position_embeddings": 15}
    for field, value in refused.items():
        with pytest.raises(mcore_zoo.UnsupportedConfigError, match=f"vision_config.{field}"):
            mcore_zoo.lookup(DENSE).config_from_hf({**example, "vision_config": {**example["vision_config"], field: value}})
    contiguous = {**example["text_config"]["rope_parameters"], "mrope_interleaved": False}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_interleaved"):
        mcore_zoo.lookup(DENSE).config_from_hf({**example, "text_config": {**example["text_config"], "rope_parameters": contiguous}})
    absent = {k: v for k, v in example["text_config"]["rope_parameters"].items() if k != "mrope_interleaved"}
    converted = mcore_zoo.lookup(DENSE).config_from_hf({**example, "text_config": {**example["text_config"], "rope_parameters": absent}})
    assert converted.rope.mrope_interleaved  # transformers interleaves whatever the config says


def test_interleaved_rotary_angles_equal_transformers():
    """The decoder's rotary angles over 3-D position ids: the cos / sin of ours equal transformers'."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from mcore_zoo.families.vision_language.rotary import InterleavedMultimodalRotaryEmbedding

    for sections, head_dim in (([6, 3, 3], 24), ([24, 20, 20], 128)):
        text = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": sections, "mrope_interleaved": True})  # fmt: skip
        theirs = Qwen3VLTextRotaryEmbedding(text)
        ours = InterleavedMultimodalRotaryEmbedding.__new__(InterleavedMultimodalRotaryEmbedding)
        torch.nn.Module.__init__(ours)
        ours.inv_freq, ours.cp_group = theirs.inv_freq.clone(), None
        positions = torch.randint(0, 4000, (3, 1, 37))
        cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
        emb = ours(positions, sections)  # [s, b, 1, 2 * half]
        assert torch.equal(emb.cos()[:, 0, 0], cos[0]) and torch.equal(emb.sin()[:, 0, 0], sin[0])


@pytest.fixture(scope="module")
def dense_checkpoint(reference_checkpoint):
    return reference_checkpoint(DENSE)


@pytest.fixture(scope="module")
def moe_checkpoint(reference_checkpoint):
    return reference_checkpoint(MOE)


def test_position_ids_equal_transformers_get_rope_index(dense_checkpoint, hf_reference):
    """Images, and a video whose frames are separate runs of video tokens (timestamps between)."""
    from mcore_zoo.families.vision_language.positions import mrope_position_ids

    hf = hf_reference(DENSE, dense_checkpoint, "eager")
    spec = mcore_zoo.lookup(DENSE).config_from_hf(_example()).vision
    for seed, grids in enumerate([[(1, 4, 8)], [(1, 6, 4), (1, 4, 4)]]):
        ids, vision = image_sample(seed, grids)
        theirs, _ = hf.model.get_rope_index(ids[None], _types(ids), vision["image_grid_thw"])
        assert torch.equal(mrope_position_ids(ids, spec, vision["image_grid_thw"]), theirs[:, 0])
    frame = lambda: [torch.tensor([7, START]), torch.full((4,), VIDEO), torch.tensor([END])]
    ids = torch.cat([torch.arange(3), *frame(), *frame(), torch.arange(5)])
    grid = torch.tensor([[2, 4, 4]])
    theirs, _ = hf.model.get_rope_index(ids[None], _types(ids), None, grid.clone())
    assert torch.equal(mrope_position_ids(ids, spec, video_grid_thw=grid.clone()), theirs[:, 0])


@pytest.mark.parametrize("name", [DENSE, MOE])
def test_one_image_logits_equal_transformers_bitwise_and_export_round_trips(mpu, reference_checkpoint, hf_reference, name):
    from safetensors.torch import load_file

    checkpoint = reference_checkpoint(name)
    model = mcore_zoo.build_model(checkpoint, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()
    report = load_hf_weights(model, checkpoint)
    assert not any("visual" in n for n in report.ignored)
    hf = hf_reference(name, checkpoint, "eager")
    ids, vision = image_sample(0, [(1, 4, 8)])
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision], return_logprobs=False)
    assert_same(out.logits[0], _hf_logits(hf, ids, vision), "hf-exact logits, one image", exact=True)
    source = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        source.update(load_file(str(shard)))
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(source) and any(n.startswith("model.visual.deepstack_merger_list.") for n in exported)
    assert all(torch.equal(exported[n], source[n]) for n in exported)


def test_deepstack_features_reach_the_decoder(mpu, dense_checkpoint):
    """Zeroing the deepstack mergers' output layer changes the logits after the image (their
    features are added to the first decoder layers), not those before it."""
    model = _build(dense_checkpoint)
    ids, vision = image_sample(0, [(1, 4, 8)])
    with torch.no_grad():
        before = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision], return_logprobs=False).logits[0]
        for merger in model.vision_model.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        after = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision], return_logprobs=False).logits[0]
    first = int((ids == IMAGE).nonzero().min())
    assert torch.equal(before[:first], after[:first]) and not torch.equal(before[first:], after[first:])


@pytest.mark.parametrize("name,backend", [(DENSE, "local"), (DENSE, "portable"), (MOE, "portable")])
def test_a_pack_of_three_samples_equals_each_alone_and_transformers(mpu, reference_checkpoint, hf_reference, name, backend):
    """Each sample alone equals transformers bitwise; in the pack it equals itself alone bitwise,
    the MoE model's too (``hf-exact`` runs a pack's MoE blocks one sequence at a time, so an
    expert's GEMM sees the rows it sees when the sample runs alone)."""
    checkpoint = reference_checkpoint(name)
    model = _build(checkpoint, backend)
    hf = hf_reference(name, checkpoint, "eager")
    check_pack_of_three_samples(model, lambda ids, vision: _hf_logits(hf, ids, vision))



def test_a_video_sample_equals_transformers_bitwise(mpu, dense_checkpoint, hf_reference):
    """A sample with a two-frame video (each frame its own run of video tokens) and an image, in a
    pack with an image-only sample: equal to transformers bit for bit."""
    check_a_video_sample_in_a_pack(_build(dense_checkpoint), hf_reference(DENSE, dense_checkpoint, "eager"))


@pytest.mark.parametrize("fixture,name", [("qwen3-vl-8b-instruct.json", DENSE), ("qwen3-vl-30b-a3b-instruct.json", MOE)])
def test_the_published_configs_convert_with_every_field_classified_and_scale(fixture, name):
    """The published Qwen3-VL-8B-Instruct and Qwen3-VL-30B-A3B-Instruct ``config.json``
    (``tests/fixtures/configs/``): every field classified, the sizes as published; ``--scale tiny``
    shrinks the tower to one block feeding one deepstack merger."""
    import json

    from mcore_zoo.parity.inputs import scale_config

    from ..conftest import CONFIGS

    path = CONFIGS / fixture
    published = json.loads(path.read_text())
    arch = mcore_zoo.lookup(path)
    assert arch.name == name
    converted = arch.config_from_hf(str(path))
    kinds = {r.field: r.kind for r in converted.fields.records}
    assert set(kinds.values()) <= {"mapped", "ignored"}
    assert {f"vision_config.{k}" for k in published["vision_config"]} <= set(kinds)
    renamed = {"rope_scaling", "rope_theta", "num_experts"}  # read as transformers 5 names them
    assert {f"text_config.{k}" for k in set(published["text_config"]) - renamed} <= set(kinds)
    assert kinds["text_config.rope_parameters"] == "mapped"
    assert converted.rope.mrope_section == (24, 20, 20) and converted.rope.mrope_interleaved and converted.qk_norm
    vision = converted.vision
    assert (vision.depth, vision.hidden_size, vision.num_position_embeddings) == (27, 1152, 2304)
    assert vision.deepstack_visual_indexes == (8, 16, 24) and vision.out_hidden_size == converted.hidden_size
    if name == MOE:
        assert (converted.num_layers, converted.moe.num_experts, converted.moe.top_k) == (48, 128, 8)
    else:
        assert (converted.num_layers, converted.hidden_size, converted.num_query_groups) == (36, 4096, 8)
    scaled, _ = scale_config(published, "tiny")
    tiny = arch.config_from_hf(scaled)
    assert tiny.vision.depth == 1 and tiny.vision.deepstack_visual_indexes == (0,) and tiny.rope.mrope_interleaved



def test_train_step_trains_the_tower_through_the_deepstack_features(mpu, dense_checkpoint, hf_reference):
    """``train_step`` over two samples with images: the loss equals transformers' summed
    next-token log-likelihood, and every tower gradient (the deepstack mergers' included) equals
    transformers' within 1e-5."""
    model = _build(dense_checkpoint)
    tower = check_train_step_trains_the_tower(model, hf_reference(DENSE, dense_checkpoint, "eager"))
    assert any(n.startswith("deepstack_merger_list.") for n in tower)
