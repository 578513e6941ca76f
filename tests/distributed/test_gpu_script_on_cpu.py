"""``bench/gpu/parallel_parity.py`` (the multi-GPU parity job) runs under torchrun on CPU (gloo,
portable backend, fp32) and reports every layout; a layout that cannot run is recorded, not fatal.
Each layout's export is checked against the checkpoint (bitwise) and each rank's reads are recorded:
an EP rank reads only its own experts. ``bench/gpu/frontier_parity.py`` (the frontier-gpu phase) admits
``te`` in its own process and summarizes its reports. ``bench/gpu/gated_deltanet_speed.py`` runs on a tiny layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_parallel_parity_script_under_torchrun_on_cpu(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "bench/gpu/parallel_parity.py", "--device", "cpu", "--tiny", "--layouts", "tp2,pp2,cp2,tp4",
        "--lengths", "37,64,20", "--out", str(tmp_path),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-4000:]  # tp4 cannot run on 2 ranks
    report = json.loads((tmp_path / "parallel_parity.json").read_text())
    assert report["world_size"] == 2 and report["backend"] == "portable" and report["dtype"] == "float32"
    for name in ("tp2", "pp2", "cp2"):
        entry = report["layouts"][name]
        assert "error" not in entry, entry.get("traceback", entry)
        # fp32 reductions in another order (TP2's split GEMMs): within 1e-5 relative to the logits'
        # scale (measured 1.1e-5 absolute at a largest logit of 5.1 on one CPU, 2.2e-6 relative)
        assert entry["max_abs_dlogit"] <= 1e-5 * max(1.0, entry["max_abs_logit"]), (name, entry)
        assert entry["top1_agreement"] == 1.0, (name, entry)
        assert entry["export_bitwise"], (name, entry["export_mismatches"])
        assert len(entry["reads_per_rank"]) == 2 and entry["reads_per_rank"][0]["bytes_read"] > 0, (name, entry)
    assert "does not fit" in str(report["layouts"]["tp4"]["error"])
    table = (tmp_path / "parallel_parity.md").read_text()
    assert "| cp2 |" in table and "| tp4 | failed" in table
    assert "| pp2 | bitwise |" in table


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "bench/gpu/parallel_parity.py", *args]  # fmt: skip


@pytest.mark.slow
def test_parallel_parity_script_expert_layouts_on_four_cpu_ranks(tmp_path):
    """EP4 and TP2 x EP2 on 4 gloo ranks: within fp32 rounding of one process, the export bitwise,
    and every rank reads a quarter of the expert bytes (EP4: its 1/4 of the experts; TP2 x EP2: its
    TP half of its EP half), none outside its EP range."""
    cmd = _torchrun(4, "--device", "cpu", "--tiny", "--arch", "Qwen3MoeForCausalLM", "--layouts", "ep4,tp2-sp-ep2",
                    "--lengths", "37,64,20", "--out", str(tmp_path))  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "parallel_parity.json").read_text())
    for name in ("ep4", "tp2-sp-ep2"):
        entry = report["layouts"][name]
        assert entry["max_abs_dlogit"] <= 1e-5 * max(1.0, entry["max_abs_logit"]), (name, entry)
        assert entry["export_bitwise"], (name, entry["export_mismatches"])
        reads = entry["reads_per_rank"]
        assert [r["expert_share"] for r in reads] == [0.25] * 4, (name, reads)
        assert all(r["foreign_experts"] == [] for r in reads), (name, reads)
    assert sorted(r["ep_rank"] for r in report["layouts"]["ep4"]["reads_per_rank"]) == [0, 1, 2, 3]
    assert "| ep4 | bitwise |" in (tmp_path / "parallel_parity.md").read_text()


def test_frontier_parity_script_admits_te_and_summarizes_on_cpu(tmp_path):
    """``bench/gpu/frontier_parity.py`` (the frontier-gpu phase): with ``--admit te`` its process sees an
    architecture offering ``te`` beside its declared backends (DeepSeek-V2, whose plugin declares ``local``
    and ``portable``; the frontier and gated DeltaNet plugins declare ``te`` since their GPU runs), runs ``parity-report`` with the rest of the arguments (here on the CPU,
    ``local``), and ``--summarize`` tabulates the reports it finds with transformers' own sdpa-vs-eager row."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = ("import sys; sys.path.insert(0, 'bench/gpu'); import frontier_parity as f;"
             " from mcore_zoo.registry import get_registry;"
             " print(get_registry().get('DeepseekV2ForCausalLM').entry.backends);"
             " get_registry().register(f.admitting_plugin(['DeepseekV2ForCausalLM'], ['te']), 'admit');"
             " print(get_registry().get('DeepseekV2ForCausalLM').entry.backends)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split("\n")[:2] == ["('local', 'portable')", "('local', 'portable', 'te')"], done.stdout
    script = [sys.executable, "bench/gpu/frontier_parity.py"]
    report = ["--arch", "DeepseekV32ForCausalLM", "--backend", "local", "--device", "cpu", "--dtype", "bfloat16",
              "--lengths", "24,12", "-q", "--name", "dsa", "--out", str(tmp_path / "local")]  # fmt: skip
    done = subprocess.run([*script, "--admit", "te", "--", *report], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-4000:]  # a verdict either way, not an error
    notes = json.loads((tmp_path / "local" / "dsa.json").read_text())["notes"]
    assert any("bench/gpu/frontier_parity.py" in n and "override=True" in n for n in notes), notes
    done = subprocess.run([*script, "--summarize", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["architecture"], r["report"]) for r in rows] == [("DeepseekV32ForCausalLM", "local/dsa.md")]
    assert rows[0]["baseline_mean_abs_dlogp"] is not None and "| DeepseekV32ForCausalLM |" in (tmp_path / "summary.md").read_text()


