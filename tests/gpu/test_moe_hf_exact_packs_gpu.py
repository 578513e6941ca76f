"""bf16 on CUDA: ``hf-exact`` MoE on mixed THD packs at the full width of Qwen3-30B-A3B, Mixtral-8x7B,
DeepSeek-V3 (64 of the 256 routed experts), Qwen3-235B-A22B and Kimi-K2 (64 of the 384 routed
experts), 2 layers, each sequence packed and alone bitwise
equal to transformers on it alone with either experts implementation, on the ``local`` backend and
on ``te`` (its experts' Transformer Engine linears through the same ``grouped_mm`` call)
(``bench/gpu/moe_exact_packs.py``, the moe-exact-packs phase; its report lands under the test's
temporary folder and is printed on failure).

CPU counterparts: ``tests/parity/test_moe_parity.py`` and ``tests/parity/test_mla_parity.py``
(``tests/parity/packs.py``); the script's CPU dry run in ``tests/distributed/test_gpu_script_on_cpu.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("backend", ["local", "te"])
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b", "kimi-k2"])
def test_hf_exact_moe_packs_bitwise(tmp_path, model, backend):
    if backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":0:0", CUBLASLT_WORKSPACE_SIZE="0",  # split-K off
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    cmd = [sys.executable, "bench/gpu/moe_exact_packs.py", "--models", model, "--backend", backend, "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    report_path = tmp_path / "moe_exact_packs.json"
    assert report_path.exists(), done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert len(report["rows"]) == 8, report["rows"]  # 2 experts implementations x 2 packs x packed / alone
    assert report["all_bitwise"] and done.returncode == 0, (tmp_path / "moe_exact_packs.md").read_text()
