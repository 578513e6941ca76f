"""Shared fixtures: a single-process Megatron parallel state, tiny reference checkpoints, cases.

The fixtures delegate to :mod:`mcore_zoo.testing` (the helpers the conformance suite ships to
plugin authors), so the zoo's own tests and third-party plugins use the same machinery.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mcore_zoo.testing.common import random_sequences  # noqa: F401 - re-exported for the tests

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def pytest_configure(config: pytest.Config) -> None:
    """The conformance suite's pytest plugin (fixtures ``zoo_mpu`` ...) comes through the
    ``pytest11`` entry point of an installed mcore-zoo; where the project only runs from its tree
    (``PYTHONPATH=src``, as on the GPU machine), register it here."""
    if not config.pluginmanager.has_plugin("mcore_zoo") and not config.pluginmanager.has_plugin("mcore_zoo.testing.plugin"):
        config.pluginmanager.import_plugin("mcore_zoo.testing.plugin")


ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = FIXTURES / "configs"

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

#: (id, architecture, overrides of the embedded example config): every built-in family plus the
#: variants that take other code paths (tied embeddings, biases, per-layer sliding window).
CASES = [
    ("llama3", "LlamaForCausalLM", {}),
    ("llama-tied-default-rope", "LlamaForCausalLM", {"rope_scaling": None, "tie_word_embeddings": True}),
    ("llama-bias", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("mistral-swa", "MistralForCausalLM", {}),
    ("qwen2-tied", "Qwen2ForCausalLM", {}),
    (
        "qwen2-swa-mixed",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    ("qwen3", "Qwen3ForCausalLM", {}),
]
CASE_IDS = [c[0] for c in CASES]


def case_config(arch_name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from mcore_zoo.testing.common import case_config as make

    return make(arch_name, overrides)


@pytest.fixture(scope="session")
def mpu(zoo_mpu: Any) -> Any:
    """Megatron parallel state for this (single) process: gloo, everything 1."""
    return zoo_mpu


@pytest.fixture(scope="session")
def reference_checkpoint(zoo_reference_checkpoint: Callable[..., Path]) -> Callable[..., Path]:
    """``reference_checkpoint(arch_name, overrides={}, seed=0) -> dir``: an HF checkpoint with
    random, sharp-attention weights (cached per session)."""
    return zoo_reference_checkpoint


@pytest.fixture
def hf_reference(zoo_hf_reference: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    return zoo_hf_reference


@pytest.fixture
def te_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """``have_transformer_engine()`` true: the ``te`` branch of the layer specs assembles its specs
    from Transformer Engine's class names (absent on the CPU: nothing is built)."""
    from mcore_zoo.specs import gpt

    monkeypatch.setattr(gpt, "have_transformer_engine", lambda: True)


# ---------------------------------------------------------------------------- plugin packages
def pip_install_target(source: Path, target: Path, workdir: Path) -> None:
    """``pip install --no-deps --target target source``, building from a copy of ``source`` (pip
    builds in place, and parallel test workers must not share a build directory).

    Offline (``--no-index --no-build-isolation``) when this environment has a setuptools that can
    build wheels by itself (>= 70.1; torch depends on setuptools), else with pip's build isolation.
    """
    import shutil
    import subprocess
    import sys

    copy = workdir / f"build-{source.name}"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
           "--target", str(target), str(copy)]  # fmt: skip
    if _setuptools_builds_wheels():
        cmd[4:4] = ["--no-index", "--no-build-isolation"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


def uninstall_from_target(target: Path, distribution: str) -> list[Path]:
    """Remove an installed distribution from a ``--target`` directory the way ``pip uninstall``
    does: every file its ``RECORD`` lists, then directories left empty. Returns the removed files."""
    import csv

    name = distribution.replace("-", "_")
    (info,) = [p for p in target.glob("*.dist-info") if p.name.lower().startswith(name.lower() + "-")]
    removed = []
    with (info / "RECORD").open() as f:
        for row in csv.reader(f):
            path = (target / row[0]).resolve()
            if path.is_file() and target.resolve() in path.parents:
                path.unlink()
                removed.append(path)
                if path.suffix == ".py":  # bytecode written after installation, as pip removes it
                    for cached in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
                        cached.unlink()
                        removed.append(cached)
    for directory in sorted({p.parent for p in removed}, key=lambda p: len(p.parts), reverse=True):
        directory = directory.resolve()
        while directory != target.resolve() and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
            directory = directory.parent
    return removed


#: torch.distributed rendezvous variables this process may have set for its own process group
_DIST_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}


