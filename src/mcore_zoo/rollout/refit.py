""":func:`refit`: push a zoo-built model's weights into a running inference engine.

Every rank of the training job calls it (the export gathers over TP / EP and moves buckets over
PP); one rank, ``receiver``, holds the engine adapter and feeds the engine::

    adapter = mcore_zoo.rollout.VLLMAdapter(llm)             # an in-process vllm.LLM
    for step in range(...):
        train_step(model)
        mcore_zoo.refit(model, adapter if rank == 0 else None)  # plan computed on the first call

The :class:`~mcore_zoo.rollout.plan.RefitPlan` is computed on the first call for a (model, engine_format,
engine TP, dtype, bucket size) and cached on the model's handle (weakly), or passed as ``plan=``;
the receiving rank's data path for it (:class:`~mcore_zoo.rollout.program.RefitProgram`: which
parameter view or export tensor every shard comes from, in which bucket and position) is bound on
the first refit with that plan and cached too. Later calls reuse both and only move data. Tensors
stay on the model's device: with trainer and engine on one GPU the whole refit is device-to-device.

One refit, in order: the handle's export steps (what every export reads); the route every rank
agrees on (engine format and TP from the receiver, the receiving rank's data path); the plan; the
program bound to the steps; then the data: the export stream (when the program needs it) and the
buckets fed to the engine.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ..distributed.collectives import all_true, broadcast_text
from ..distributed.export import hf_items
from ..errors import ZooError
from ..handle import ModelHandle, handle_of
from ..model_groups import refuse_part_of_job
from ..weights.export import hf_copies
from . import program as programs
from .adapter import EngineAdapter, RefitBucket
from .engine_format import ENGINE_FORMATS, EngineFormat, get_engine_format
from .plan import RefitPlan, plan_refit

Model = Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]]

_PLANS: "weakref.WeakKeyDictionary[ModelHandle, dict[Any, RefitPlan]]" = weakref.WeakKeyDictionary()


@dataclass
class RefitStats:
    """What one :func:`refit` did (on the receiving rank; other ranks get zeros)."""

    buckets: int
    tensors: int
    nbytes: int
    seconds: float
    planned: bool  # this call computed the plan
    #: the receiving rank's data path: "local" (views of the parameters), "tp-local" (views of this
    #: rank's TP chunks, for its own engine rank) or "stream" (the export)
    source: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def get_plan(
    model: Model,
    *,
    engine_format: Union[str, EngineFormat] = "vllm",
    target_tp: int = 1,
    dtype: Optional[torch.dtype] = None,
    bucket_size: Union[int, str] = "1GB",
) -> RefitPlan:
    """The cached :class:`RefitPlan` for these settings, computed on first use (collective over the
    pipeline group: every rank calls it the same number of times)."""
    return _cached_plan(handle_of(model), get_engine_format(engine_format), target_tp, dtype, bucket_size)


def _cached_plan(handle: ModelHandle, engine_format: EngineFormat, target_tp: int, dtype: Optional[torch.dtype],
                 bucket_size: Union[int, str]) -> RefitPlan:  # fmt: skip
    """:func:`get_plan` of a handle and an engine format."""
    key = (engine_format, target_tp if engine_format.presplit else 1, dtype, str(bucket_size))
    cache = _PLANS.setdefault(handle, {})
    if key not in cache:
        cache[key] = plan_refit(handle, engine_format, target_tp=target_tp, dtype=dtype, bucket_size=bucket_size)
    return cache[key]


def refit(
    model: Model,
    adapter: Optional[EngineAdapter],
    *,
    plan: Optional[RefitPlan] = None,
    bucket_size: Union[int, str] = "1GB",
    target_tp: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    receiver: Union[int, str] = 0,
) -> RefitStats:
    """Send the model's weights to an engine through ``adapter`` (see module docstring).

    Args:
        model: a zoo-built model (chunk, list of chunks or handle), any TP / PP / VPP / EP layout.
        adapter: the engine on global rank ``receiver``; other ranks pass ``None`` (or anything:
            it is not used there).
        plan: a plan from :func:`get_plan` / :func:`~mcore_zoo.rollout.plan.plan_refit`; default:
            the cached plan for ``adapter.engine_format``, ``target_tp`` (default ``adapter.tp_size``),
            ``dtype`` and ``bucket_size``.
        bucket_size: bytes per engine call (all engine ranks' shards), e.g. ``"1GB"``.
        target_tp: the engine's tensor-parallel size (default: the adapter's).
        dtype: cast tensors before they travel (``None``: the parameters' dtype).
        receiver: global rank that talks to the engine, or ``"all"``: every rank receives every
            tensor and has its own adapter (one engine rank per trainer rank, e.g. vLLM's
            ``external_launcher`` executor; each engine rank keeps its own shards). When the
            adapters name their engine rank (``adapter.engine_rank``, the trainer's TP rank) and
            trainer TP equals engine TP (PP / EP 1), each rank sends only its engine rank's shards,
            cut from its own TP chunks without gathering them (``RefitStats.source ==
            "tp-local"``; :mod:`mcore_zoo.rollout.program`).

    Every rank of the job must call it (it gathers over TP / EP / PP). When the receiver fails
    (the engine refuses the plan, a bucket fails), it still runs the export to its end so that the
    other ranks' gathers complete, then raises. Raises
    :class:`~mcore_zoo.errors.ZooError` when the stream and the plan disagree (a plan made for
    another model) or when the adapter reports an incomplete refit.
    """
    handle = handle_of(model)
    handle.check_current()
    refuse_part_of_job(handle.placement, "refit")
    steps = handle.export_steps()  # what the export and the program read, as plain values
    copies = hf_copies(handle.weight_map)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ZooError(f"refit: dtype={dtype!r} is not a floating-point torch dtype (weights travel as floats:"
                       " torch.bfloat16, torch.float16 or torch.float32)")  # fmt: skip
    receive = receiver == "all" or handle.placement.rank == receiver
    route = _route(handle, adapter if receive else None, plan, receiver, target_tp)
    planned = plan is None
    if plan is None:
        before = len(_PLANS.get(handle, {}))
        plan = _cached_plan(handle, route.engine_format, route.tp, dtype, bucket_size)  # type: ignore[arg-type]
        planned = len(_PLANS.get(handle, {})) > before
    if plan.architecture != handle.arch_config.architecture:
        raise ZooError(f"refit: plan is for {plan.architecture}, model is {handle.arch_config.architecture}")
    program, failure = None, None
    if receive:
        assert adapter is not None
        if plan.engine_format != adapter.engine_format:
            raise ZooError(f"refit: plan made for the {plan.engine_format.name!r} engine format, adapter wants {adapter.engine_format.name!r}")
        if adapter.engine_format.presplit and plan.target_tp != adapter.tp_size:
            raise ZooError(f"refit: plan cut for engine tp={plan.target_tp}, adapter has tp={adapter.tp_size}")
        _sync(handle)
        t0 = time.perf_counter()
        try:
            program = programs.program_for(handle, plan, steps, copies, raw_shards=bool(getattr(adapter, "raw_shards", False)),
                                           source=route.source, engine_rank=route.engine_rank)  # fmt: skip
        except Exception as exc:
            failure = exc
    stream = None
    if not receive or route.source == "stream":  # the export the plan's buckets are cut from (it gathers)
        ranks = None if not handle.placement.distributed or receiver == "all" else [int(receiver)]
        stream = hf_items(steps, handle.weight_map, handle.placement, handle.device, dtype=plan.dtype, ranks=ranks,
                          limit=plan.bucket_size)  # fmt: skip
    try:
        if failure is not None:
            raise failure
        if program is None:  # not a receiving rank: its part of the gathers
            deque(stream, maxlen=0)
            return RefitStats(0, 0, 0, 0.0, planned)
        nbytes, tensors = _feed(adapter, plan, program, stream)  # type: ignore[arg-type]
    except Exception:
        # keep the other ranks' gathers matched: they are iterating the same export
        try:
            deque(stream or (), maxlen=0)
        except Exception:  # noqa: S110 - the first error is the one to report
            pass
        raise
    _sync(handle)
    return RefitStats(len(plan.buckets), tensors, nbytes, time.perf_counter() - t0, planned, program.source)


@dataclass(frozen=True)
class _Route:
    """How this rank takes part in one refit, agreed by every rank before any data moves: the
    plan's engine format and TP size (what :func:`get_plan` is asked for when no plan is given), and
    the receiving rank's data path (``source``: :mod:`mcore_zoo.rollout.program`) with the engine
    rank it feeds (``receiver="all"`` with adapters that name it)."""

    engine_format: Optional[EngineFormat]
    tp: int
    source: str
    engine_rank: Optional[int]


def _route(handle: ModelHandle, adapter: Optional[EngineAdapter], plan: Optional[RefitPlan], receiver: Union[int, str],
           target_tp: Optional[int]) -> _Route:  # fmt: skip
    """The :class:`_Route` of this rank (``adapter``: ``None`` off the receiving ranks). The local
    sources read the parameters directly (no export stream): ``"local"`` without any collective,
    ``"tp-local"`` with the TP all-gathers of the few rules no rank holds its engine shard of; the
    ranks of a TP group vote, so that all of them take the same path. Without ``plan``, only the
    receiver knows the engine when ``receiver`` is one rank: it tells the others."""
    engine_format: Optional[EngineFormat] = None if plan is None else plan.engine_format
    tp = 1 if plan is None else plan.target_tp
    if plan is None and receiver == "all":
        if adapter is None:
            raise ZooError(f"refit: rank {handle.placement.rank} receives (receiver='all') but has no engine adapter")
        engine_format, tp = adapter.engine_format, target_tp if target_tp is not None else adapter.tp_size
    engine_rank = getattr(adapter, "engine_rank", None) if receiver == "all" else None
    source = "local" if programs.local_source(handle) else "stream"
    vote = source == "stream" and receiver == "all" and handle.placement.tp > 1
    if vote:
        planned_tp = tp if engine_format.presplit else 1  # type: ignore[union-attr]
        vote = programs.tp_local_source(handle, planned_tp, engine_rank)
    if plan is None and receiver != "all":
        engine_format, tp = _settings_from_receiver(handle, adapter, int(receiver), target_tp)
    elif source == "stream" and receiver == "all" and handle.placement.tp > 1:
        source = "tp-local" if all_true([vote], handle.placement.groups.tp)[0] else source
    return _Route(engine_format, tp, source, engine_rank)


def _feed(adapter: EngineAdapter, plan: RefitPlan, program: "programs.RefitProgram", stream: Any) -> tuple[int, int]:
    """The receiving rank's part: the program's buckets, one engine call each, between
    ``begin`` and ``end``. Returns ``(bytes, tensors)`` sent (the planned shards' bytes)."""
    adapter.begin(plan)
    nbytes = tensors = 0
    for index, items in program.buckets(stream):
        adapter.load_bucket(RefitBucket(index, items))
        del items
        nbytes += program.nbytes[index]
        tensors += program.tensors[index]
    adapter.end()
    return nbytes, tensors


def _sync(handle: ModelHandle) -> None:
    if handle.device.type == "cuda":
        torch.cuda.synchronize(handle.device)


def _settings_from_receiver(handle: ModelHandle, adapter: Optional[EngineAdapter], receiver: int,
                            target_tp: Optional[int]) -> tuple[EngineFormat, int]:  # fmt: skip
    """The plan's engine format and TP on every rank, as the receiver's adapter says: every rank
    computes the same plan (collective over PP) and issues the same gathers, whatever it passed
    as ``adapter``. The receiver broadcasts them (or its error, so that every rank fails with the
    same message instead of waiting); a rank that cannot resolve the format fails every rank."""
    if not handle.placement.distributed:
        if adapter is None:
            raise ZooError(f"refit: rank {receiver} receives but has no engine adapter")
        return adapter.engine_format, target_tp if target_tp is not None else adapter.tp_size
    if handle.placement.rank == receiver:
        if adapter is None:
            message = f"!refit: rank {receiver} receives but has no engine adapter"
        else:
            tp = target_tp if target_tp is not None else adapter.tp_size
            message = f"{adapter.engine_format.name}\n{int(tp)}"
    else:
        message = ""
    message = broadcast_text(message, receiver)
    if message.startswith("!"):
        raise ZooError(message[1:])
    name, tp_text = message.split("\n")
    if handle.placement.rank == receiver:
        engine_format: Optional[EngineFormat] = adapter.engine_format  # type: ignore[union-attr]
    else:
        engine_format = ENGINE_FORMATS.get(name)
    if not all_true([engine_format is not None], None)[0]:
        raise ZooError(f"refit: the receiver's engine format {name!r} is not registered on every rank; pass"
                       f" plan=get_plan(...) on every rank")  # fmt: skip
    return engine_format, int(tp_text)  # type: ignore[return-value]


__all__ = ["refit", "get_plan", "RefitStats"]
