"""The pytest plugin mcore-zoo registers (``pytest11`` entry point ``mcore_zoo``).

It is loaded by every pytest run in an environment where mcore-zoo is installed, so it stays
passive unless conformance tests run, and it imports neither torch nor Megatron-Core up front:

* a report-header line with the versions a conformance result depends on;
* failures of :class:`~mcore_zoo.testing.contracts.ContractError` are reported as their message
  (contract, example config, what happened, how to fix) instead of a traceback;
* a terminal summary of the contracts checked (passed / failed / skipped per contract, and the
  example configs a multi-process contract left out because the model refuses that layout by name);
* fixtures for a plugin's own tests: ``zoo_mpu`` (single-process Megatron parallel state),
  ``zoo_reference_checkpoint`` and ``zoo_hf_reference``.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

_RESULTS_KEY = pytest.StashKey[dict]()
#: ``(contract, "subject: reason")`` of the example configs a multi-process contract left out
#: because the model refuses the layout by name (``UnsupportedLayoutError``)
_REFUSED_KEY = pytest.StashKey[list]()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


_CONFIG: Optional[pytest.Config] = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config
    config.stash[_RESULTS_KEY] = defaultdict(list)
    config.stash[_REFUSED_KEY] = []


def pytest_report_header(config: pytest.Config) -> str:
    from .._version import __version__

    deps = ", ".join(f"{d} {_version(d)}" for d in ("megatron-core", "transformers", "torch"))
    return f"mcore-zoo {__version__} ({deps})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    report = yield
    excinfo = call.excinfo
    if excinfo is not None and report.failed:
        from .contracts import ContractError

        if excinfo.errisinstance(ContractError):
            report.longrepr = excinfo.getrepr(style="value", chain=False)
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    if "mcore_zoo_contract" not in props:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        results = _CONFIG.stash.get(_RESULTS_KEY, None) if _CONFIG is not None else None
        if results is not None:
            results[props["mcore_zoo_contract"]].append((props.get("mcore_zoo_subject", report.nodeid), report.outcome))
        refused = _CONFIG.stash.get(_REFUSED_KEY, None) if _CONFIG is not None else None
        if refused is not None and report.when == "call":
            refused += [(props["mcore_zoo_contract"], v) for k, v in report.user_properties if k == "mcore_zoo_refused"]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS_KEY, None)
    if not results:
        return
    from .contracts import CONTRACTS

    terminalreporter.section("mcore-zoo conformance")
    order = [name for name in CONTRACTS if name in results] + [name for name in results if name not in CONTRACTS]
    for name in order:
        outcomes = results[name]
        counts = {o: sum(1 for _, x in outcomes if x == o) for o in ("passed", "failed", "skipped")}
        line = f"{name:<16} " + ", ".join(f"{n} {o}" for o, n in counts.items() if n)
        failed = sorted({s for s, x in outcomes if x == "failed"})
        if failed:
            line += "  -- broken for: " + "; ".join(failed)
        terminalreporter.write_line(line, red=bool(failed), green=not failed)
        for contract_name, what in config.stash.get(_REFUSED_KEY, []):
            if contract_name == name:
                terminalreporter.write_line(f"{'':<16} layout refused by the model, left out: {what}", yellow=True)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def zoo_mpu() -> Any:
    """Megatron-Core parallel state for this (single) process: gloo, every size 1."""
    from ..parallel import ensure_model_parallel

    return ensure_model_parallel()


@pytest.fixture(scope="session")
def zoo_reference_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``zoo_reference_checkpoint(arch_name, overrides=None, seed=0) -> Path``: an HF checkpoint of
    the registered architecture at its example config (plus ``overrides``) with random,
    sharp-attention weights; written once per session and configuration."""
    from ..registry import get_registry
    from .common import ReferenceCheckpoints, case_config

    refs = ReferenceCheckpoints(lambda name: tmp_path_factory.mktemp(name))

    def make(arch_name: str, overrides: Optional[dict] = None, seed: int = 0) -> Path:
        return refs(get_registry().get(arch_name), case_config(arch_name, overrides), seed=seed)

    return make


@pytest.fixture
def zoo_hf_reference() -> Callable[..., Any]:
    """``zoo_hf_reference(arch_name, checkpoint, attn="eager")``: the transformers reference model,
    loaded the way users load it (``from_pretrained``, fp32)."""
    from ..parity.reference import load_reference
    from ..registry import get_registry

    def load(arch_name: str, checkpoint: Path, attn: str = "eager") -> Any:
        return load_reference(get_registry().get(arch_name), checkpoint, attn_implementation=attn)

    return load
