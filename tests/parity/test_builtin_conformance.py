"""The built-in architectures pass the same conformance suite third-party plugins run
(``mcore_zoo.testing``): every contract, for each example config and the variants in ``CASES``."""

from __future__ import annotations

import tomllib

from mcore_zoo.testing import ConformanceSuite

from ..conftest import CASES, ROOT


def _variants() -> dict:
    variants: dict = {}
    for case_id, arch, overrides in CASES:
        if overrides:
            variants.setdefault(arch, {})[case_id] = overrides
    return variants


class TestBuiltinConformance(ConformanceSuite):
    plugin = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["mcore_zoo"])
    variants = _variants()
