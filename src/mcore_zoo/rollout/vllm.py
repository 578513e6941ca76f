"""Refit into an in-process ``vllm.LLM``: the adapter (trainer side) and the worker extension
(engine side).

Start the engine with the zoo's worker extension, then refit through the adapter::

    llm = vllm.LLM(model=hf_dir, tensor_parallel_size=2,
                   worker_extension_cls="mcore_zoo.rollout.vllm.ZooWorkerExtension")
    adapter = VLLMAdapter(llm)
    mcore_zoo.refit(model, adapter)

Two modes:

* ``"direct"`` (default): the plan's shards, already fused and split the way vLLM holds them
  (``qkv_proj``, ``gate_up_proj``, ``experts.routed_experts.w13_weight`` / ``w2_weight``, the
  vocabulary padded to 64 rows), are copied into the engine's parameters by name, in place - no
  vLLM weight loader runs. ``begin`` sends the engine the plan's manifest once; every worker checks
  that each named parameter exists with the planned shape and dtype before the first byte moves,
  and ``end`` checks that every element of every planned parameter was written.
* ``"load_weights"``: whole tensors under HF names go through the model's own ``load_weights``
  (vLLM fuses and splits): slower, but it follows whatever the engine's loaders do.

Transport: when the engine's workers run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
with one worker: ``UniProcExecutor``), ``collective_rpc`` hands the shards over as they are (views
of the gathered tensors; one device-to-device copy into each parameter). Otherwise each bucket is
packed into one flat buffer per engine rank and sent as a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``); the worker opens it and copies from it.

The worker-extension methods are what ``collective_rpc`` calls by name:
``zoo_refit_begin(manifests, mode)``, ``update_weights_from_buckets(index, payloads)``,
``zoo_refit_end()``. This module imports vLLM only inside the worker methods.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..errors import ZooError
from .adapter import EngineAdapter, RefitBucket, write_slot
from .engine_format import HF_NAMES, VLLM, EngineFormat

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan

EXTENSION = "mcore_zoo.rollout.vllm.ZooWorkerExtension"

_ALIGN = 256  # bytes between tensors packed into one buffer

#: vLLM unquantized MoE backends whose runtime expert layout is the loader's (w13 = [w1; w3])
_LOADER_LAYOUT_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "CPU")


class VLLMAdapter(EngineAdapter):
    """A running ``vllm.LLM`` started with ``worker_extension_cls=`` :data:`EXTENSION`.

    Args:
        llm: the engine.
        mode: ``"direct"`` or ``"load_weights"`` (module docstring).
        transport: ``"auto"`` (objects in-process, CUDA IPC otherwise), ``"inproc"`` or ``"ipc"``.
        tp_size: the engine's tensor-parallel size (default: read from the engine's config).
        reset_prefix_cache: after a refit, drop vLLM's cached KV blocks (computed with the old
            weights) through ``llm.reset_prefix_cache()``.
    """

    def __init__(self, llm: Any, *, mode: str = "direct", transport: str = "auto", tp_size: Optional[int] = None,
                 reset_prefix_cache: bool = True) -> None:  # fmt: skip
        if mode not in ("direct", "load_weights"):
            raise ValueError(f"mode must be 'direct' or 'load_weights', got {mode!r}")
        self.llm = llm
        self.mode = mode
        self.engine_format: EngineFormat = VLLM if mode == "direct" else HF_NAMES
        self.tp_size = tp_size if tp_size is not None else _engine_tp(llm)
        self.transport = _transport(llm) if transport == "auto" else transport
        self.reset_prefix_cache = reset_prefix_cache
        self._manifest_for: Optional[int] = None

    def begin(self, plan: "RefitPlan") -> None:
        # the manifest travels once per plan; later refits with the same plan send only its id
        manifests = None if self._manifest_for == id(plan) else [plan.manifest(r) for r in range(plan.target_tp)]
        _check(self.llm.collective_rpc("zoo_refit_begin", args=(id(plan), manifests, self.mode)), "begin")
        self._manifest_for = id(plan)

    def load_bucket(self, bucket: RefitBucket) -> None:
        if self.transport == "inproc":
            payloads: list[Any] = [[(s.name, s.expert, s.offset, s.pad, t) for s, t in per] for per in bucket.items]
        else:
            payloads = [_pack(per) for per in bucket.items]
        _check(self.llm.collective_rpc("update_weights_from_buckets", args=(bucket.index, payloads)), "bucket")

    def end(self) -> None:
        _check(self.llm.collective_rpc("zoo_refit_end"), "end")
        if self.reset_prefix_cache and hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()


def _engine_tp(llm: Any) -> int:
    config = llm.llm_engine.vllm_config
    return int(config.parallel_config.tensor_parallel_size)


def _transport(llm: Any) -> str:
    """``inproc`` when the engine's worker lives in this process (an in-process engine core with
    ``UniProcExecutor``, or ``ExecutorWithExternalLauncher``: one engine rank per trainer rank)."""
    executor = type(getattr(llm.llm_engine, "model_executor", None)).__name__
    return "inproc" if executor in ("UniProcExecutor", "ExecutorWithExternalLauncher") else "ipc"


def _check(results: list[Any], what: str) -> None:
    errors = [r for r in results if r]
    if errors:
        raise ZooError(f"vLLM refit {what} failed on {len(errors)} worker(s): " + " | ".join(map(str, errors[:4])))


def _pack(items: list[tuple[Any, torch.Tensor]]) -> tuple[Any, list[tuple[Any, ...]]]:
    """One flat buffer per engine rank (on the tensors' device) + ``(name, expert, offset, pad,
    byte_start, shape, dtype)`` per slot; the buffer travels as a CUDA IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, total = [], 0
    for slot, t in items:
        metas.append((slot.name, slot.expert, slot.offset, slot.pad, total, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    device = items[0][1].device if items else torch.device("cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for (slot, t), meta in zip(items, metas):
        nbytes = t.numel() * t.element_size()
        buffer[meta[4] : meta[4] + nbytes].view(t.dtype).view(t.shape).copy_(t)
    handle = reduce_tensor(buffer) if buffer.is_cuda else buffer
    return handle, metas


def _unpack(payload: Any) -> list[tuple[str, Optional[int], int, int, torch.Tensor]]:
    handle, metas = payload
    if isinstance(handle, torch.Tensor):
        buffer = handle
    else:
        rebuild, args = handle
        args = list(args)
        args[6] = torch.cuda.current_device()  # open the handle on this worker's device (peer access)
        buffer = rebuild(*args)
    out = []
    for name, expert, offset, pad, start, shape, dtype in metas:
        dt = getattr(torch, dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        out.append((name, expert, offset, pad, buffer[start : start + nbytes].view(dt).view(shape)))
    return out


class ZooWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods run on every worker and
    return ``None`` on success or an error string (``collective_rpc`` gathers them)."""

    def _zoo_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _zoo_tp_rank(self) -> int:
        from vllm.distributed import parallel_state

        return parallel_state.get_tp_group().rank_in_group

    def _zoo_relayout_modules(self) -> list[tuple[str, Any]]:
        """MoE layers whose kernel keeps experts in its own layout after loading (FlashInfer
        CUTLASS swaps w13 to [w3; w1], FlashInfer TRT-LLM permutes blocks; Triton - vLLM's default on
        Hopper - keeps the loader's layout): ``(name, module)``."""
        found = []
        for name, module in self._zoo_model().named_modules():
            backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
            if backend is not None and getattr(backend, "name", str(backend)) not in _LOADER_LAYOUT_MOE_BACKENDS:
                found.append((name, module))
        return found

    def zoo_refit_begin(self, plan_id: int, manifests: Optional[list[Any]], mode: str) -> Optional[str]:
        model = self._zoo_model()
        self._zoo_mode = mode
        relayout = self._zoo_relayout_modules()
        if mode == "direct" and relayout:
            backend = relayout[0][1].quant_method.unquantized_backend
            return (f"{len(relayout)} MoE layer(s) run {backend}, which re-lays out expert weights after loading;"
                    " refit them with VLLMAdapter(llm, mode='load_weights') (vLLM's loaders, then its relayout)")  # fmt: skip
        self._zoo_params = dict(model.named_parameters(remove_duplicate=False))
        if manifests is not None:
            manifest = manifests[self._zoo_tp_rank()] if mode == "direct" else manifests[0]
            problems = []
            want: dict[str, int] = {}
            for name, expert, offset, shape, dtype, pad, rows in manifest:
                if mode != "direct" or name in want:
                    continue
                param = self._zoo_params.get(name)
                if param is None:
                    problems.append(f"no parameter {name!r}")
                    want[name] = 0
                    continue
                target_shape = tuple(param.shape[1:]) if expert is not None else tuple(param.shape)
                # dtypes may differ (GLM-4.5's router is fp32 in vLLM): ``copy_`` converts, as vLLM's
                # default weight loader does
                if target_shape[0] != rows or tuple(target_shape[1:]) != tuple(shape[1:]):
                    problems.append(f"{name}: engine {tuple(param.shape)}, plan rows {rows} x {tuple(shape[1:])}")
                want[name] = param.numel()
            if problems:
                return f"{len(problems)} plan/engine mismatch(es): " + "; ".join(problems[:8])
            self._zoo_manifest = (plan_id, want)
        elif getattr(self, "_zoo_manifest", (None,))[0] != plan_id:
            return "refit plan unknown to this worker (its manifest was never sent)"
        self._zoo_written: dict[str, int] = dict.fromkeys(self._zoo_manifest[1], 0)
        return None

    def update_weights_from_buckets(self, index: int, payloads: list[Any]) -> Optional[str]:
        try:
            rank = self._zoo_tp_rank()
            payload = payloads[rank] if self._zoo_mode == "direct" else payloads[0]
            items = payload if isinstance(payload, list) else _unpack(payload)
            with torch.no_grad():
                if self._zoo_mode == "load_weights":
                    self._zoo_model().load_weights([(name, t) for name, _, _, _, t in items])
                    return None
                for name, expert, offset, pad, tensor in items:
                    param = self._zoo_params[name]
                    self._zoo_written[name] += write_slot(param.data, expert, offset, pad, tensor.to(param.device))
            return None
        except Exception as exc:  # reported to the trainer through collective_rpc
            return f"bucket {index}: {type(exc).__name__}: {exc}"

    def zoo_refit_end(self) -> Optional[str]:
        if self._zoo_mode != "direct":
            # vLLM's RL update path: weights through the loaders, then the kernels' relayout
            # (``_setup_kernel`` copies into the existing storage on a weight update)
            with torch.no_grad():
                for _, module in self._zoo_relayout_modules():
                    module.quant_method.process_weights_after_loading(module)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._zoo_mode != "direct":
            return None
        short = [f"{n} ({w} of {self._zoo_manifest[1][n]} elements)" for n, w in self._zoo_written.items() if w != self._zoo_manifest[1][n]]
        if short:
            return f"refit incomplete: {len(short)} parameter(s) not fully written: " + "; ".join(short[:8])
        return None


__all__ = ["VLLMAdapter", "ZooWorkerExtension", "EXTENSION"]
