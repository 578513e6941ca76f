"""``examples/rl_layouts.py`` runs on a CPU as documented (four gloo processes): the actor at
TP2 x PP2, the reference at TP1 x DP4 and the critic at PP2 x DP2 take one PPO step, the actor's
new weights reach the reference (its log-probs then equal the actor's) and rank 0, pre-split for a
rollout engine at TP 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import ROOT, subprocess_env


@pytest.mark.slow
def test_the_three_layouts_example_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_layouts.py")], capture_output=True, text=True,
                          timeout=1200, env=subprocess_env(), cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
    values = {k.strip(): float(v) for k, v in lines.items() if k.strip() and _number(v)}
    assert values["max_logprob_change"] > 0 and values["critic_loss"] > 0
    assert values["actor_grad_norm"] > 0 and values["critic_grad_norm"] > 0
    assert values["reference_vs_actor"] <= 1e-5  # the copied weights give the actor's log-probs
    assert values["copied_mb"] > 0 and values["offloaded_mb"] > 0 and values["synced_tensors"] > 0


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
