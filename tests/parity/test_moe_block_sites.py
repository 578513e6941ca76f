"""``bench/gpu/moe_block_sites.py`` (the moe-sites phase) on the CPU at the tiny scale: every site of
one MoE block bitwise equal to transformers' on every form (each sequence alone, a THD pack, a BSHD
batch), the shared expert's gate / up GEMMs of transformers' shapes (``shared_expert_gemm="hf"``);
an expert weight perturbed in the zoo's block moves the first differing site to that expert's
``fc1``; gpt-oss's router (it has a bias) on a BSHD batch of two."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


@pytest.fixture(scope="module")
def sites():
    path = ROOT / "bench" / "gpu" / "moe_block_sites.py"
    spec = importlib.util.spec_from_file_location("moe_block_sites", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _args(tmp_path: Path, config: str, *extra: str) -> list[str]:
    return [f"--config={CONFIGS / config}", "--device=cpu", "--scale=tiny", "--lengths=13,7,3", "--batch=2x5",
            f"--out={tmp_path}", *extra]  # fmt: skip


def test_every_site_bitwise_and_a_perturbed_expert_is_named(sites, tmp_path):
    argv = _args(tmp_path, "qwen3-next-80b-a3b.json", "--set=num_hidden_layers=1", "--name=clean")
    assert sites.main(argv) == 0
    report = json.loads((tmp_path / "clean.json").read_text())
    assert list(report["forms"]) == ["alone-13", "alone-7", "alone-3", "thd", "bshd-2x5"]
    for name, form in report["forms"].items():
        compared = {site: entry["max_abs"] for site, entry in form["sites"].items() if entry["max_abs"] is not None}
        assert set(compared) == set(sites.SITES), (name, sorted(set(sites.SITES) - set(compared)))  # gated shared expert
        assert all(value == 0.0 for value in compared.values()), (name, compared)
    assert "| thd | yes | - | 0 |" in (tmp_path / "clean.md").read_text()
    shared = report["forms"]["thd"]["sites"]["shared.gate_proj"]  # shared_expert_gemm="hf": transformers' GEMMs
    assert [g["weight"]["shape"] for g in shared["zoo_gemms"]] == [g["weight"]["shape"] for g in shared["hf_gemms"]]
    routed = max(report["forms"]["thd"]["per_expert"], key=lambda p: p["rows_hf"])["expert"]

    assert sites.main([*argv[:-1], "--name=perturbed", f"--perturb-expert={routed}", "--forms=thd"]) == 1
    form = json.loads((tmp_path / "perturbed.json").read_text())["forms"]["thd"]
    assert form["first_differing_site"] == "experts.fc1" and form["sites"]["experts.fc1"]["first_expert"] == routed
    assert form["sites"]["experts.fc1_input"]["max_abs"] == 0.0 and form["sites"]["router.logits"]["max_abs"] == 0.0
    assert form["isolation"]["expert"] == routed and form["isolation"]["hf_rerun_equal"]
    assert form["isolation"]["verdict"].startswith("the GEMM")


def test_gpt_oss_router_with_bias_on_a_batch(sites, tmp_path):
    """The router logits (a GEMM with a bias) over a batch of two: transformers' contiguous
    batch-major rows, not a strided view whose bias F.linear adds after the GEMM."""
    argv = _args(tmp_path, "gpt-oss-20b.json", "--set=num_hidden_layers=2", "--forms=bshd", "--name=gpt-oss")
    assert sites.main(argv) == 0
    form = json.loads((tmp_path / "gpt-oss.json").read_text())["forms"]["bshd-2x5"]
    assert form["sites"]["router.logits"]["max_abs"] == 0.0 and form["bitwise"], form["first_differing_site"]
