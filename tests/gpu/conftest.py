"""GPU tests: skipped (with the reason) on machines without CUDA."""

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CPU counterparts live in tests/parity and tests/unit)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def bf16_checkpoints(tmp_path_factory: Any, size: dict, extra: dict) -> dict:
    """``{architecture: path}``: a random bf16 HF checkpoint per architecture of ``extra``, at its
    example config updated with ``size`` and ``extra[architecture]``."""
    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    out = {}
    for name, more in extra.items():
        arch = mcore_zoo.lookup(name)
        config = arch.example_config()
        config.update(size, **more)
        path = tmp_path_factory.mktemp(name)
        write_reference_checkpoint(arch, config, path, dtype=torch.bfloat16)
        out[name] = path
    return out


def run_check(script: str, *args: str, env: Any = None, timeout: int = 900) -> dict:
    """``python script *args`` in a fresh process (one inference engine per process), with this
    process's ``sys.path`` (and ``env`` added to the environment); fails with the tails of its
    output unless it exits 0, and returns the JSON of its last stdout line."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})})  # fmt: skip
    results = os.environ.get("MCORE_ZOO_GPU_RESULTS")
    if proc.returncode != 0 and results:  # kept where a batch's results go: a run cut short prints no report
        tag = "-".join([os.path.splitext(os.path.basename(script))[0], *(a for a in args[1:] if "/" not in a)])
        with open(os.path.join(results, f"failed-{tag}.log"), "w") as f:
            f.write(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-20000:]}\n--- stderr\n{proc.stderr[-40000:]}\n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # the check's JSON line; an engine's worker processes may print after it while they shut down
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("the check printed no JSON result: " + proc.stdout[-3000:] + proc.stderr[-3000:])


def refit_checkpoint_into_vllm(tmp_path: Any, config: dict, fixture: str, arch: str, llm_kwargs: dict) -> dict:
    """The in-process vLLM refit check (``test_refit_gpu.py`` run as a script, one engine per
    process) on a random bf16 checkpoint of ``config`` (shaped from the published ``fixture``):
    its result written to ``MCORE_ZOO_GPU_RESULTS/refit-<arch>.json`` when that is set, asserted
    with :func:`check_vllm_refit`, and returned for a test's own further checks."""
    from pathlib import Path

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    ckpt = Path(tmp_path) / "ckpt"
    write_reference_checkpoint(mcore_zoo.lookup(config), config, ckpt, dtype=torch.bfloat16)
    r = run_check(str(Path(__file__).with_name("test_refit_gpu.py")), str(ckpt), arch, str(tmp_path),
                  json.dumps(llm_kwargs))  # fmt: skip
    results = os.environ.get("MCORE_ZOO_GPU_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"refit-{arch}.json").write_text(json.dumps({"config": fixture, **r}, indent=2) + "\n")
    check_vllm_refit(r, arch)
    return r


def check_vllm_refit(r: dict, arch: str) -> None:
    """Print and assert what every in-process vLLM refit check (``test_refit_gpu.py`` run as a script)
    must show: the in-process engine at TP 1, a refit over scrambled weights in more than two buckets,
    the engine's names and every parameter equal to the export, prompt log-probs bitwise, the per-shard
    and reused-table refits equal too, and a refit missing a bucket refused as incomplete."""
    print(f"\n{arch}: vLLM after refit vs mcore local bf16: token_mult_prob_error {r['token_mult_prob_error']:.6f},"
          f" max |dlogp| {r['max_abs_dlogp']:.3e}; refit {r['refit_mb']:.1f} MB in {r['refit_ms']:.1f} ms")  # fmt: skip
    assert r["transport"] == "inproc" and r["tp"] == 1
    assert r["scrambled_differs"] and r["buckets"] > 2
    assert r["names_equal"] and r["params_differ"] == []
    assert r["logprobs_bitwise"]
    assert r["per_shard_params_differ"] == [] and r["reused_tables_params_differ"] == []
    assert r["skipped_bucket_error"] is not None and "refit incomplete" in r["skipped_bucket_error"]
