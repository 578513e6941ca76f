"""``bench/gpu/layouts_job.py`` (the 4-GPU several-layouts job, bandwidths, 8B-shaped copy and
offload) runs under torchrun on 4 CPU ranks (gloo, fp32, small models) and reports every part:
the actor at TP2 x PP2 and the critic at PP2 x DP2 against their one-device models, the clipped
gradient norms equal, a policy copy on two of the ranks against its one-device model and refused
on the others, the actor -> reference / policy copies and the offload round trips bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_layouts_job_script_under_torchrun_on_four_cpu_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "bench/gpu/layouts_job.py", "--device", "cpu", "--tiny", "--copy-layers", "4", "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "layouts_job.json").read_text())
    assert report["world_size"] == 4 and report["dtype"] == "float32"
    parts = report["parts"]
    assert not [name for name, entry in parts.items() if "error" in entry], parts
    job = parts["job"]
    assert job["own_groups"] == {"actor": False, "reference": True, "critic": True, "critic-1gpu": True}
    for model in ("actor", "critic"):
        assert job[f"{model}_forward_max_abs_diff"] <= 1e-5, job
        assert job[f"{model}_grad_max_abs_diff"] <= 3e-6, job
        assert abs(job[f"{model}_grad_norm"] - job[f"{model}_grad_norm_1gpu"]) <= 1e-5 * job[f"{model}_grad_norm_1gpu"]
    assert job["copy"]["bitwise"] and job["offload"]["bitwise"], job
    part = parts["part-of-job"]
    assert part["model_ranks"] == [2, 3] and not part["holds_model"], part
    assert "placed on ranks [2, 3]" in part["refused"] and part["copy"]["bytes_received"] == 0, part
    held = [r for r in part["other_ranks"] if r["holds_model"]]
    assert len(held) == 2 and all(r["forward_max_abs_diff"] <= 1e-5 and r["copy"]["bitwise"] for r in held), held
    copy = parts["copy-8b"]
    assert copy["bitwise"] and not copy["bitwise_before_copy"], copy
    assert copy["reference_offload_bitwise"] and copy["actor_offload_every_rank"]["bitwise"], copy
    assert len(copy["copies"]) == 2 and all(r["bytes_received"] >= copy["bytes"] for r in copy["copies"]), copy
    assert parts["bandwidth"]["device_copy"] > 0 and parts["bandwidth"]["nccl_broadcast_actor_pp"] > 0
    table = (tmp_path / "layouts_job.md").read_text()
    assert "| actor |" in table and "| critic |" in table and "Bitwise after the copy: True" in table
