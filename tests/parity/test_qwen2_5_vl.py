"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): vision tower, multimodal RoPE, packed images.

CPU fp32, the tiny example config with random pixels: every config field classified; the
``hf-exact`` logits of a sample with one image equal transformers' bit for bit; a THD pack of three
samples with different image counts and sizes equals each sample run alone, bitwise (position ids
restart per sample, no attention across samples in the decoder or the tower); the 3-D position ids
equal transformers' ``get_rope_index``; the export (both towers) equals the checkpoint bitwise.
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed.load import load_hf_weights
from mcore_zoo.testing.common import assert_same

from .vision_samples import END, IMAGE, PATCH_VALUES, START, check_pack_of_three_samples, image_sample

ARCH = "Qwen2_5_VLForConditionalGeneration"


def _example() -> dict:
    return mcore_zoo.lookup(ARCH).example_config()


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, vision: dict) -> torch.Tensor:
    extra = dict(vision, mm_token_type_ids=(ids == IMAGE).int()[None]) if vision else {}
    with torch.no_grad():
        return hf(input_ids=ids[None], **extra).logits[0]


@pytest.fixture(scope="module")
def checkpoint(reference_checkpoint):
    return reference_checkpoint(ARCH)


@pytest.fixture
def model(mpu, checkpoint):
    return mcore_zoo.build_model(checkpoint, backend="local", numerics="hf-exact", params_dtype=torch.float32).eval()


def test_every_top_level_text_and_vision_field_is_classified():
    config = mcore_zoo.lookup(ARCH).config_from_hf(_example())
    records = {r.field: r for r in config.fields.records}
    vision = {name: r for name, r in records.items() if name.startswith("vision_config.")}
    for name in ("depth", "hidden_size", "window_size", "fullatt_block_indexes", "spatial_merge_size", "rope_parameters"):
        assert vision[f"vision_config.{name}"].kind == "mapped", name
    assert records["image_token_id"].kind == "mapped" and records["text_config.rope_parameters"].kind == "mapped"
    assert "multimodal RoPE" in records["text_config.rope_parameters"].detail
    assert config.rope.mrope_section == (2, 3, 3) and config.vision.depth == 2 and config.qkv_bias
    with pytest.raises(mcore_zoo.UnclassifiedConfigFieldsError, match="vision_config.new_field"):
        mcore_zoo.lookup(ARCH).config_from_hf({**_example(), "vision_config": {**_example()["vision_config"], "new_field": 1}})
    interleaved = {**_example()["text_config"]["rope_parameters"], "mrope_interleaved": True}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_interleaved"):
        mcore_zoo.lookup(ARCH).config_from_hf({**_example(), "text_config": {**_example()["text_config"], "rope_parameters": interleaved}})
    bad = {**_example()["text_config"]["rope_parameters"], "mrope_section": [2, 2, 2]}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mrope_section"):
        mcore_zoo.lookup(ARCH).config_from_hf({**_example(), "text_config": {**_example()["text_config"], "rope_parameters": bad}})


def test_position_ids_equal_transformers_get_rope_index(checkpoint, hf_reference):
    from mcore_zoo.families.vision_language.positions import mrope_position_ids

    hf = hf_reference(ARCH, checkpoint, "eager")
    spec = mcore_zoo.lookup(ARCH).config_from_hf(_example()).vision
    for seed, grids in enumerate([[(1, 4, 8)], [(1, 6, 4), (1, 4, 4)], []]):
        ids, vision = image_sample(seed, grids)
        ours = mrope_position_ids(ids, spec, vision.get("image_grid_thw"))
        if grids:
            theirs, _ = hf.model.get_rope_index(ids[None], (ids == IMAGE).int()[None], vision["image_grid_thw"])
            assert torch.equal(ours, theirs[:, 0])
        else:
            assert torch.equal(ours, torch.arange(ids.numel()).expand(3, -1))