def subprocess_env(*pythonpath: Path, **extra: str) -> dict[str, str]:
    """This environment for a child process, with ``pythonpath`` first on ``PYTHONPATH`` and
    nothing of the parent pytest run (xdist worker ids, addopts, its process group's rendezvous) or
    of mcore-zoo's plugin switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MCORE_ZOO_")) and k not in _DIST_ENV}
    paths = [str(p) for p in pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def checkpoint_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, by name."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def export_mismatches(exported: dict, source: dict) -> list[str]:
    """Names missing on one side, then names whose tensors differ (bitwise; compared on the CPU, so an
    export from a GPU model checks against a checkpoint read to host memory)."""
    names = sorted(set(exported) ^ set(source))
    return names + [k for k in source if k in exported and not torch.equal(exported[k].cpu(), source[k].cpu())]


def require_current_deepseek_v2_reference() -> None:
    """Skip a comparison with transformers' DeepSeek-V2 where it is another model. The zoo's
    DeepSeek-V2 is transformers' current one (and DeepSeek's original code): softmax scale with YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` (``yarn_apply_mscale``) and a working group-limited
    router. Older transformers (5.12.1 measured) lack both - another model (max |dlogit| 1.85 on the
    same checkpoint) - so the V2 comparisons cannot pass or fail there."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    if not hasattr(modeling_deepseek_v2, "yarn_apply_mscale"):
        import transformers

        pytest.skip(f"transformers {transformers.__version__}: DeepseekV2Attention predates the YaRN softmax"
                    " mscale (yarn_apply_mscale); the zoo follows the current model")  # fmt: skip


# ---------------------------------------------------------------------------- shared launches
def run_each(cases: dict[str, tuple]) -> dict[str, Any]:
    """Runs on every rank of one :func:`mcore_zoo.distributed.launch`: ``fn(*args)`` for each
    ``name: (fn, *args)`` of ``cases``, in order; the results by name. Several tests' cases share
    one launch, so each rank imports torch and Megatron-Core once for all of them. Each case starts
    without Megatron-Core parallel state, as on a fresh launch (what a case made is destroyed after
    it). An exception names its case and fails the launch."""
    from megatron.core import parallel_state

    results: dict[str, Any] = {}
    for name, (fn, *args) in cases.items():
        try:
            results[name] = fn(*args)
        except Exception as exc:
            raise RuntimeError(f"case {name!r} of a shared launch: {type(exc).__name__}: {exc}") from exc
        finally:
            parallel_state.destroy_model_parallel()
    return results


class Once:
    """``compute()`` run when ``value`` is first read, its result kept for every later read; an
    exception is kept too and every read fails with it (each test sharing an expensive launch
    fails, none runs it again)."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self.compute = compute
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def value(self) -> Any:
        if not self._done:
            self._done = True
            try:
                self._value = self.compute()
            except Exception as exc:  # noqa: BLE001 - raised again for every read
                self._error = exc
        if self._error is not None:
            raise RuntimeError(f"the shared run failed: {self._error}") from self._error
        return self._value


class SharedLaunch:
    """One :func:`run_each` launch on ``world_size`` ranks for the cases ``make_cases()`` returns
    (``{name: (fn, *args)}``), made when the first test asks for a case; ``launch[name]`` is that
    case's result on every rank (rank order) and ``launch.cases[name]`` its ``(fn, *args)``. A
    failed launch fails every test that asks (:class:`Once`). ``backend``: as
    :func:`mcore_zoo.distributed.launch` takes it."""

    def __init__(self, world_size: int, make_cases: Callable[[], dict[str, tuple]], backend: str | None = None) -> None:
        self.cases: dict[str, tuple] = {}
        self._ranks = Once(lambda: self._launch(world_size, make_cases, backend))

    def _launch(self, world_size: int, make_cases: Callable[[], dict[str, tuple]], backend: str | None) -> list[dict[str, Any]]:
        from mcore_zoo.distributed import launch

        self.cases = make_cases()
        return launch(run_each, world_size, self.cases, backend=backend)

    def __getitem__(self, name: str) -> list[Any]:
        return [rank[name] for rank in self._ranks.value]
