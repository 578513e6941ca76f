"""A sketch of an SGLang adapter: ``Engine.update_weights_from_tensor``.

SGLang fuses and splits on its side (its models' ``load_weights`` with ``stacked_params_mapping``),
so this adapter plans with :data:`~mcore_zoo.rollout.engine_format.HF_NAMES`: whole tensors under HF
names, one list per bucket. ``update_weights_from_tensor(named_tensors, load_format=None,
flush_cache=True)`` takes ``[(name, tensor)]``; for an engine in other processes SGLang serialises
the tensors itself (CUDA IPC for GPU tensors). ``flush_cache`` is requested on the last bucket only.

Not run in this repository's tests (SGLang is not installed anywhere the tests run); the interface
is the one :class:`~mcore_zoo.rollout.adapter.EngineAdapter` documents, so a trainer can use it as
is or adapt it to its SGLang version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .adapter import EngineAdapter, RefitBucket
from .engine_format import HF_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan


class SGLangAdapter(EngineAdapter):
    """``engine``: an ``sglang.Engine`` (offline engine, in this process)."""

    engine_format = HF_NAMES

    def __init__(self, engine: Any, tp_size: int = 1) -> None:
        self.engine = engine
        self.tp_size = tp_size
        self._last = -1

    def begin(self, plan: "RefitPlan") -> None:
        self._last = len(plan.buckets) - 1

    def load_bucket(self, bucket: RefitBucket) -> None:
        self.engine.update_weights_from_tensor(bucket.named(0), flush_cache=bucket.index == self._last)

    def end(self) -> None:
        pass


__all__ = ["SGLangAdapter"]
