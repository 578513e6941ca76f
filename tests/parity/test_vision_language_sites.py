"""``parity-report``'s per-layer sites of a vision-language model: the tower's blocks, Qwen3-VL's
deepstack mergers and the merger, before the decoder's sites, compared with transformers' own
modules (forward hooks on the same pixels).

CPU fp32, ``hf-exact``, the tiny example configs: every site is bitwise equal; a tower weight
perturbed on the mcore side after loading makes that tower site the first divergent one.
"""

from __future__ import annotations

import json

import pytest
import torch

import mcore_zoo
from mcore_zoo.cli import main


def _parity(out, arch: str) -> dict:
    report = json.loads((out / f"{arch}.json").read_text())
    return next(c for c in report["comparisons"] if c["role"] == "parity")


def _run(arch: str, out) -> tuple[int, dict]:
    code = main(["parity-report", "--arch", arch, "--bitwise", "--no-baseline", "--out", str(out), "-q",
                 "--format", "json"])  # fmt: skip
    return code, _parity(out, arch)


def test_every_site_of_qwen3_vl_is_bitwise_tower_and_deepstack_included(tmp_path):
    code, parity = _run("Qwen3VLForConditionalGeneration", tmp_path)
    assert code == 0 and parity["first_divergent_site"] is None
    sites = [row["site"] for row in parity["layers"]]
    assert sites == ["vision.block.0", "vision.block.1", "vision.block.2", "vision.deepstack.0", "vision.deepstack.1",
                     "vision.merger", "embedding", "layer.0", "layer.1", "final_norm", "logits"]  # fmt: skip
    assert all(row["bitwise_equal"] and row["max_abs"] == 0.0 for row in parity["layers"])


#: (architecture, the tower parameter perturbed after loading, the site that must diverge first)
PERTURBED = [
    ("Qwen2_5_VLForConditionalGeneration", "blocks.1.mlp.down_proj.weight", "vision.block.1"),
    ("Qwen3VLForConditionalGeneration", "deepstack_merger_list.0.linear_fc2.weight", "vision.deepstack.0"),
]


@pytest.mark.parametrize("arch,parameter,site", PERTURBED, ids=["qwen2.5-vl-block", "qwen3-vl-deepstack"])
def test_a_perturbed_tower_weight_is_the_first_divergent_site(tmp_path, monkeypatch, arch, parameter, site):
    build = mcore_zoo.build_model

    def perturbed(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            model.vision_model.get_parameter(parameter).add_(1e-2)
        return model

    monkeypatch.setattr(mcore_zoo, "build_model", perturbed)
    code, parity = _run(arch, tmp_path)
    assert code == 1 and parity["first_divergent_site"] == site
    rows = {row["site"]: row for row in parity["layers"]}
    before = list(rows)[: list(rows).index(site)]
    assert before and all(rows[s]["bitwise_equal"] for s in before)
    assert rows[site]["max_abs"] > 0 and not rows["logits"]["bitwise_equal"]
    if site.startswith("vision.deepstack"):  # level 0 is added to layer 0's output: layer 1 reads it
        assert rows["vision.merger"]["bitwise_equal"] and rows["layer.0"]["bitwise_equal"]
        assert not rows["layer.1"]["bitwise_equal"]


def test_images_and_image_size_place_that_many_grids_in_each_long_enough_sequence():
    """``parity-report --images K --image-size N``: K images of N x N merged features in every
    sequence whose share of K is long enough for one, none in a shorter one, lengths unchanged."""
    from mcore_zoo.parity.inputs import add_images

    plugin = mcore_zoo.lookup("Qwen2_5_VLForConditionalGeneration")
    vision = plugin.config_from_hf(plugin.example_config()).vision
    sequences = [torch.arange(5, 5 + n) for n in (60, 20)]
    out, inputs, info = add_images(sequences, vision, images=2, side=3)
    assert [s.numel() for s in out] == [60, 20] and inputs[1] is None
    assert (out[0] == vision.image_token_id).sum() == 2 * 9 and (out[0] == vision.vision_start_token_id).sum() == 2
    merge = vision.spatial_merge_size
    assert inputs[0]["image_grid_thw"].tolist() == [[1, 3 * merge, 3 * merge]] * 2
    assert inputs[0]["pixel_values"].shape[0] == 2 * 9 * merge**2 and info["images"] == 2


@pytest.mark.parametrize("arch", ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"],
                         ids=["qwen2.5-vl", "qwen3-vl"])
def test_a_bfloat16_tower_equals_transformers_at_every_tower_site(tmp_path, arch):
    """bf16: the tower's rotary inverse frequencies stay float32 when the model is cast (as
    transformers keeps them); rounded to bf16 they move every block's attention."""
    code = main(["parity-report", "--arch", arch, "--dtype", "bfloat16", "--numerics", "hf-exact", "--bitwise",
                 "--no-baseline", "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    tower = [row for row in _parity(tmp_path, arch)["layers"] if row["site"].startswith("vision.")]
    assert tower and all(row["bitwise_equal"] for row in tower), [(r["site"], r["max_abs"]) for r in tower]
    assert code in (0, 1)  # the decoder's bf16 CPU GEMMs are not what this test is about
