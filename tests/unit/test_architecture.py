"""The package's shape: its layers (every module placed in one, no import from a higher layer, the
module map of docs/architecture.md in agreement), collectives only in ``distributed/``, ranks read
only in ``placement.py``, no import cycles, one model handle, per-contribution plugin hooks called
through pluggy, the architecture's forward actually dispatched, TP axes checked against
Megatron-Core's own ``partition_dim``, built-in plugins small."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import types
from pathlib import Path
from typing import Iterator, Sequence

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


# ---------------------------------------------------------------------------- layers
#: The layers, base first. A module imports only from its own layer and the layers before it.
LAYERS = ("support", "description", "single rank", "registration", "model", "job-wide", "rollout", "tools")

#: Every module of the package, by its path under ``src/mcore_zoo``, in exactly one layer. An entry
#: with ``*`` is a pattern for one path part (``families/*/config.py``: every family's config). A
#: module that no entry names fails ``test_every_module_is_placed_in_exactly_one_layer``.
LAYER_TABLE: dict[str, tuple[str, ...]] = {
    "support": (
        "_lazy.py", "_version.py", "errors.py", "compat.py", "cpu_shim.py", "progress.py", "hub.py", "hf_assets.py",
        "provenance.py", "vocab.py",
    ),
    "description": (
        "config/__init__.py", "config/arch.py", "config/common.py", "config/normalize.py", "config/parallelism.py",
        "config/quantization.py", "config/reader.py", "config/rope.py", "config/transformer.py",
        "config/language_model.py",
        "numerics/__init__.py", "numerics/profiles.py",
        "weights/__init__.py", "weights/rules.py", "weights/dense.py", "weights/heads.py", "weights/vocab.py",
        "weights/language_model.py",
        "families/*/config.py", "families/*/weights.py",
    ),
    "single rank": (
        "weights/io.py", "weights/pread.py", "weights/staging.py", "weights/load.py", "weights/export.py",
        "weights/tied.py", "weights/fp8.py", "weights/fp8_quantize.py", "weights/mxfp4.py",
        "packing.py", "numerics/gemm.py", "kernels/__init__.py", "kernels/copy_runs.py", "kernels/logprob_rows.py",
        "kernels/vllm_ops.py", "kernels/hf_rmsnorm.py", "kernels/_hf_rmsnorm_triton.py", "kernels/rope.py",
        "kernels/_rope_triton.py", "kernels/swiglu.py", "kernels/_swiglu_triton.py",
        "kernels/triton_rows.py", "kernels/_triton_rounding.py", "families/vision_language/positions.py", "families/gated_deltanet/kernels.py",
    ),
    "registration": (
        "__init__.py", "entry.py", "hookspecs.py", "registry.py", "architecture.py", "plugin_api.py",
        "plugins/__init__.py", "plugins/deepseek_v2.py", "plugins/deepseek_v3.py", "plugins/deepseek_v32.py",
        "plugins/glm4_moe.py", "plugins/glm_moe_dsa.py",
        "plugins/llama.py", "plugins/mistral.py", "plugins/mixtral.py", "plugins/qwen2.py", "plugins/qwen2_moe.py",
        "plugins/qwen3.py", "plugins/qwen3_moe.py", "plugins/qwen3_next.py", "plugins/qwen3_5.py",
        "plugins/gpt_oss.py", "plugins/qwen2_5_vl.py", "plugins/qwen3_vl.py",
        "families/__init__.py", "families/*/__init__.py",
    ),
    "model": (
        "placement.py", "model_groups.py", "handle.py", "offload.py", "build.py", "parallel.py", "routing.py",
        "distributed/collectives.py",
        "specs/__init__.py", "specs/gpt.py", "specs/heads.py", "specs/linears.py", "specs/pack_rows.py", "specs/norms.py",
        "specs/patching.py", "specs/portable.py", "specs/thd_rope.py", "specs/rope_dispatch.py", "specs/swiglu_mlp.py", "specs/vllm_exact.py",
        "families/*/spec.py", "families/moe/clamped_swiglu.py", "families/moe/grouped_mm.py", "families/vision_language/vision.py",
        "families/vision_language/rotary.py",
    ),
    "job-wide": (
        "distributed/__init__.py", "distributed/build.py", "distributed/copy.py", "distributed/experts.py", "distributed/export.py",
        "distributed/forward.py", "distributed/io.py", "distributed/launch.py", "distributed/load.py",
        "distributed/microbatches.py", "distributed/optimizer.py", "distributed/train.py",
        "distributed/vocab_parallel.py", "families/vision_language/forward.py", "distributed/refit_group.py",
        "distributed/shared_buffers.py",
    ),
    "rollout": (
        "rollout/__init__.py", "rollout/adapter.py", "rollout/engine_format.py", "rollout/plan.py",
        "rollout/program.py", "rollout/refit.py", "rollout/sglang.py", "rollout/sglang_broadcast.py", "rollout/vllm.py",
        "rollout/fp8.py", "rollout/vllm_fp8.py",
        "rollout/transfer.py", "rollout/disagg.py", "rollout/disagg_shared.py", "rollout/vllm_disagg.py",
        "rollout/scale.py",
    ),
    "tools": (
        "dist_checkpoint.py", "cli.py", "scaffold.py", "numerics/capture.py", "numerics/metrics.py",
        "parity/__init__.py", "parity/cli.py", "parity/environment.py", "parity/harness.py", "parity/inputs.py",
        "parity/processor_files.py", "parity/reference.py", "parity/report.py", "parity/runners.py",
        "parity/vllm_worker.py",
        "testing/__init__.py", "testing/checks.py", "testing/common.py", "testing/rmsnorm.py", "testing/contracts.py", "testing/plugin.py",
        "testing/suite.py",
    ),
}  # fmt: skip


def module_paths(root: Path = SRC) -> dict[str, str]:
    """Dotted module name -> its path under ``root`` (``config/arch.py``, ``config/__init__.py``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.relative_to(root).as_posix()
    return out


def entry_matches(entry: str, path: str) -> bool:
    """``entry`` names ``path``: equal, or equal with each ``*`` standing for one path part."""
    pattern = "/".join("[^/]+" if part == "*" else re.escape(part) for part in entry.split("/"))
    return re.fullmatch(pattern, path) is not None


def stale(entry: str, paths: set[str]) -> bool:
    """``entry`` names one module (no ``*``) of a package that exists, and that module does not
    exist (an entry of a package still to come is not stale)."""
    return "*" not in entry and entry not in paths and (SRC / entry).parent.is_dir()


def layers_of(path: str, table: dict[str, tuple[str, ...]] = LAYER_TABLE) -> list[str]:
    """The layers whose entries name ``path`` (one, for a placed module)."""
    return [layer for layer, entries in table.items() if any(entry_matches(e, path) for e in entries)]


def upward_arrows(graph: dict[str, set[str]], layer_of: dict[str, str], order: Sequence[str] = LAYERS) -> set[tuple[str, str]]:
    """The imports ``(importer, imported)`` of ``graph`` that go from a layer to a later one."""
    rank = {layer: i for i, layer in enumerate(order)}
    return {(m, d) for m, deps in graph.items() for d in deps if rank[layer_of[d]] > rank[layer_of[m]]}


def test_the_layer_table_names_the_layers_in_order():
    assert tuple(LAYER_TABLE) == LAYERS


def test_every_module_is_placed_in_exactly_one_layer():
    paths = set(module_paths().values())
    problems = []
    for path in sorted(paths):
        found = layers_of(path)
        if len(found) != 1:
            problems.append(f"{path}: {'in ' + ', '.join(found) if found else 'in no layer: add it to LAYER_TABLE'}")
    problems += [f"{entry}: no such module; remove it from LAYER_TABLE" for entries in LAYER_TABLE.values()
                 for entry in entries if stale(entry, paths)]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_a_family_module_finds_its_layer_by_pattern():
    assert layers_of("families/moe/config.py") == ["description"]
    assert layers_of("families/mla/weights.py") == ["description"]
    assert layers_of("families/mtp/spec.py") == ["model"]
    assert layers_of("families/moe/__init__.py") == ["registration"]
    assert layers_of("families/moe/extra.py") == []


def test_no_module_imports_from_a_higher_layer():
    paths = module_paths()
    layer_of = {module: layers_of(path)[0] for module, path in paths.items()}
    arrows = upward_arrows(import_graph(), layer_of)
    named = [f"{m} ({layer_of[m]}) imports {d} ({layer_of[d]})" for m, d in sorted(arrows)]
    assert not named, "imports from a higher layer:\n" + "\n".join(named)


def test_the_layer_rule_catches_an_upward_import():
    layer_of = {"a": "support", "b": "model", "c": "tools"}
    assert upward_arrows({"a": {"b"}, "b": {"a"}, "c": {"a", "b"}}, layer_of) == {("a", "b")}


def _calls(tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """``(receiver, function, line)`` of every call ``receiver.function(...)`` or ``function(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                receiver = func.value.id if isinstance(func.value, ast.Name) else ""
                yield receiver, func.attr, node.lineno
            elif isinstance(func, ast.Name):
                yield "", func.id, node.lineno


def _imported_names(tree: ast.AST, module: str) -> set[str]:
    """Names bound by ``from <module> import ...`` in ``tree``."""
    return {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module
        for a in node.names
    }


#: The collectives of ``torch.distributed`` (called as ``dist.<name>`` or imported by name).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier",
}  # fmt: skip


def test_only_distributed_issues_collectives_and_weights_is_single_rank():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("mcore_zoo.weights") or module == "mcore_zoo.packing":
            assert not any(d.startswith(("mcore_zoo.distributed", "mcore_zoo.build")) for d in deps), (module, deps)
    issued = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "distributed":
            continue
        tree = ast.parse(path.read_text())
        by_name = _imported_names(tree, "torch.distributed") & COLLECTIVES
        for receiver, function, line in _calls(tree):
            if (receiver in ("dist", "distributed") and function in COLLECTIVES) or (not receiver and function in by_name):
                issued.append(f"{path.relative_to(SRC)}:{line} issues {function}")
    assert not issued, "\n".join(issued)


#: Questions about this process's rank or the size of the job or of a group.
RANK_QUERIES = re.compile(r"get_rank|get_world_size|get_global_rank|get_group_rank|get_\w*_rank|get_\w*_world_size|rank")


def test_only_the_placement_asks_megatron_which_rank_this_is():
    """No module but ``placement.py`` asks torch.distributed, Megatron-Core's ``parallel_state`` or
    vLLM's which rank this process is or how many there are (``get_rank``, ``get_world_size``,
    ``get_*_rank``, ``get_*_world_size``, ``rank_in_group``, ``group.rank()``): every other module
    reads them from a :class:`~mcore_zoo.placement.Placement` or placement's functions."""
    asked = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix() == "placement.py":
            continue
        tree = ast.parse(path.read_text())
        for receiver, function, line in _calls(tree):
            if RANK_QUERIES.fullmatch(function):
                asked.append(f"{path.relative_to(SRC)}:{line} calls {function}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "rank_in_group":
                asked.append(f"{path.relative_to(SRC)}:{node.lineno} reads rank_in_group")
    assert not asked, "\n".join(asked)


# ---------------------------------------------------------------------------- patches of Megatron-Core
def test_every_wrapper_of_a_megatron_function_is_declared_with_its_reason():
    from mcore_zoo.specs import patching

    declared = {function for _, function in patching.WRAPPED}
    used = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "wrap_once" and len(node.args) > 1:
                assert isinstance(node.args[1], ast.Constant), f"{path.relative_to(SRC)}:{node.lineno}: name the function literally"
                used.add(node.args[1].value)
    assert used == declared, f"declared but unused: {declared - used}; used but undeclared: {used - declared}"
    with pytest.raises(mcore_zoo.ZooError, match="declare the patch"):
        patching.wrap_once(types.ModuleType("somewhere"), "f", lambda original: original)
    listed = mcore_zoo.megatron_patches()
    assert {(p.module, p.function) for p in listed} >= set(patching.WRAPPED)
    assert all(p.why and p.scope for p in listed)


# ---------------------------------------------------------------------------- the map in the docs
ARCHITECTURE_MD = SRC.parent.parent / "docs" / "architecture.md"


def documented_modules(text: str) -> dict[str, str]:
    """The module map of docs/architecture.md: module path -> the layer heading it is listed under
    (``### <layer>`` headings, each followed by ``* `path` - what it is`` lines)."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    layer = None
    for line in section.splitlines():
        if line.startswith("### "):
            layer = line[4:].strip()
        found = re.match(r"\* `([^`]+)`", line)
        if found:
            out[found.group(1)] = layer
    return out


def test_the_module_map_in_the_docs_lists_every_module_in_its_layer():
    text = ARCHITECTURE_MD.read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    headings = tuple(line[4:].strip() for line in section.splitlines() if line.startswith("### "))
    assert headings == LAYERS, "the module map's layers are not LAYERS, base first"
    documented = documented_modules(text)
    paths = set(module_paths().values())
    problems = [f"{path}: not in docs/architecture.md's module map" for path in sorted(paths)
                if not any(entry_matches(entry, path) for entry in documented)]  # fmt: skip
    problems += [f"{entry}: in the module map, but no such module" for entry in documented if stale(entry, paths)]
    problems += [f"{entry}: listed under {layer}, LAYER_TABLE says {layers_of(entry)}"
                 for entry, layer in documented.items() if layers_of(entry) != [layer]]  # fmt: skip
    assert not problems, "\n".join(problems)


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
