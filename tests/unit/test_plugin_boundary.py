"""The plugin boundary holds: a plugin reaches mcore-zoo only through ``mcore_zoo.plugin_api``.

Checked by reading the source (``ast``), for every built-in plugin module, the plugin module the
scaffold generates and every ``.py`` under ``examples/``:

* a plugin module imports no ``mcore_zoo`` module but ``mcore_zoo.plugin_api`` (module level or
  inside functions; ``from mcore_zoo import X`` only for ``X = plugin_api``);
* the test files and scripts of ``examples/`` may also use the public top-level package
  (``import mcore_zoo``) and the conformance suite (``mcore_zoo.testing``);
* every ``"module:attr"`` string a ``ModelEntry`` / ``Extension`` names inside ``mcore_zoo``
  points into the plugin itself or into ``mcore_zoo.plugin_api``.

The families (``mcore_zoo.families``) keep their description-level modules (``config.py``,
``weights.py``) free of the model-building and job-wide layers.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

import mcore_zoo

from ..conftest import ROOT

SRC = Path(mcore_zoo.__file__).parent
PLUGIN_API = "mcore_zoo.plugin_api"
#: what an example's tests and scripts may import besides the plugin API
PUBLIC_FOR_TESTS = ("mcore_zoo", "mcore_zoo.testing")
ENTRY_CALLS = ("ModelEntry", "Extension")


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every absolute import of ``tree`` (``from a import b`` gives ``a.b``
    when ``b`` may be a module, as ``from mcore_zoo import plugin_api`` does)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mcore_zoo":
                for alias in node.names:
                    yield node.lineno, f"mcore_zoo.{alias.name}"
            else:
                yield node.lineno, node.module


def is_allowed(module: str, allowed: tuple[str, ...]) -> bool:
    if module != "mcore_zoo" and not module.startswith("mcore_zoo."):
        return True
    return any(module == a or (a != "mcore_zoo" and module.startswith(a + ".")) for a in allowed)


def entry_targets(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """``(line, keyword, "module:attr")`` for every string argument of a ``ModelEntry`` /
    ``Extension`` call that names an attribute of a module."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name not in ENTRY_CALLS:
            continue
        for kw in node.keywords:
            value = kw.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and ":" in value.value:
                module = value.value.split(":", 1)[0]
                if module.replace(".", "").replace("_", "").isalnum():
                    yield value.lineno, kw.arg or "", value.value


def boundary_problems(path: Path, *, own_package: str, allowed: tuple[str, ...] = (PLUGIN_API,)) -> list[str]:
    """What in ``path`` crosses the plugin boundary (empty when nothing does). ``own_package``: the
    module or package the plugin's own ``ModelEntry`` strings may point into."""
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = [f"{path}:{line}: imports {module}" for line, module in imported_modules(tree)
                if not is_allowed(module, allowed)]  # fmt: skip
    for line, keyword, target in entry_targets(tree):
        module = target.split(":", 1)[0]
        inside_zoo = module == "mcore_zoo" or module.startswith("mcore_zoo.")
        own = module == own_package or module.startswith(own_package + ".")
        if inside_zoo and not own and module != PLUGIN_API:
            problems.append(f"{path}:{line}: {keyword}={target!r} points outside the plugin and {PLUGIN_API}")
    return problems


def builtin_plugins() -> list[Path]:
    return sorted(p for p in (SRC / "plugins").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", builtin_plugins(), ids=lambda p: p.stem)
def test_a_builtin_plugin_imports_only_the_plugin_api(path):
    problems = boundary_problems(path, own_package=f"mcore_zoo.plugins.{path.stem}")
    assert not problems, "\n".join(problems)


def test_the_generated_plugin_imports_only_the_plugin_api(tmp_path):
    from mcore_zoo.scaffold import generate

    out, _ = generate("boundary", "Phi3ForCausalLM", tmp_path / "pkg")
    plugin = out / "src" / "mcore_zoo_boundary" / "plugin.py"
    problems = boundary_problems(plugin, own_package="mcore_zoo_boundary")
    tests = [boundary_problems(p, own_package="mcore_zoo_boundary", allowed=(PLUGIN_API, *PUBLIC_FOR_TESTS))
             for p in (out / "tests").glob("*.py")]  # fmt: skip
    problems += [p for found in tests for p in found]
    assert not problems, "\n".join(problems)


def example_package(path: Path) -> Optional[str]:
    """The import package of an example plugin's source file (``examples/<x>/src/<package>/...``)."""
    parts = path.relative_to(ROOT / "examples").parts
    return parts[2] if len(parts) > 3 and parts[1] == "src" else None


def example_files() -> list[Path]:
    return sorted((ROOT / "examples").rglob("*.py"))


@pytest.mark.parametrize("path", example_files(), ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_an_example_imports_only_the_plugin_api(path):
    package = example_package(path)
    if package is not None:  # plugin code
        problems = boundary_problems(path, own_package=package)
    else:  # an example's tests and scripts: the plugin API, the public package, the conformance suite
        problems = boundary_problems(path, own_package=path.stem, allowed=(PLUGIN_API, *PUBLIC_FOR_TESTS))
    assert not problems, "\n".join(problems)


def test_the_boundary_check_names_what_crosses_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from mcore_zoo.plugin_api import ModelEntry\n"
        "from mcore_zoo import hookimpl\n"
        "def convert(reader):\n"
        "    from mcore_zoo.config.arch import MoESpec\n"
        "    import mcore_zoo.weights.rules\n"
        "ENTRY = ModelEntry(architecture='X', converter='bad:convert', weight_rules='mcore_zoo.weights.moe:m',\n"
        "                   forward='mcore_zoo.plugin_api:generic_forward', hf_model_class='transformers:X')\n"
    )
    problems = boundary_problems(bad, own_package="bad")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "imports mcore_zoo.hookimpl",
        "imports mcore_zoo.config.arch",
        "imports mcore_zoo.weights.rules",
        "weight_rules='mcore_zoo.weights.moe:m' points outside the plugin and mcore_zoo.plugin_api",
    ]


# ---------------------------------------------------------------------------- families
DESCRIPTION_FORBIDS = ("mcore_zoo.build", "mcore_zoo.handle", "mcore_zoo.distributed", "mcore_zoo.rollout")


def family_description_modules() -> list[Path]:
    return sorted(p for name in ("config.py", "weights.py") for p in (SRC / "families").glob(f"*/{name}"))


def test_the_families_exist_with_their_three_parts():
    for family in ("moe", "mla", "mtp"):
        for part in ("config.py", "spec.py", "weights.py"):
            assert (SRC / "families" / family / part).is_file(), f"families/{family}/{part}"


@pytest.mark.parametrize("path", family_description_modules(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_familys_config_and_weights_are_description_level(path):
    package = "mcore_zoo.families." + path.parent.name
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
        elif isinstance(node, ast.Import):
            module = node.names[0].name
        else:
            continue
        if module.startswith(DESCRIPTION_FORBIDS) or module.endswith(".spec") or module.startswith("mcore_zoo.specs"):
            found.append(f"{path.relative_to(SRC)}:{node.lineno}: imports {module}")
    assert not found, "\n".join(found)
