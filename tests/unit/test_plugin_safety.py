"""Plugins that hang are bounded; a third-party provider of an architecture is always named."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

import mcore_zoo
from mcore_zoo.provenance import provider_note
from mcore_zoo import registry as registry_module
from mcore_zoo.registry import Registry

from ..conftest import subprocess_env
from .test_registry import make_dist, plugin_source

HANGS_ON_IMPORT = "import time\ntime.sleep(120)\n"
HOOK_NEVER_RETURNS = """
import time
from mcore_zoo import hookimpl

@hookimpl
def mcore_zoo_architectures():
    time.sleep(120)
    return []
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD", "MCORE_ZOO_PLUGINS", "MCORE_ZOO_BLOCK_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MCORE_ZOO_PLUGIN_TIMEOUT", "1")
    return tmp_path


@pytest.mark.parametrize("source", [HANGS_ON_IMPORT, HOOK_NEVER_RETURNS], ids=["import", "hook"])
def test_a_hanging_plugin_is_a_load_failure(site, source):
    make_dist(site, "zoo-hang", "0.1", "hang", "zoo_hang", source)
    start = time.monotonic()
    reg = Registry().load()
    assert time.monotonic() - start < 10
    record = reg.plugins["hang"]
    assert record.status == "failed" and "did not finish within 1 s" in record.error
    assert reg.get("LlamaForCausalLM").plugin == "llama"


def test_list_returns_with_a_hanging_plugin(site):
    make_dist(site, "zoo-hang", "0.1", "hang", "zoo_hang_list", HANGS_ON_IMPORT)
    env = subprocess_env(site, MCORE_ZOO_PLUGIN_TIMEOUT="1")
    done = subprocess.run([sys.executable, "-m", "mcore_zoo.cli", "list"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "LlamaForCausalLM" in done.stdout and "1 plugin(s) failed to load" in done.stdout


def test_an_override_of_a_builtin_is_named_at_build(site, caplog, monkeypatch):
    make_dist(site, "zoo-better-llama", "2.0", "better", "zoo_better_build", plugin_source("LlamaForCausalLM", override=True))
    monkeypatch.setattr(registry_module, "_DEFAULT", None)  # rediscover, with the new distribution
    arch = mcore_zoo.lookup("LlamaForCausalLM")
    note = provider_note(arch)
    assert "'better'" in note and "zoo-better-llama 2.0" in note and "overrides plugin 'llama'" in note
    with caplog.at_level(logging.WARNING, logger="mcore_zoo"):
        from mcore_zoo.build import prepare

        prepare(Registry(autoload=False).load().get("LlamaForCausalLM").example_config(), backend="local")
    assert any("'better'" in r.getMessage() and "override" in r.getMessage() for r in caplog.records)


def test_builtins_are_not_noted():
    assert provider_note(mcore_zoo.lookup("LlamaForCausalLM")) is None
