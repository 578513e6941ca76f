"""Generated documentation is current: docs/architectures.md (from the registry, built-in plugins
only - an installed plugin such as examples/phi3 must not make it stale) and the contract table of
docs/adding-a-model.md (from ``mcore_zoo.testing.CONTRACTS``)."""

from __future__ import annotations

import subprocess
import sys

from mcore_zoo.testing.contracts import CONTRACTS, markdown_table

from ..conftest import ROOT, subprocess_env

REGENERATE = "MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD=1 mcore-zoo list --markdown > docs/architectures.md"


def test_architectures_md_is_generated_from_the_builtin_registry():
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_zoo.cli", "list", "--markdown"],
        env=subprocess_env(MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD="1"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    current = (ROOT / "docs" / "architectures.md").read_text()
    assert current == proc.stdout, f"docs/architectures.md is stale; regenerate it with:\n  {REGENERATE}"


def test_adding_a_model_embeds_the_current_contract_table():
    text = (ROOT / "docs" / "adding-a-model.md").read_text()
    begin, end = "<!-- contracts:begin -->\n", "<!-- contracts:end -->"
    assert begin in text and end in text
    embedded = text.split(begin, 1)[1].split(end, 1)[0]
    assert embedded == markdown_table(), (
        "the contract table in docs/adding-a-model.md is stale; replace it with"
        " `python -c 'from mcore_zoo.testing.contracts import markdown_table; print(markdown_table(), end=\"\")'`"
    )
    for name in CONTRACTS:
        assert f"`{name}`" in embedded
