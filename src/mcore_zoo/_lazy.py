"""Module-level lazy attributes (PEP 562): ``name -> "module:attr"``, imported on first access."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(module_name: str, table: Mapping[str, str], namespace: dict) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for a module whose ``table`` attributes load on first use
    (and are then cached in ``namespace``, the module's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        source, attr = target.split(":")
        value = getattr(importlib.import_module(source), attr)
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