def test_gated_deltanet_speed_script_on_cpu(tmp_path):
    """``bench/gpu/gated_deltanet_speed.py`` (the THD vs BSHD timing of the hybrid-gpu phase) on a tiny
    layer on the CPU: every case timed in every form; the pack run one sequence after the other
    equals the sequences run one by one bitwise, the batched pack equals them within fp32 rounding;
    ``--profile`` writes each profiled form's op table."""
    out = tmp_path / "thd.json"
    cmd = [sys.executable, "bench/gpu/gated_deltanet_speed.py", "--device", "cpu", "--tiny", "--iters", "1",
           "--warmup", "0", "--profile", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"mixed", "many-short"} and report["dtype"] == "float32"
    for name, case in report["cases"].items():
        assert all(case[f"{form}_ms"] > 0 for form in ("thd", "thd_batch", "bshd_padded", "bshd_each")), (name, case)
        assert case["max_abs_diff_each"] == 0.0 and case["max_abs_diff_batch"] <= 1e-5, (name, case)
        for form in ("thd_batch", "bshd_padded"):
            assert case[f"{form}_profile"]["wall_ms"] > 0, (name, form)
            assert "aten::" in (tmp_path / f"thd-{name}-{form}.txt").read_text()
    assert "| mixed |" in out.with_suffix(".md").read_text()


def test_moe_exact_packs_script_on_cpu(tmp_path):
    """``bench/gpu/moe_exact_packs.py`` (the moe-exact-packs phase) at the tiny scale of the
    Qwen3-30B-A3B config on the CPU: a mixed pack, packed and each sequence alone, against
    transformers' grouped_mm experts on each sequence alone - bitwise (``hf-exact`` runs a pack's
    GEMMs one sequence at a time), the JSON rows and the markdown table written."""
    cmd = [sys.executable, "bench/gpu/moe_exact_packs.py", "--device", "cpu", "--tiny", "--models", "qwen3-30b-a3b",
           "--experts", "grouped_mm", "--packs", "mixed=13,7,3,2", "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "moe_exact_packs.json").read_text())
    forms = [(r["model"], r["experts"], r["pack"], r["form"]) for r in report["rows"]]
    assert forms == [("qwen3-30b-a3b", "grouped_mm", "mixed", "packed"), ("qwen3-30b-a3b", "grouped_mm", "mixed", "alone")]
    assert report["all_bitwise"] and all(r["max_abs_dlogit"] == 0.0 for r in report["rows"]), report["rows"]
    assert "| qwen3-30b-a3b | grouped_mm | mixed | packed | yes | 0 |" in (tmp_path / "moe_exact_packs.md").read_text()