def test_one_image_logits_equal_transformers_bitwise_and_export_round_trips(model, checkpoint, hf_reference):
    from safetensors.torch import load_file

    report = load_hf_weights(model, checkpoint)
    assert not any(n.startswith("visual.") for n in report.ignored)
    hf = hf_reference(ARCH, checkpoint, "eager")
    ids, vision = image_sample(0, [(1, 4, 8)])
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision], return_logprobs=False)
    assert_same(out.logits[0], _hf_logits(hf, ids, vision), "hf-exact logits, one image", exact=True)
    other = dict(vision, pixel_values=torch.randn_like(vision["pixel_values"]))
    with torch.no_grad():
        moved = mcore_zoo.packed_forward(model, [ids], vision_inputs=[other], return_logprobs=False).logits[0]
    image_end = int((ids == IMAGE).nonzero().max())
    assert torch.equal(moved[:image_end - 7], out.logits[0][:image_end - 7])  # before the image: causal
    assert not torch.equal(moved[image_end:], out.logits[0][image_end:])  # the pixels reach the decoder
    source = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        source.update(load_file(str(shard)))
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(source) and any(n.startswith("visual.") for n in exported)
    assert all(torch.equal(exported[name], source[name]) for name in exported)


@pytest.mark.parametrize("backend", ["local", "portable"])
def test_a_pack_of_three_samples_equals_each_alone_and_transformers(mpu, checkpoint, hf_reference, backend):
    model = mcore_zoo.build_model(checkpoint, backend=backend, numerics="hf-exact", params_dtype=torch.float32).eval()
    load_hf_weights(model, checkpoint)
    hf = hf_reference(ARCH, checkpoint, "eager")
    check_pack_of_three_samples(model, lambda ids, vision: _hf_logits(hf, ids, vision))



def test_vision_inputs_that_do_not_fit_the_tokens_are_refused(model, checkpoint):
    ids, vision = image_sample(0, [(1, 4, 8)])
    with pytest.raises(mcore_zoo.ZooError, match="one per sequence"):
        mcore_zoo.packed_forward(model, [ids], vision_inputs=[])
    with pytest.raises(mcore_zoo.ZooError, match="sequence 0 of the pack: more runs of image tokens"):
        mcore_zoo.packed_forward(model, [ids], vision_inputs=[None])
    with pytest.raises(mcore_zoo.ZooError, match="a run of 8 image tokens, but its grid \\(1, 4, 4\\) merges into 4"):
        mcore_zoo.packed_forward(model, [ids], vision_inputs=[{"pixel_values": vision["pixel_values"][:16],
                                                               "image_grid_thw": torch.tensor([[1, 4, 4]])}])


def test_train_step_takes_vision_inputs_per_sequence_and_trains_the_tower(model, checkpoint, hf_reference):
    """``train_step`` over a pack of two samples (two micro-batches): the loss equals transformers'
    summed next-token log-likelihood of both, and the tower's gradients equal transformers' (1e-5)."""
    load_hf_weights(model, checkpoint)
    model.train()
    for p in model.parameters():
        p.grad = None
    samples = [image_sample(1, [(1, 6, 4), (1, 4, 4)]), image_sample(3, [(1, 8, 8)])]

    def loss_fn(tokens):
        return -(tokens.logprobs * tokens.mask).sum(), {}

    result = mcore_zoo.train_step(model, [s for s, _ in samples], loss_fn, vision_inputs=[v for _, v in samples],
                                  num_microbatches=2)  # fmt: skip
    hf = hf_reference(ARCH, checkpoint, "eager")
    hf_loss = 0.0
    for ids, vision in samples:
        logits = hf(input_ids=ids[None], mm_token_type_ids=(ids == IMAGE).int()[None], **vision).logits[0]
        hf_loss = hf_loss - torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[1:, None]).sum()
    hf_loss.backward()
    torch.testing.assert_close(result.loss, hf_loss.detach(), rtol=1e-6, atol=0)
    tower = dict(model.vision_model.named_parameters())
    checked = [name for name, _ in hf.named_parameters() if name.startswith("model.visual.")]
    assert len(checked) == len(tower)
    for name, param in hf.named_parameters():
        if name.startswith("model.visual."):
            ours = tower[name[len("model.visual."):]].grad
            assert ours is not None and ours.abs().sum() > 0, name
            torch.testing.assert_close(ours, param.grad, rtol=1e-5, atol=1e-5 * float(param.grad.abs().max()))


