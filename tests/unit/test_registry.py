"""Plugin registry through real entry points: third-party distributions are written as
``*.dist-info`` folders on ``sys.path`` (exactly what ``pip install`` leaves behind)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import mcore_zoo
from mcore_zoo.errors import PluginConflictError, UnknownArchitectureError
from mcore_zoo.registry import Registry

ROOT = Path(__file__).resolve().parents[2]

PLUGIN_TEMPLATE = '''
from mcore_zoo import ModelEntry, hookimpl

@hookimpl
def {hook}():
    return [ModelEntry(architecture={arch!r}, model_type={model_type!r},
                       converter="mcore_zoo.plugins.llama:convert",
                       weight_rules="mcore_zoo.weights.dense:dense_decoder_weight_map",
                       override={override!r}, description="test plugin")]
'''


def make_dist(root: Path, dist: str, version: str, plugin: str, module: str, source: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[mcore_zoo]\n{plugin} = {module}\n")


def plugin_source(arch: str, *, override: bool = False, hook: str = "mcore_zoo_architectures", model_type: str = "fake") -> str:
    return PLUGIN_TEMPLATE.format(arch=arch, override=override, hook=hook, model_type=model_type)


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD", "MCORE_ZOO_PLUGINS", "MCORE_ZOO_BLOCK_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_builtins_come_through_the_entry_points_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mcore_zoo"]
    reg = Registry().load()
    builtins = {r.name: r.module for r in reg.plugins.values() if r.builtin}
    assert builtins == declared  # the installed (editable) distribution's entry points, no second list
    for name in declared:
        record = reg.plugins[name]
        assert record.status == "loaded" and record.distribution == "mcore-zoo"
    assert set(reg.architectures()) >= {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_third_party_plugin_is_discovered_with_its_distribution(site):
    make_dist(site, "zoo-fake-arch", "1.2.3", "fakearch", "zoo_fake_arch", plugin_source("FakeForCausalLM"))
    reg = Registry().load()
    arch = reg.get("FakeForCausalLM")
    assert (arch.plugin, arch.distribution, arch.version) == ("fakearch", "zoo-fake-arch", "1.2.3")
    assert reg.lookup({"architectures": ["FakeForCausalLM"]}) == arch
    assert reg.lookup({"model_type": "fake"}) == arch


def test_conflict_names_both_plugins_and_distributions(site):
    make_dist(site, "zoo-rival-llama", "0.9", "rival", "zoo_rival", plugin_source("LlamaForCausalLM"))
    reg = Registry().load()
    with pytest.raises(PluginConflictError) as err:
        reg.get("LlamaForCausalLM")
    text = str(err.value)
    assert "'llama'" in text and "mcore-zoo" in text and "'rival'" in text and "zoo-rival-llama 0.9" in text
    assert "LlamaForCausalLM" in reg.conflicts()
    assert reg.get("Qwen2ForCausalLM").plugin == "qwen2"  # the rest keeps working


def test_override_wins_and_records_what_it_replaced(site):
    make_dist(site, "zoo-better-llama", "2.0", "better", "zoo_better", plugin_source("LlamaForCausalLM", override=True))
    reg = Registry().load()
    arch = reg.get("LlamaForCausalLM")
    assert arch.plugin == "better" and "mcore-zoo" in arch.overridden[0]
    assert not reg.conflicts()


def test_two_overrides_are_still_a_conflict(site):
    make_dist(site, "zoo-a", "1", "a_plugin", "zoo_a", plugin_source("LlamaForCausalLM", override=True))
    make_dist(site, "zoo-b", "1", "b_plugin", "zoo_b", plugin_source("LlamaForCausalLM", override=True))
    with pytest.raises(PluginConflictError):
        Registry().load().get("LlamaForCausalLM")


def test_plugin_raising_on_import_is_recorded_and_others_work(site):
    make_dist(site, "zoo-broken", "0.1", "broken", "zoo_broken", "raise RuntimeError('cuda 99 required')\n")
    reg = Registry().load()
    record = reg.plugins["broken"]
    assert record.status == "failed" and "cuda 99 required" in record.error and record.distribution == "zoo-broken"
    assert reg.get("LlamaForCausalLM").plugin == "llama"
    with pytest.raises(UnknownArchitectureError) as err:
        reg.get("BrokenForCausalLM")
    assert "cuda 99 required" in str(err.value) and "LlamaForCausalLM" in str(err.value)


@pytest.mark.parametrize(
    "source,needle",
    [
        (plugin_source("TypoForCausalLM", hook="mcore_zoo_architecturez"), "unknown hook"),
        ("from mcore_zoo import hookimpl\n@hookimpl\ndef mcore_zoo_architectures():\n    return ['not an entry']\n", "expected ModelEntry"),
        ("x = 1\n", "implements none of the hooks mcore_zoo_architectures, mcore_zoo_extensions"),
    ],
    ids=["misspelt-hook", "bad-return", "no-hook"],
)
def test_malformed_plugins_are_recorded(site, source, needle, request):
    module = "zoo_bad_" + request.node.callspec.id.replace("-", "_")  # fresh module per case
    make_dist(site, "zoo-bad", "0.1", "bad", module, source)
    record = Registry().load().plugins["bad"]
    assert record.status == "failed" and needle in record.error


def test_plugin_name_clash_with_builtin(site):
    make_dist(site, "zoo-clash", "0.1", "llama", "zoo_clash", plugin_source("ClashForCausalLM"))
    reg = Registry().load()
    clash = [r for r in reg.plugins.values() if r.distribution == "zoo-clash"][0]
    assert clash.status == "failed" and "already taken" in clash.error
    assert reg.get("LlamaForCausalLM").distribution == "mcore-zoo"


def test_block_by_name(site, monkeypatch):
    make_dist(site, "zoo-fake-arch", "1.0", "fakearch", "zoo_fake_arch", plugin_source("FakeForCausalLM"))
    monkeypatch.setenv("MCORE_ZOO_BLOCK_PLUGINS", "fakearch, qwen3")
    reg = Registry().load()
    assert reg.plugins["fakearch"].status == "blocked" and reg.plugins["qwen3"].status == "blocked"
    assert "FakeForCausalLM" not in reg.architectures() and "Qwen3ForCausalLM" not in reg.architectures()


def test_disable_autoload_keeps_builtins_and_explicit_plugins(site, monkeypatch):
    make_dist(site, "zoo-fake-arch", "1.0", "fakearch", "zoo_fake_arch", plugin_source("FakeForCausalLM"))
    make_dist(site, "zoo-other", "1.0", "other", "zoo_other", plugin_source("OtherForCausalLM"))
    monkeypatch.setenv("MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = Registry().load()
    assert reg.plugins["fakearch"].status == "disabled" and "LlamaForCausalLM" in reg.architectures()
    monkeypatch.setenv("MCORE_ZOO_PLUGINS", "other")
    reg = Registry().load()
    assert reg.plugins["other"].status == "loaded" and reg.plugins["fakearch"].status == "disabled"


def test_runtime_registration():
    reg = Registry()

    class Plugin:
        @mcore_zoo.hookimpl
        def mcore_zoo_architectures(self):
            return [mcore_zoo.ModelEntry("RuntimeForCausalLM", "runtime", "m:convert", "m:rules")]

    record = reg.register(Plugin(), "runtime")
    assert record.status == "loaded" and reg.get("RuntimeForCausalLM").distribution == "<registered at runtime>"


def test_lookup_accepts_every_source_form(tmp_path):
    from transformers import AutoConfig

    from ..conftest import case_config

    config = case_config("Qwen3ForCausalLM", {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    obj = AutoConfig.for_model(**config)
    for source in ("Qwen3ForCausalLM", config, obj, tmp_path, str(tmp_path), str(tmp_path / "config.json")):
        assert mcore_zoo.lookup(source).name == "Qwen3ForCausalLM"


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnknownArchitectureError) as err:
        mcore_zoo.lookup("GPT2LMHeadModel")
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


def test_listing_imports_neither_megatron_nor_transformer_engine():
    code = (
        "import sys\nfrom mcore_zoo.cli import main\n"
        "assert main(['list']) == 0 and main(['plugins']) == 0\n"
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'transformer_engine', 'transformers'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_a_source_tree_without_an_installed_distribution_registers_the_declared_builtins(monkeypatch):
    """PYTHONPATH=src and no installed mcore-zoo (a GPU machine, a fresh checkout): the built-ins
    come from the tree's own pyproject.toml entry points - the one list an install publishes."""
    from importlib import metadata

    real = metadata.entry_points

    def without_zoo(*args, **kwargs):
        return [ep for ep in real(*args, **kwargs) if getattr(getattr(ep, "dist", None), "name", None) != "mcore-zoo"]

    monkeypatch.setattr(metadata, "entry_points", without_zoo)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mcore_zoo"]
    reg = Registry().load()
    builtins = {r.name: r for r in reg.plugins.values() if r.builtin}
    assert set(builtins) == set(declared)
    assert all(r.status == "loaded" and r.version.endswith("(source tree)") for r in builtins.values())
    assert "LlamaForCausalLM" in reg.architectures()


def test_the_source_tree_list_wins_over_an_installed_distributions_metadata(monkeypatch):
    """An installed mcore-zoo's entry points may be another tree's or stale (an editable install made
    before a plugin was added): when the imported package sits in a source tree, that tree's
    pyproject.toml decides which built-ins exist - nothing more, nothing less."""
    import mcore_zoo.registry as registry

    declared = registry.source_tree_entry_points()
    assert declared, "the test suite runs from a source tree"
    subset = {name: declared[name] for name in ("llama", "qwen3")}
    monkeypatch.setattr(registry, "source_tree_entry_points", lambda: dict(subset))
    reg = Registry().load()
    builtins = {r.name for r in reg.plugins.values() if r.builtin}
    assert builtins == set(subset)
    assert "MixtralForCausalLM" not in reg.architectures()
