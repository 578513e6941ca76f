"""Where an architecture comes from, and bounded plugin loading.

* :func:`call_with_timeout`: a plugin's import and its ``mcore_zoo_architectures`` hook run in a
  daemon thread and are given ``MCORE_ZOO_PLUGIN_TIMEOUT`` seconds (default 30); a plugin that
  blocks is recorded as a load failure like any other, and every command - ``list`` included -
  goes on without it. (The blocked thread cannot be stopped; it is a daemon, so it does not keep
  the process alive.)
* :func:`provider_note`: a sentence naming the plugin that provides an architecture when it is not
  mcore-zoo's built-in one (a third-party plugin, possibly overriding the built-in with
  ``override=True``); :func:`warn_provider` logs it as a warning when a model is built, and the
  parity report carries it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

ENV_PLUGIN_TIMEOUT = "MCORE_ZOO_PLUGIN_TIMEOUT"
DEFAULT_PLUGIN_TIMEOUT = 30.0
BUILTIN_DISTRIBUTION = "mcore-zoo"


class PluginTimeout(Exception):
    """A plugin's import or hook did not return within the time limit."""


def plugin_timeout() -> float:
    """Seconds a plugin's import (and, separately, its hook) may take; ``0`` or less: unbounded."""
    raw = os.environ.get(ENV_PLUGIN_TIMEOUT, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_PLUGIN_TIMEOUT
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %s", ENV_PLUGIN_TIMEOUT, raw, DEFAULT_PLUGIN_TIMEOUT)
        return DEFAULT_PLUGIN_TIMEOUT


def call_with_timeout(fn: Callable[[], T], what: str, timeout: Optional[float] = None) -> T:
    """``fn()``, or :class:`PluginTimeout` if it does not return within ``timeout`` seconds.
    Exceptions (``BaseException`` included) are re-raised in the caller's thread."""
    limit = plugin_timeout() if timeout is None else timeout
    if limit <= 0:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"mcore-zoo plugin: {what}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise PluginTimeout(f"{what} did not finish within {limit:g} s (set {ENV_PLUGIN_TIMEOUT} to change the limit)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def is_builtin(architecture: Any) -> bool:
    return getattr(architecture, "distribution", None) == BUILTIN_DISTRIBUTION


def provider_note(architecture: Any) -> Optional[str]:
    """``None`` for mcore-zoo's built-in provider; else who provides the architecture (and whom it
    overrides)."""
    if architecture is None or is_builtin(architecture):
        return None
    note = f"{architecture.name} is provided by {architecture.origin}, not by mcore-zoo's built-in plugins"
    overridden = list(getattr(architecture, "overridden", ()) or ())
    if overridden:
        note += f"; it overrides {', '.join(overridden)} (override=True)"
    return note


def amendment_notes(arch_config: Any) -> list[str]:
    """One sentence per change an extension's ``amend_config`` made to the converted config
    (:attr:`~mcore_zoo.config.arch.ArchConfig.amendments`), naming the extension."""
    return [f"{arch_config.architecture}: {field} changed from {before!r} to {after!r} by the extension of {origin}"
            for origin, field, before, after in getattr(arch_config, "amendments", ())]  # fmt: skip


def warn_amendments(arch_config: Any) -> None:
    """Log :func:`amendment_notes` as warnings (at build time)."""
    for note in amendment_notes(arch_config):
        logger.warning(note)


def warn_provider(architecture: Any) -> None:
    """Log :func:`provider_note` as a warning (at build time)."""
    note = provider_note(architecture)
    if note:
        logger.warning(note)