def test_the_published_config_converts_with_every_field_classified():
    """The published Qwen2.5-VL-7B-Instruct ``config.json`` (``tests/fixtures/configs/``; its text
    fields at the top level, as released): every field classified, the sizes as published."""
    import json

    from ..conftest import CONFIGS

    path = CONFIGS / "qwen2.5-vl-7b-instruct.json"
    published = json.loads(path.read_text())
    arch = mcore_zoo.lookup(path)
    assert arch.name == ARCH
    converted = arch.config_from_hf(str(path))
    kinds = {r.field: r.kind for r in converted.fields.records}
    assert set(kinds.values()) <= {"mapped", "ignored"}
    assert {f"vision_config.{k}" for k in published["vision_config"]} <= set(kinds)
    assert (converted.num_layers, converted.hidden_size, converted.vocab_size, converted.num_query_groups) == (28, 3584, 152064, 4)
    assert converted.rope.mrope_section == (16, 24, 24) and converted.qkv_bias and not converted.tie_word_embeddings
    vision = converted.vision
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size, vision.fullatt_block_indexes) == (32, 1280, 3584, (7, 15, 23, 31))
    assert (vision.window_size, vision.tokens_per_second, vision.image_token_id) == (112, 2, 151655)
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="vision_config.spatial_patch_size"):
        arch.config_from_hf({**published, "vision_config": {**published["vision_config"], "spatial_patch_size": 16}})


