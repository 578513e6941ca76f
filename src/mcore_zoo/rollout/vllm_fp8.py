"""Refit a bf16-trained model into an in-process ``vllm.LLM`` serving FP8 block-quantized weights.

Start the engine on an FP8 block checkpoint of the model (``save_hf_checkpoint(model, d,
fp8="block")``) with this module's worker extension, then refit through :class:`VLLMFp8Adapter`::

    llm = vllm.LLM(model=d, worker_extension_cls=FP8_WORKER_EXTENSION)   # quantization from config.json
    adapter = VLLMFp8Adapter(llm)                                         # mode="reload"
    mcore_zoo.refit(model, adapter)

Quantization runs on the trainer's device (:class:`~mcore_zoo.rollout.fp8.Fp8BlockAdapter`); what
the engine does with the fp8 tensors and their scales is vLLM 0.26's own load path, so a refit
lands as a fresh load of the same checkpoint would. After loading, vLLM hands each FP8 layer to
its kernel (``process_weights_after_loading``), and some kernels change the tensors: DeepGEMM (on
Hopper / Blackwell when the ``deep_gemm`` package is installed) requantizes every block to
power-of-two scales (``VLLM_USE_DEEP_GEMM_E8M0``, on by default) and lays the scales out for its
TMA loads; FlashInfer's MoE kernels swap or permute the expert rows; Marlin repacks. The CUTLASS
and Triton block-scaled linear kernels and the Triton / CUTLASS MoE backends keep the loader's
tensors as they are (on CUDA ``process_fp8_weight_block_strategy`` changes nothing). Two modes:

* ``"reload"`` (default): whole HF tensors (fp8 weights, ``weight_scale_inv``, the rest in bf16)
  go through vLLM's layerwise weight reload - the path of its own ``reload_weights``:
  ``initialize_layerwise_reload`` when the refit begins (every layer back to its checkpoint
  layout), the model's ``load_weights`` per bucket (each layer is loaded, processed by its kernel
  and copied into its existing tensors once all its weights have come, so captured CUDA graphs
  stay valid), ``finalize_layerwise_reload`` at the end (attention layers, MLA's ``W_UK_T`` /
  ``W_UV`` from the new ``kv_b_proj``). Exact for every kernel: the engine runs the same code on
  the same bytes as when it loaded the checkpoint.
* ``"direct"``: the engine's TP shards, fused and named as vLLM holds them (``qkv_proj.weight``
  fp8 and ``qkv_proj.weight_scale_inv``, ``w13_weight`` / ``w13_weight_scale_inv``), copied in
  place - no loader runs. Exact only where every FP8 layer's kernel keeps the loader's tensors;
  ``begin`` refuses, naming the layer and its kernel, an engine where one does not.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ZooError
from ..weights.fp8_quantize import Fp8BlockScheme
from .fp8 import Fp8BlockAdapter
from .vllm import VLLMAdapter, ZooWorkerExtension, _check

FP8_WORKER_EXTENSION = "mcore_zoo.rollout.vllm_fp8.ZooFp8WorkerExtension"

#: vLLM 0.26's FP8 block-scaled linear kernels whose post-load processing keeps the loader's tensors
LOADER_LAYOUT_LINEAR_KERNELS = ("CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")
#: its FP8 MoE backends that keep the loader's experts and scales (``convert_to_fp8_moe_kernel_format``)
LOADER_LAYOUT_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS")


def fp8_relayout(module: Any) -> Optional[str]:
    """The kernel of an FP8 layer that changes its tensors after loading (``None``: the loader's
    tensors are the kernel's, or the module is not an FP8 layer). Found by class name: vLLM is
    imported in the worker only."""
    method = getattr(module, "quant_method", None)
    kind = type(method).__name__
    if kind == "Fp8LinearMethod":
        kernel = type(getattr(method, "fp8_linear", None)).__name__
        if getattr(method, "use_marlin", False) or kernel not in LOADER_LAYOUT_LINEAR_KERNELS:
            return f"linear kernel {kernel}"
    elif kind == "Fp8MoEMethod":
        backend = getattr(getattr(method, "fp8_backend", None), "name", str(getattr(method, "fp8_backend", None)))
        if backend not in LOADER_LAYOUT_MOE_BACKENDS:
            return f"MoE backend {backend}"
    return None


class ZooFp8WorkerExtension(ZooWorkerExtension):
    """:class:`~mcore_zoo.rollout.vllm.ZooWorkerExtension` with the FP8 refit's engine side
    (module docstring): mode ``"reload"`` through vLLM's layerwise weight reload, and direct
    writes refused into FP8 layers whose kernel changes their tensors after loading."""

    def zoo_fp8_ready(self) -> bool:
        """Whether this worker takes FP8 refits (:class:`VLLMFp8Adapter` asks)."""
        return True

    def zoo_refit_begin(self, plan_id: int, manifests: Optional[list[Any]], mode: str,
                        counts: Optional[list[list[int]]] = None, fused: bool = False) -> Optional[str]:  # fmt: skip
        if mode == "direct":
            relaid = [(name, why) for name, module in self._zoo_modules("fp8-relayout", lambda m: fp8_relayout(m) is not None)
                      for why in [fp8_relayout(module)]]  # fmt: skip
            if relaid:
                shown = "; ".join(f"{name}: {why}" for name, why in relaid[:4])
                return (f"{len(relaid)} FP8 layer(s) run kernels that change their tensors after loading ({shown});"
                        " refit them with VLLMFp8Adapter(llm, mode='reload') (vLLM's layerwise reload)")  # fmt: skip
            return super().zoo_refit_begin(plan_id, manifests, mode, counts, fused)
        if mode != "reload":
            return super().zoo_refit_begin(plan_id, manifests, mode, counts, fused)
        error = super().zoo_refit_begin(plan_id, manifests, "load_weights", counts, fused)
        if error:
            return error
        try:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            with torch.no_grad():
                initialize_layerwise_reload(self._zoo_model())
        except Exception as exc:  # reported to the trainer through collective_rpc
            return f"refit begin: vLLM's layerwise reload failed: {type(exc).__name__}: {exc}"
        self._zoo_reloading = True
        return None

    def zoo_refit_end(self) -> Optional[str]:
        if getattr(self, "_zoo_reloading", False):
            self._zoo_reloading = False
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                config = getattr(self, "model_config", None) or self.vllm_config.model_config  # type: ignore[attr-defined]
                with torch.no_grad():
                    finalize_layerwise_reload(self._zoo_model(), config)
            except Exception as exc:  # reported to the trainer through collective_rpc
                return f"refit end: vLLM's layerwise reload failed: {type(exc).__name__}: {exc}"
        return super().zoo_refit_end()


class VLLMFp8Adapter(Fp8BlockAdapter):
    """A ``vllm.LLM`` serving FP8 block weights, started with ``worker_extension_cls=``
    :data:`FP8_WORKER_EXTENSION` (module docstring).

    Args:
        llm: the engine.
        mode: ``"reload"`` (whole HF tensors through vLLM's layerwise reload: exact for every
            kernel) or ``"direct"`` (engine shards copied in place; refused where a kernel
            changes its tensors after loading).
        scheme: the FP8 block format (default: 128 x 128 blocks, fp32 scales), the one of the
            checkpoint the engine was started from.
        kwargs: :class:`~mcore_zoo.rollout.vllm.VLLMAdapter`'s options (``transport``,
            ``tp_size``, ``reset_prefix_cache``, ``engine_rank``, ``fused_copies``).
    """

    def __init__(self, llm: Any, *, mode: str = "reload", scheme: Optional[Fp8BlockScheme] = None, **kwargs: Any) -> None:
        if mode not in ("reload", "direct"):
            raise ValueError(f"mode must be 'reload' or 'direct', got {mode!r}")
        inner = VLLMAdapter(llm, mode="load_weights" if mode == "reload" else "direct", **kwargs)
        if mode == "reload":
            inner.mode = "reload"  # the worker's begin: load_weights inside vLLM's layerwise reload
        try:
            ready = llm.collective_rpc("zoo_fp8_ready")
        except Exception as exc:
            raise ZooError(f"VLLMFp8Adapter: the engine's workers take no FP8 refit ({type(exc).__name__}: {exc});"
                           f" start it with worker_extension_cls={FP8_WORKER_EXTENSION!r}") from None  # fmt: skip
        _check([None if r else "not ready" for r in ready], "FP8 setup")
        super().__init__(inner, scheme)
        self.fp8_mode = mode


__all__ = ["VLLMFp8Adapter", "ZooFp8WorkerExtension", "FP8_WORKER_EXTENSION", "fp8_relayout",
           "LOADER_LAYOUT_LINEAR_KERNELS", "LOADER_LAYOUT_MOE_BACKENDS"]  # fmt: skip
