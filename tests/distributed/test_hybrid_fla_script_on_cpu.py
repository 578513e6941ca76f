"""``bench/gpu/hybrid_fla_parity.py`` (the hybrid-fla phase) on the CPU, with a stand-in ``fla`` package
on the path (fla's module layout, no kernels): transformers' gated DeltaNet modeling modules are
imported with fla hidden and resolve to their torch fallbacks, the zoo finds fla, and the same
modules imported again without the hiding would have taken fla's function (the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STANDIN = {
    "fla/__init__.py": "__version__ = '0.0+standin'\n",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": ("def chunk_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError\n"
                                             "def fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw): raise RuntimeError\n"),
    "fla/modules/__init__.py": "class FusedRMSNormGated: pass\n",
    "fla/modules/causal_conv1d.py": "def causal_conv1d(x, weight=None, **kw): raise RuntimeError\n",
}


def test_hf_is_kept_on_its_torch_path_while_the_zoo_finds_fla(tmp_path):
    pytest.importorskip("transformers.models.qwen3_next")
    for name, text in STANDIN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    record = tmp_path / "kernels.json"
    probe = ("import sys, importlib, json; sys.path.insert(0, 'bench/gpu'); import hybrid_fla_parity as h;"
             f" rc = h.main(['--kernels-only', {str(record)!r}]);"
             " sys.modules.pop('transformers.models.qwen3_next.modeling_qwen3_next');"
             " m = importlib.import_module('transformers.models.qwen3_next.modeling_qwen3_next');"
             " print(json.dumps([rc, h.implementation(m.torch_chunk_gated_delta_rule)]))")  # fmt: skip
    path = os.pathsep.join([str(ROOT / "src"), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rc, unhidden = json.loads(done.stdout.strip().splitlines()[-1])
    kernels = json.loads(record.read_text())
    assert rc == 0 and kernels["hf_on_fla"] == []
    next_entries = kernels["hf_kernels"]["qwen3_next.modeling_qwen3_next"]
    assert next_entries["torch_chunk_gated_delta_rule"].startswith("transformers.models.qwen3_next."), next_entries
    assert kernels["zoo_kernels"]["fla"] == "0.0+standin", kernels["zoo_kernels"]
    assert unhidden == "fla.ops.gated_delta_rule.chunk_gated_delta_rule", "without the hiding transformers takes fla"
