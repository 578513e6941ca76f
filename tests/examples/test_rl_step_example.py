"""``examples/rl_step.py`` runs on a CPU as documented and its update changes the actor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import ROOT, subprocess_env


@pytest.mark.slow
def test_the_rl_step_example_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_step.py")], capture_output=True, text=True,
                          timeout=600, env=subprocess_env(), cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line and not line.startswith(" " * 21))
    values = {k.strip(): float(v) for k, v in lines.items() if k.strip() in ("critic_loss", "max_logprob_change", "microbatches")}
    assert values["microbatches"] >= 2 and values["critic_loss"] > 0 and values["max_logprob_change"] > 0
