"""An SGLang adapter: ``Engine.update_weights_from_tensor``.

SGLang fuses and splits on its side (its models' ``load_weights`` with ``stacked_params_mapping``),
so this adapter plans with :data:`~mcore_zoo.rollout.engine_format.HF_NAMES`: whole tensors under HF
names, one call per bucket. ``update_weights_from_tensor(named_tensors, load_format=None,
flush_cache=...)`` takes ``[(name, tensor)]``; the engine's scheduler runs in other processes, so
SGLang serialises the tensors itself (CUDA IPC handles for GPU tensors: the engine reads the
trainer's memory, GPU to GPU on one device) and every engine TP rank loads the whole tensors and
keeps its own slice. The call returns when every rank has loaded the bucket; its ``(success,
message)`` is checked. The radix (prefix) cache is flushed with the last bucket only.

``end`` raises unless every tensor of the plan went to the engine exactly once and every call
succeeded. Works with the offline ``sglang.Engine`` (in this process) and with anything that has
its ``update_weights_from_tensor`` signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from ..errors import ZooError
from .adapter import EngineAdapter, RefitBucket
from .engine_format import HF_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan


class SGLangAdapter(EngineAdapter):
    """``engine``: an ``sglang.Engine`` (offline engine, in this process; its TP size is its own
    business: SGLang slices whole tensors per rank). ``flush_cache``: flush the engine's prefix
    cache with the last bucket (the cached KV of the old weights must not be reused)."""

    engine_format = HF_NAMES

    def __init__(self, engine: Any, tp_size: int = 1, *, flush_cache: bool = True) -> None:
        self.engine = engine
        self.tp_size = tp_size
        self.flush_cache = flush_cache
        self._last = -1
        self._want: set[str] = set()
        self._sent: dict[str, int] = {}

    def begin(self, plan: "RefitPlan") -> None:
        self._last = len(plan.buckets) - 1
        self._want = {t.name for tensors in plan.engine_tensors for t in tensors}
        self._sent = {}

    def load_bucket(self, bucket: RefitBucket) -> None:
        named = bucket.named(0)
        result = self.engine.update_weights_from_tensor(named, flush_cache=self.flush_cache and bucket.index == self._last)
        check_answer(result, f"bucket {bucket.index} ({len(named)} tensor(s), first {named[0][0] if named else '-'!r})")
        self._count_sent(name for name, _ in named)

    def _count_sent(self, names: Iterable[str]) -> None:
        for name in names:
            self._sent[name] = self._sent.get(name, 0) + 1

    def end(self) -> None:
        missing = sorted(self._want - set(self._sent))
        twice = sorted(n for n, k in self._sent.items() if k > 1)
        extra = sorted(set(self._sent) - self._want)
        if missing or twice or extra:
            raise ZooError(f"refit incomplete: {len(missing)} tensor(s) never sent {missing[:8]},"
                           f" {len(twice)} sent more than once {twice[:8]}, {len(extra)} not in the plan {extra[:8]}")  # fmt: skip


def check_answer(result: Any, what: str) -> None:
    """Raise :class:`~mcore_zoo.errors.ZooError` naming ``what`` unless ``result`` - an SGLang
    weight-update call's answer, ``(success, message)`` - says it succeeded."""
    if isinstance(result, tuple):  # (success, message), as SGLang's engine answers; or more / fewer parts
        if not result or not isinstance(result[0], bool):
            raise ZooError(f"SGLang answered {what} with {result!r}: expected (success, message)")
        success, message = result[0], " ".join(str(part) for part in result[1:])
    else:
        success, message = result is not False, str(result)
    if not success:
        raise ZooError(f"SGLang refused {what}: {message}")


__all__ = ["SGLangAdapter", "check_answer"]