def test_a_video_sample_equals_transformers_bitwise(model, checkpoint, hf_reference):
    """A sample with a two-patch-deep video (its frames' temporal position step:
    ``tokens_per_second * second_per_grid_ts``) and an image, in a pack with an image-only sample."""
    load_hf_weights(model, checkpoint)
    hf = hf_reference(ARCH, checkpoint, "eager")
    video_token = 251
    g = torch.Generator().manual_seed(7)
    text = lambda n: torch.randint(0, START, (n,), generator=g)
    ids = torch.cat([text(5), torch.tensor([START]), torch.full((2 * 4 * 4 // 4,), video_token), torch.tensor([END]),
                     text(4), torch.tensor([START]), torch.full((4,), IMAGE), torch.tensor([END]), text(6)])  # fmt: skip
    vision = {"pixel_values_videos": torch.randn(2 * 4 * 4, PATCH_VALUES, generator=g),
              "video_grid_thw": torch.tensor([[2, 4, 4]]), "second_per_grid_ts": torch.tensor([1.5]),
              "pixel_values": torch.randn(16, PATCH_VALUES, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    types = (ids == IMAGE).int() + 2 * (ids == video_token).int()
    with torch.no_grad():
        theirs = hf(input_ids=ids[None], mm_token_type_ids=types[None], **vision).logits[0]
        other, other_vision = image_sample(4, [(1, 4, 8)])
        packed = mcore_zoo.packed_forward(model, [other, ids], vision_inputs=[other_vision, vision], align=8)
    assert_same(packed.logits[1], theirs, "video sample in a pack vs transformers", exact=True)


def test_scaling_the_published_config_shrinks_the_tower_too():
    """``parity-report --scale tiny`` on the published config (text fields at the top level): the
    language model and the tower shrink, the tower's output width follows the language model's."""
    import json

    from mcore_zoo.parity.inputs import scale_config

    from ..conftest import CONFIGS

    published = json.loads((CONFIGS / "qwen2.5-vl-7b-instruct.json").read_text())
    scaled, changes = scale_config(published, "tiny")
    assert scaled["num_hidden_layers"] == 2 and scaled["vision_config"]["depth"] == 1
    assert scaled["vision_config"]["out_hidden_size"] == scaled["hidden_size"] == changes["hidden_size"][1]
    converted = mcore_zoo.lookup(ARCH).config_from_hf(scaled)
    assert converted.vision.hidden_size == 64 and converted.rope.mrope_section == (16, 24, 24)


def test_parity_report_feeds_images_and_is_bitwise(tmp_path):
    """``parity-report --bitwise --invariance`` on the example config: one image of random pixels in
    each sequence long enough for it; the THD pack equals transformers and each sequence alone, bitwise."""
    import json

    from mcore_zoo.cli import main

    code = main(["parity-report", "--arch", ARCH, "--bitwise", "--invariance", "--out", str(tmp_path), "-q",
                 "--format", "json"])  # fmt: skip
    report = json.loads((tmp_path / f"{ARCH}.json").read_text())
    assert code == 0, [c["failures"] for c in report["comparisons"]]
    assert report["inputs"]["vision"]["images"] == 3 and report["inputs"]["vision"]["sequences_with_an_image"] == [0, 1, 2]
    gating = [c for c in report["comparisons"] if c["gating"]]
    assert {c["candidate"] for c in gating} == {"mcore-portable-thd", "mcore-portable-thd-b1"}
    assert all(c["metrics"]["bitwise_equal"] for c in gating)
    parity = next(c for c in gating if c["role"] == "parity")
    tower = [row for row in parity["layers"] if row["site"].startswith("vision.")]
    assert [row["site"] for row in tower] == ["vision.block.0", "vision.block.1", "vision.merger"]
    assert all(row["bitwise_equal"] for row in parity["layers"]) and parity["first_divergent_site"] is None


def test_rope_frequencies_stay_on_the_device_megatron_gave_them(model, monkeypatch):
    """Megatron-Core's ``MultimodalRotaryEmbedding`` never moves ``inv_freq`` (its plain
    ``RotaryEmbedding`` does, on the first forward): the HF frequencies installed in its place must
    sit where Megatron-Core put its own, or the angles are computed on another device than the
    activations (a GPU build would rotate GPU queries by CPU angles) - but on the CPU for a meta
    build, whose frequencies must still hold values."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from mcore_zoo.build import install_rope, rope_frequency_device
    from mcore_zoo.handle import handle_of

    assert rope_frequency_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert rope_frequency_device(torch.device("meta")) == torch.device("cpu")
    rotary = model.rotary_pos_emb
    assert isinstance(rotary, MultimodalRotaryEmbedding)
    expected = rotary.inv_freq.clone()
    rotary.inv_freq = torch.empty_like(rotary.inv_freq, device="meta")  # a meta build's
    handle = handle_of(model)
    install_rope(model, handle.arch_config, handle.numerics)
    assert rotary.inv_freq.device.type == "cpu" and torch.equal(rotary.inv_freq, expected)
    # the install follows the device rope_frequency_device names ("meta" stands in for a GPU here)
    monkeypatch.setattr("mcore_zoo.build.rope_frequency_device", lambda built_on: torch.device("meta"))
    install_rope(model, handle.arch_config, handle.numerics)
    assert rotary.inv_freq.device.type == "meta"
    rotary.inv_freq = expected


def test_parity_report_with_no_images_runs_the_language_model_alone(tmp_path):
    """``--images 0``: text only - no vision inputs on either side, so the formats a pack with images
    cannot take run (here ``local`` on BSHD, Megatron-Core's own attention) and match transformers."""
    import json

    from mcore_zoo.cli import main

    code = main(["parity-report", "--arch", ARCH, "--images", "0", "--backend", "local", "--seq-format", "bshd",
                 "--out", str(tmp_path), "-q", "--format", "json,md"])  # fmt: skip
    report = json.loads((tmp_path / f"{ARCH}.json").read_text())
    assert code == 0, [c["failures"] for c in report["comparisons"]]
    assert report["inputs"]["vision"] == {"images": 0, "text_only": True}
    assert not any(row["site"].startswith("vision.") for c in report["comparisons"] for row in c["layers"])
    assert "text only" in (tmp_path / f"{ARCH}.md").read_text()
