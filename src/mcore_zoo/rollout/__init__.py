"""Rollout side: weight refit from a zoo-built model into a running inference engine.

* :mod:`~mcore_zoo.rollout.engine_format` - how an engine names, fuses and shards HF tensors
  (:data:`VLLM`, :data:`HF_NAMES`);
* :mod:`~mcore_zoo.rollout.plan` - the :class:`RefitPlan`, computed once, reused every step;
* :mod:`~mcore_zoo.rollout.program` - the receiving rank's data path for a plan (which parameter
  view or export tensor each shard comes from), bound on the plan's first refit and reused;
* :mod:`~mcore_zoo.rollout.adapter` - the :class:`EngineAdapter` interface (``begin`` /
  ``load_bucket`` / ``end``) and a reference :class:`DictAdapter`;
* :mod:`~mcore_zoo.rollout.vllm` - :class:`VLLMAdapter` and the worker extension for ``vllm.LLM``;
* :mod:`~mcore_zoo.rollout.sglang` - :class:`SGLangAdapter` (``update_weights_from_tensor``);
  :mod:`~mcore_zoo.rollout.sglang_broadcast` - :class:`SGLangBroadcastAdapter` (SGLang engines in
  other processes, ``update_weights_from_distributed``) and :class:`SGLangServer` (one over HTTP);
* :mod:`~mcore_zoo.rollout.fp8` / :mod:`~mcore_zoo.rollout.vllm_fp8` - refit into an engine serving
  FP8 block-quantized weights (:class:`Fp8BlockAdapter`, :class:`VLLMFp8Adapter`), quantized on
  the trainer's device;
* :func:`refit` - the call a trainer makes every step;
* :mod:`~mcore_zoo.rollout.transfer` - the :class:`TransferPlan` of a disaggregated refit (which
  trainer rank sends which engine shard);
* :mod:`~mcore_zoo.rollout.disagg` - :class:`DisaggSender` (trainer ranks) and
  :class:`EngineReceiver` (engine ranks): trainer and engine in separate processes, one refit
  group between them; :mod:`~mcore_zoo.rollout.vllm_disagg` - its engine side in vLLM (a worker
  extension).

See docs/rollout.md.
"""

from __future__ import annotations

from .adapter import DictAdapter, EngineAdapter, RefitBucket
from .disagg import DisaggSender, EngineReceiver, IntegrityError
from .engine_format import (
    HF_NAMES,
    VLLM,
    VLLM_EP,
    VLLM_EP_ROUND_ROBIN,
    EngineFormat,
    ExpertFusion,
    Fusion,
    StackedExpertLayout,
    get_engine_format,
)
from .plan import EngineTensor, RefitPlan, Slot, plan_refit
from .refit import RefitStats, get_plan, refit
from .fp8 import Fp8BlockAdapter, fp8_refit_plan
from .sglang import SGLangAdapter
from .sglang_broadcast import SGLangBroadcastAdapter, SGLangServer
from .transfer import TransferPlan, plan_transfer
from .vllm import EXTENSION as VLLM_WORKER_EXTENSION
from .vllm import VLLMAdapter, ZooWorkerExtension
from .vllm_fp8 import FP8_WORKER_EXTENSION, VLLMFp8Adapter, ZooFp8WorkerExtension

__all__ = [
    "refit", "get_plan", "plan_refit", "RefitPlan", "RefitStats", "Slot", "EngineTensor",
    "EngineAdapter", "RefitBucket", "DictAdapter", "VLLMAdapter", "ZooWorkerExtension", "SGLangAdapter",
    "SGLangBroadcastAdapter", "SGLangServer",
    "VLLM_WORKER_EXTENSION", "EngineFormat", "Fusion", "ExpertFusion", "StackedExpertLayout", "VLLM", "VLLM_EP", "VLLM_EP_ROUND_ROBIN", "HF_NAMES",
    "get_engine_format",
    "Fp8BlockAdapter", "fp8_refit_plan", "VLLMFp8Adapter", "ZooFp8WorkerExtension", "FP8_WORKER_EXTENSION",
    "DisaggSender", "EngineReceiver", "IntegrityError", "TransferPlan", "plan_transfer",
]  # fmt: skip
