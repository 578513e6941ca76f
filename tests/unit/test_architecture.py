"""The package's shape: no import cycles, one model handle, per-contribution plugin hooks called
through pluggy, the architecture's forward actually dispatched, TP axes checked against
Megatron-Core's own ``partition_dim``, built-in plugins small."""

from __future__ import annotations

import ast
import io
import tokenize
import types
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo import Extension, hookimpl
from mcore_zoo.errors import PluginConflictError, UnclassifiedConfigFieldsError, WeightMapError
from mcore_zoo.handle import handle_of
from mcore_zoo.registry import Registry

from ..conftest import case_config, random_sequences

SRC = Path(mcore_zoo.__file__).parent


# ---------------------------------------------------------------------------- import graph
def import_graph(root: Path = SRC, package: str = "mcore_zoo") -> dict[str, set[str]]:
    """Module -> package modules it imports (module level and inside functions alike)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path

    def targets(module: str, node: ast.AST, is_package: bool) -> list[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = module.split(".")
            if node.level:
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        out = []
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith(package) and name != module:
                out.append(name)
        return out

    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        graph[module] = {
            t
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in targets(module, node, path.name == "__init__.py")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a path that returns to its start), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_only_distributed_issues_collectives_and_weights_is_single_rank():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("mcore_zoo.weights") or module == "mcore_zoo.packing":
            assert not any(d.startswith(("mcore_zoo.distributed", "mcore_zoo.build")) for d in deps), (module, deps)
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if "/distributed/" in str(path) or path.name == "parallel.py":
            continue
        for call in ("dist.all_reduce(", "dist.all_gather(", "dist.broadcast(", "dist.send(", "dist.recv("):
            assert call not in text, f"{path.relative_to(SRC)} issues {call}"


def test_only_the_placement_asks_megatron_which_rank_this_is():
    for path in SRC.rglob("*.py"):
        if path.name == "placement.py":
            continue
        text = path.read_text()
        for call in ("get_tensor_model_parallel_rank(", "get_pipeline_model_parallel_rank(",
                     "get_context_parallel_rank(", "get_expert_model_parallel_rank("):  # fmt: skip
            assert call not in text, f"{path.relative_to(SRC)} calls {call}"


# ---------------------------------------------------------------------------- built-in size
def code_lines(path: Path) -> int:
    """Lines of code: docstrings, comments, blank lines and the EXAMPLE_CONFIG literal excluded."""
    source = path.read_text()
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXAMPLE_CONFIG" for t in node.targets):
            skip.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            lines.add(tok.start[0])
    return len(lines - skip)


def test_a_llama_like_builtin_is_small_and_has_no_sharding_logic():
    path = SRC / "plugins" / "llama.py"
    assert code_lines(path) <= 60
    text = path.read_text()
    for word in ("tp_axis", "tp_rank", "parallel_state", "chunk"):
        assert word not in text


# ---------------------------------------------------------------------------- extensions
def _forward_probe(calls: list):
    def forward(handle, sequences, attention_mask=None, **options):
        from mcore_zoo.plugin_api import generic_forward

        calls.append(handle)
        out = generic_forward(handle, sequences, attention_mask, **options)
        out.logprobs = [lp + 0.0 for lp in out.logprobs]
        return out

    return forward


def _plugin(**hooks):
    """A plugin object implementing ``hooks`` (hook name -> the list it returns)."""
    plugin = types.ModuleType("test_plugin")
    for name, value in hooks.items():
        setattr(plugin, name, hookimpl(lambda value=value: value))
    return plugin


def test_a_plugins_forward_is_what_packed_forward_runs(mpu, reference_checkpoint):
    calls: list = []
    reg = Registry()
    record = reg.register(_plugin(mcore_zoo_extensions=[Extension("LlamaForCausalLM", forward=_forward_probe(calls))]), "probe")
    assert record.status == "loaded", record.error
    architecture = reg.get("LlamaForCausalLM")
    assert architecture.provider_of("forward") == record.origin
    assert architecture.provider_of("converter").startswith("plugin 'llama'")
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, architecture=architecture, backend="portable", load=ckpt)
    seqs = random_sequences([5, 9], 256)
    out = mcore_zoo.packed_forward(model, seqs)
    assert calls == [handle_of(model)]
    plain = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt)
    mcore_zoo.packed_forward(plain, seqs)
    assert len(calls) == 1  # the built-in forward does not go through the probe
    assert [lp.shape for lp in out.logprobs] == [(4,), (8,)]


def test_two_plugins_replacing_one_contribution_conflict_naming_both():
    reg = Registry()
    for name in ("first", "second"):
        reg.register(_plugin(mcore_zoo_extensions=[Extension("LlamaForCausalLM", forward=_forward_probe([]))]), name)
    with pytest.raises(PluginConflictError) as err:
        reg.get("LlamaForCausalLM")
    assert "forward" in str(err.value) and "'first'" in str(err.value) and "'second'" in str(err.value)


def _classify_knob(reader, arch):
    reader.ignore("shiny_new_knob", "a training-only switch this plugin knows is harmless")
    return arch


def _ignore_extra_tensor(arch, wmap):
    return type(wmap)(wmap.arch, wmap.rules, wmap.ignored + [(r"model\.extra_head\.weight", "value head: not loaded")])


def test_amendments_classify_new_config_fields_and_extend_the_weight_map():
    config = case_config("LlamaForCausalLM", {"shiny_new_knob": 1})
    plain = Registry()
    with pytest.raises(UnclassifiedConfigFieldsError, match="shiny_new_knob"):
        plain.get("LlamaForCausalLM").config_from_hf(config)
    reg = Registry()
    reg.register(_plugin(mcore_zoo_extensions=[
        Extension("LlamaForCausalLM", amend_config=_classify_knob, amend_weight_map=_ignore_extra_tensor)]), "amend")  # fmt: skip
    architecture = reg.get("LlamaForCausalLM")
    arch = architecture.config_from_hf(config)
    assert {f["field"]: f["kind"] for f in arch.fields.as_dict()["fields"]}["shiny_new_knob"] == "ignored"
    assert architecture.weight_map(arch).is_ignored("model.extra_head.weight") == "value head: not loaded"
    assert "amend_config" in architecture.provenance()


def _tighter_eps(reader, arch):
    return arch.replace(norm_eps=1e-3)


def test_an_extension_that_changes_a_builtin_is_named_at_build_and_in_the_parity_report(mpu, reference_checkpoint, caplog):
    import logging

    reg = Registry()
    reg.register(_plugin(mcore_zoo_extensions=[Extension("LlamaForCausalLM", amend_config=_tighter_eps)]), "eps")
    architecture = reg.get("LlamaForCausalLM")
    arch = architecture.config_from_hf(case_config("LlamaForCausalLM", {}))
    assert arch.norm_eps == 1e-3 and [(c[1], c[3]) for c in arch.amendments] == [("norm_eps", 1e-3)]
    ckpt = reference_checkpoint("LlamaForCausalLM")
    with caplog.at_level(logging.WARNING, logger="mcore_zoo"):
        mcore_zoo.build_model(ckpt, architecture=architecture, backend="portable")
    assert any("norm_eps changed from" in r.getMessage() and "'eps'" in r.getMessage() for r in caplog.records)
    from mcore_zoo.provenance import amendment_notes

    assert "by the extension of" in amendment_notes(arch)[0]


def test_unused_extensions_and_endless_hooks(capsys, monkeypatch):
    """An extension of an architecture nobody provides is listed as unused by ``mcore-zoo
    plugins``; a hook that yields without end is stopped by the plugin timeout."""
    import itertools

    from mcore_zoo import cli

    reg = Registry()
    reg.register(_plugin(mcore_zoo_extensions=[Extension("NobodysForCausalLM", amend_config=_tighter_eps)]), "orphan")
    assert "NobodysForCausalLM" in reg.unclaimed_extensions()
    monkeypatch.setattr(cli, "_registry", lambda: reg)
    assert cli.main(["plugins"]) == 0
    assert "UNUSED extension(s) of NobodysForCausalLM" in capsys.readouterr().out
    monkeypatch.setenv("MCORE_ZOO_PLUGIN_TIMEOUT", "2")
    endless = types.ModuleType("endless")
    endless.mcore_zoo_extensions = hookimpl(lambda: (Extension("LlamaForCausalLM", amend_config=_tighter_eps) for _ in itertools.count()))
    record = Registry().register(endless, "endless")
    assert record.status == "failed" and ("more than" in record.error or "did not finish" in record.error), record.error


def test_an_extension_that_changes_nothing_is_refused():
    with pytest.raises(mcore_zoo.PluginError, match="changes nothing"):
        Extension("LlamaForCausalLM")


# ---------------------------------------------------------------------------- handle and TP axes
def test_the_weight_map_and_bound_rules_are_computed_once_per_model(mpu, reference_checkpoint, monkeypatch, tmp_path):
    from mcore_zoo.architecture import Architecture

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local")
    count = {"weight_map": 0}
    real = Architecture.weight_map

    def counting(self, arch):
        count["weight_map"] += 1
        return real(self, arch)

    monkeypatch.setattr(Architecture, "weight_map", counting)
    mcore_zoo.load_hf_weights(model, ckpt)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    list(mcore_zoo.iter_hf_weights(model))
    assert count["weight_map"] == 1


def test_a_rule_whose_tp_axis_contradicts_megatrons_partition_dim_is_refused(mpu, reference_checkpoint):
    from mcore_zoo.weights.rules import Rule, Source, WeightMap

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local")
    handle = handle_of(model)
    good = handle.weight_map
    bad = [
        Rule(r.mcore, tuple(Source(s.hf, 1, s.select) for s in r.sources), r.transform, r.export, r.layer_kind, r.note)
        if r.mcore.endswith("linear_qkv.weight") else r
        for r in good.rules
    ]  # fmt: skip
    handle._weight_map = WeightMap(good.arch, bad, good.ignored)
    with pytest.raises(WeightMapError, match=r"linear_qkv\.weight.*splits the parameter along dim 0"):
        mcore_zoo.load_hf_weights(model, ckpt)
    assert torch.isfinite(next(model.parameters())).all()
