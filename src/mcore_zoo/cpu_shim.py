"""Run Megatron-Core on a CPU-only machine (tests, CI, conversion without a GPU).

Megatron-Core assumes CUDA in a handful of places. This module patches exactly those, and only in
a process where CUDA is unavailable (:func:`activate` is a no-op when ``torch.cuda.is_available()``):

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` (RoPE moves ``inv_freq`` there;
  some buffers are created on it) and ``torch.cuda.synchronize()`` does nothing (distributed
  checkpointing syncs after staging tensors) - on such a machine the originals can only raise.
* the causal / sliding-window mask helpers that hard-code ``device="cuda"``;
* the model-parallel RNG tracker (which forks CUDA generator states) is replaced by one that
  forks CPU generator states, seeded per tensor-parallel rank like the original;
* pipeline schedules: ``batch_p2p_sync`` must be off on gloo, and the tensors the schedules
  create with ``device="cuda"`` are created on the CPU;
* the first/last pipeline stage all-reduce of tied embeddings, which moves the weight to CUDA
  first, keeps it on the CPU;
* DDP's gradient reduction (0.19): the ``torch.cuda.current_stream()`` it waits on for CUDA-graph
  replay events is a stream with nothing to wait for.

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

#: What :func:`activate` replaces, process-wide, in a process without CUDA: ``(module, attribute,
#: why)``. Listed with every other patch by :func:`mcore_zoo.specs.patching.patches`.
PATCHES = (
    ("torch.cuda", "current_device", "returns the CPU device: Megatron-Core puts RoPE and some buffers there"),
    ("torch.cuda", "synchronize", "does nothing: distributed checkpointing syncs after staging tensors"),
    ("megatron.core.transformer.utils", "get_default_causal_mask", "built on the CPU, not device='cuda'"),
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask", "built on the CPU, not device='cuda'"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask", "built on the CPU, not device='cuda'"),
    ("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask", "built on the CPU, not device='cuda'"),
    ("megatron.core.tensor_parallel.random", "initialize_rng_tracker",
     "a tracker that forks CPU generator states, seeded per tensor-parallel rank like the original"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", "seeds that CPU tracker"),
    ("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed", "seeds that CPU tracker"),
    ("megatron.core.pipeline_parallel.schedules", "torch", "tensors the schedules create with device='cuda' are made on the CPU"),
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer",
     "the tied-embedding all-reduce of the first and last stage keeps the weight on the CPU"),
    ("megatron.core.distributed.param_and_grad_buffer", "torch",
     "DDP's gradient reduction (0.19) waits on a CUDA stream that has nothing to wait for"),
    ("megatron.core.utils", "torch", "tensors it creates with device='cuda' (the local multi-tensor L2 norm) are made on the CPU"),
    ("megatron.core.optimizer.clip_grads", "torch", "tensors the gradient norm and clipping create with device='cuda' are made on the CPU"),
    ("megatron.core.optimizer.optimizer", "torch", "tensors the optimizers create with device='cuda' (loss scale, found-inf flag) are made on the CPU"),
    ("megatron.core.optimizer.distrib_optimizer", "torch", "tensors the distributed optimizer creates with device='cuda' are made on the CPU"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
     "sees CUDA type names from Tensor.type() while it runs (it asserts fp32 gradients by that name)"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups",
     "sees CUDA type names from Tensor.type() while it runs (it sorts parameters by dtype by that name)"),
)  # fmt: skip


def active() -> bool:
    """Whether :func:`activate` installed the CPU patches in this process."""
    return _ACTIVE


def needed() -> bool:
    return not torch.cuda.is_available()


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
        _patch_tied_embedding_setup()
        _patch_grad_sync_stream()
        _patch_optimizer()
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


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _patch_schedules() -> None:
    """Pipeline schedules create tensors with ``device="cuda"`` (0.16 and 0.19:
    ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``); create them on the CPU."""
    try:
        from megatron.core.pipeline_parallel import schedules
    except Exception:  # pragma: no cover - schedules import optional pieces
        return

    schedules.torch = _torch_on_cpu()  # type: ignore[attr-defined]


def _on_cpu(factory: Any) -> Any:
    """``factory`` (``torch.zeros``, ...) making on the CPU what is asked for on ``"cuda"``."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def _torch_on_cpu() -> "_ModuleProxy":
    """``torch`` as a Megatron-Core module sees it here: tensor factories put CUDA-requested
    tensors on the CPU (calls that would fail without CUDA; every other call is unchanged)."""
    return _ModuleProxy(torch, {name: _on_cpu(getattr(torch, name)) for name in _FACTORIES})


def _cuda_type_names(function: Any) -> Any:
    """``function`` seeing CUDA type names from ``Tensor.type()`` (``"torch.cuda.FloatTensor"`` for a
    CPU fp32 tensor) while it runs: Megatron-Core's optimizer sorts parameters by those names."""
    if getattr(function, "_mcore_zoo_cpu", False):
        return function

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        original = torch.Tensor.type

        def named(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            result = original(tensor, *a, **k)
            if not a and not k and isinstance(result, str) and not result.startswith("torch.cuda."):
                return result.replace("torch.", "torch.cuda.", 1)
            return result

        torch.Tensor.type = named  # type: ignore[assignment]
        try:
            return function(*args, **kwargs)
        finally:
            torch.Tensor.type = original  # type: ignore[assignment]

    call._mcore_zoo_cpu = True  # type: ignore[attr-defined]
    return call


def _patch_optimizer() -> None:
    """Megatron-Core's optimizer path (``get_megatron_optimizer``, the distributed optimizer, the
    gradient norm and clipping) on the CPU: the modules that create tensors with
    ``device="cuda"`` make them on the CPU, and the two functions that sort parameters by their
    CUDA type names see those names."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for module in (utils, clip_grads, optimizer, distrib_optimizer):
        module.torch = _torch_on_cpu()  # type: ignore[attr-defined]
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip  # type: ignore[attr-defined]
    groups = distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups = classmethod(  # type: ignore[method-assign]
        _cuda_type_names(groups.__func__))


class _ModuleProxy:
    """A module as one Megatron-Core module sees it: ``overrides`` in place of some attributes."""

    def __init__(self, module: Any, overrides: dict[str, Any]) -> None:
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


class _IdleStream:
    """``torch.cuda.current_stream()`` where nothing runs asynchronously: nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


def _patch_grad_sync_stream() -> None:
    """0.19: DDP's ``_ParamAndGradBucketGroup.start_grad_sync`` calls ``torch.cuda.current_stream()``
    on every gradient reduction, to wait for the events of CUDA-graph replays (none here); 0.16
    calls it only with several distributed-optimizer instances. That module's ``torch.cuda`` returns
    an idle stream there."""
    from megatron.core.distributed import param_and_grad_buffer

    stream = _IdleStream()
    cuda = _ModuleProxy(torch.cuda, {"current_stream": lambda *_a, **_k: stream})
    param_and_grad_buffer.torch = _ModuleProxy(torch, {"cuda": cuda})  # type: ignore[attr-defined]


def _patch_tied_embedding_setup() -> None:
    """``LanguageModule.setup_embeddings_and_output_layer`` moves the shared embedding to CUDA
    (``weight.data = weight.data.cuda()``) before the first/last-stage all-reduce of tied weights
    (pipeline parallel only); keep it on the CPU for that call."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_mcore_zoo_cpu", False):
        return

    @functools.wraps(original)
    def setup(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[assignment]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[assignment]

    setup._mcore_zoo_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup  # type: ignore[assignment]
