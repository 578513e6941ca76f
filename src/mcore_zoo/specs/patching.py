"""Process-wide wrappers around Megatron-Core module functions that the zoo's layers divert.

A layer that needs another op order inside a Megatron-Core function it cannot reach through a
module spec (the MoE routing arithmetic, the token combine, DeepSeek-V2's RoPE) wraps that module
attribute once per process; the wrapper calls the zoo's version only while the layer has said so
on the current thread, and the original otherwise.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_LOCK = threading.Lock()
_WRAPPED: set[tuple[str, str]] = set()


def wrap_once(module: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.<name>`` with ``make(original)``, the first time only (thread-safe; later
    calls for the same module attribute do nothing)."""
    key = (module.__name__, name)
    with _LOCK:
        if key in _WRAPPED:
            return
        setattr(module, name, make(getattr(module, name)))
        _WRAPPED.add(key)
