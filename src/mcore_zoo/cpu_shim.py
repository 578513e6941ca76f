"""Run Megatron-Core on a CPU-only machine (tests, CI, conversion without a GPU).

Megatron-Core assumes CUDA in a handful of places. This module patches exactly those, and only in
a process where CUDA is unavailable (:func:`activate` is a no-op when ``torch.cuda.is_available()``):

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` (RoPE moves ``inv_freq`` there;
  some buffers are created on it) and ``torch.cuda.synchronize()`` does nothing (distributed
  checkpointing syncs after staging tensors) - on such a machine the originals can only raise.
* the causal / sliding-window mask helpers that hard-code ``device="cuda"``;
* the model-parallel RNG tracker (which forks CUDA generator states) is replaced by one that
  forks CPU generator states, seeded per tensor-parallel rank like the original;
* pipeline schedules: ``batch_p2p_sync`` must be off on gloo, and the one tensor the schedules
  create with ``device="cuda"`` is created on the CPU.

Models must be built with ``use_cpu_initialization=True`` (the zoo's builders do).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch

_LOCK = threading.Lock()
_ACTIVE = False


def needed() -> bool:
    return not torch.cuda.is_available()


def is_active() -> bool:
    return _ACTIVE


def activate() -> bool:
    """Install the CPU patches if this process has no CUDA. Idempotent. Returns whether active."""
    global _ACTIVE
    if not needed():
        return False
    with _LOCK:
        if _ACTIVE:
            return True
        _patch_current_device()
        _patch_masks()
        _install_cpu_rng_tracker()
        _patch_schedules()
        _ACTIVE = True
        return True


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_sync(*_: Any, **__: Any) -> None:
    return None


def _patch_current_device() -> None:
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # type: ignore[assignment]


@functools.lru_cache(maxsize=None)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_mask(sq: int, skv: int, window_size: Any) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def _patch_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for module in (utils, fused_softmax):
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = _causal_mask
        if hasattr(module, "get_sliding_window_causal_mask"):
            module.get_sliding_window_causal_mask = _sliding_window_mask


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The model-parallel RNG tracker, forking the CPU generator instead of CUDA's."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        if force_reset or mrandom._CUDA_RNG_STATE_TRACKER is None or not isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker
        ):
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    original_seed = mrandom.model_parallel_cuda_manual_seed

    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        initialize_rng_tracker(force_reset=True)
        cuda_manual_seed = torch.cuda.manual_seed
        torch.cuda.manual_seed = lambda *_a, **_k: None  # type: ignore[assignment]
        try:
            original_seed(seed, *args, **kwargs)
        finally:
            torch.cuda.manual_seed = cuda_manual_seed  # type: ignore[assignment]

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    initialize_rng_tracker(force_reset=True)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    for name, seed in (
        (mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, 1234),
        (mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, 1234 + 2718),
        (mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, 1234 + 1024),
    ):
        if name not in tracker.states_:
            tracker.add(name, seed)


def _patch_schedules() -> None:
    """Pipeline schedules create one tensor with ``device="cuda"``; make that the CPU."""
    try:
        from megatron.core.pipeline_parallel import schedules
    except Exception:  # pragma: no cover - schedules import optional pieces
        return
    original_tensor = torch.tensor

    def tensor_on_cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return original_tensor(*args, **kwargs)

    class _TorchProxy:
        """``schedules.torch`` with ``tensor`` creating CUDA-requested tensors on the CPU."""

        def __getattr__(self, name: str) -> Any:
            if name == "tensor":
                return tensor_on_cpu
            return getattr(torch, name)

    schedules.torch = _TorchProxy()  # type: ignore[attr-defined]
