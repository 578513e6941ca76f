"""The out-of-tree Phi-3 plugin (``examples/phi3``), proven the way a plugin author lives it:
``pip install`` from its directory, discovery through its entry point, its own test suite (mcore-zoo's
conformance suite) passing, and ``pip uninstall`` taking the architecture away again.

The package is installed into a temporary ``--target`` directory and used through ``PYTHONPATH``
in child processes, so this environment - and the built-in registry - stay untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mcore_zoo

from ..conftest import ROOT, pip_install_target, subprocess_env, uninstall_from_target

EXAMPLE = ROOT / "examples" / "phi3"
DIST, VERSION = "mcore-zoo-phi3", "0.1.0"


def zoo(*args: str, target) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcore_zoo.cli", *args], env=subprocess_env(target),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp("phi3-install")
    target = work / "site"
    pip_install_target(EXAMPLE, target, work)
    return work, target


def test_not_in_this_environment_or_the_builtin_registry():
    assert "Phi3ForCausalLM" not in mcore_zoo.Registry(autoload=False).load().architectures()
    with pytest.raises(mcore_zoo.UnknownArchitectureError):
        mcore_zoo.Registry().load().get("Phi3ForCausalLM")


@pytest.mark.slow
def test_installed_example_passes_its_own_test_suite(installed):
    """``pytest`` in the plugin's directory, as its author runs it: the conformance suite for the
    example config and the Phi-4-mini-like variant, and the Phi-3 specific tests."""
    work, target = installed
    project = work / f"build-{EXAMPLE.name}"  # the copy pip built from: src/ is not importable from here
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={work / 'tmp'}"],
        cwd=project, env=subprocess_env(target), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert "mcore-zoo conformance" in out
    for contract, count in [("registration", 1), ("config", 2), ("build", 2), ("weight-map", 2), ("parity", 2), ("thd", 2),
                            ("tensor-parallel", 1), ("bad-input", 2)]:  # fmt: skip
        assert f"{contract:<16} {count} passed\n" in out, (contract, out[-3000:])
    assert " failed" not in out.splitlines()[-1] and " passed" in out.splitlines()[-1]


def test_plugins_lists_it_and_uninstall_removes_it(tmp_path):
    target = tmp_path / "site"
    pip_install_target(EXAMPLE, target, tmp_path)

    proc = zoo("plugins", "--json", target=target)
    assert proc.returncode == 0, proc.stderr
    record = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}["phi3"]
    assert (record["distribution"], record["version"], record["status"]) == (DIST, VERSION, "loaded")
    assert record["architectures"] == ["Phi3ForCausalLM"] and not record["builtin"]
    table = zoo("plugins", target=target).stdout
    assert any(line.split()[:4] == ["phi3", DIST, VERSION, "loaded"] for line in table.splitlines()), table
    rows = {r["architecture"]: r for r in json.loads(zoo("list", "--json", target=target).stdout)}
    assert (rows["Phi3ForCausalLM"]["distribution"], rows["Phi3ForCausalLM"]["version"]) == (DIST, VERSION)
    assert rows["LlamaForCausalLM"]["distribution"] == "mcore-zoo"  # built-ins unchanged
    shown = zoo("show", "Phi3ForCausalLM", target=target)
    assert shown.returncode == 0 and "plugin 'phi3' from mcore-zoo-phi3 0.1.0" in shown.stdout
    # the fused HF tensor's parts, as row ranges (example: 4 heads and 2 kv heads of 16)
    assert "qkv_proj.weight[0:64], model.layers.{layer}.self_attn.qkv_proj.weight[64:96]" in shown.stdout

    removed = uninstall_from_target(target, DIST)
    assert any(p.name == "plugin.py" for p in removed) and not list(target.iterdir())
    listed = zoo("list", target=target)
    assert listed.returncode == 0 and "Phi3ForCausalLM" not in listed.stdout and "LlamaForCausalLM" in listed.stdout
    assert "phi3" not in [p["name"] for p in json.loads(zoo("plugins", "--json", target=target).stdout)["plugins"]]
    shown = zoo("show", "Phi3ForCausalLM", target=target)
    assert shown.returncode == 2 and "no mcore-zoo plugin provides architecture 'Phi3ForCausalLM'" in shown.stderr


def test_installed_plugin_does_not_make_the_generated_docs_stale(installed):
    """docs/architectures.md lists built-in plugins only: with the example installed it is still
    current under MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD=1 (the staleness test's setting), and without
    that setting the example does show up."""
    _, target = installed
    expected = (ROOT / "docs" / "architectures.md").read_text()
    run = [sys.executable, "-m", "mcore_zoo.cli", "list", "--markdown"]
    builtin = subprocess.run(run, env=subprocess_env(target, MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD="1"),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    everything = subprocess.run(run, env=subprocess_env(target), capture_output=True, text=True, timeout=120)
    assert builtin.stdout == expected
    assert "`Phi3ForCausalLM`" in everything.stdout and everything.stdout != expected
