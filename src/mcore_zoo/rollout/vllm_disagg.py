"""The engine side of a disaggregated refit inside vLLM: a worker extension and the calls around it.

Start the engine with the extension, join the refit group once, then receive every step::

    llm = vllm.LLM(model=hf_dir, tensor_parallel_size=2, worker_extension_cls=DISAGG_EXTENSION)
    llm.collective_rpc("zoo_join_refit", args=(host, port, trainers, engines, engine_tp, replica * engine_tp))
    ...
    receive_refit(llm)            # while every trainer rank runs DisaggSender.send()

Each worker joins the :class:`~mcore_zoo.distributed.refit_group.RefitGroup` as refit rank
``trainers + replica * engine_tp + tp_rank`` (NCCL on its own GPU), takes its
:class:`~mcore_zoo.rollout.disagg.EngineReceiver`, and receives into the engine's own parameters:
with the vLLM engine format, the plan's fused, pre-split shards are written by name, in place, as
:class:`~mcore_zoo.rollout.vllm.VLLMAdapter` does in direct mode (the manifest checked against the
engine's parameters before the first byte, every element checked written at the end, MLA's
derived weights recomputed); with :data:`~mcore_zoo.rollout.engine_format.HF_NAMES`, whole
tensors go through the model's own ``load_weights``.

Pause and resume: a ``vllm.LLM`` runs nothing between its calls, so a refit between two
``generate`` calls needs no pause; :func:`receive_refit` then drops the prefix cache (KV blocks
computed with the old weights). An ``AsyncLLM`` serving requests is paused around the refit -
:func:`receive_refit_async`: ``pause_generation(mode=..., clear_cache=True)``, the receive,
``resume_generation()`` (docs/rollout.md, "Pause and resume").

vLLM is imported by vLLM itself (the extension is mixed into its worker class); nothing here
imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ..distributed.refit_group import RefitGroup
from ..errors import ZooError
from .adapter import EngineAdapter, RefitBucket
from .disagg import EngineReceiver, measure_link
from .vllm import ZooWorkerExtension

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan

DISAGG_EXTENSION = "mcore_zoo.rollout.vllm_disagg.ZooDisaggWorkerExtension"


class WorkerSink(EngineAdapter):
    """One vLLM worker's parameters as the sink of an :class:`EngineReceiver`: the worker
    extension's binding (direct mode) or ``load_weights`` (a format without pre-split shards).

    ``fused_copies``: in direct mode, write each bucket's plain byte copies with one launch where
    the worker's device has the kernel (:mod:`mcore_zoo.kernels.copy_runs`), as
    :class:`~mcore_zoo.rollout.vllm.VLLMAdapter` does colocated. The receiver's shards are the
    same views of its payload ring at every refit, so the kernel's table is built once."""

    def __init__(self, worker: ZooWorkerExtension, rank: int, *, fused_copies: bool = True) -> None:
        self.worker, self.rank, self.fused_copies = worker, rank, fused_copies

    def begin(self, plan: "RefitPlan") -> None:
        self.engine_format, self.tp_size = plan.engine_format, plan.target_tp
        mode = "direct" if plan.engine_format.presplit else "load_weights"
        self._where = self.rank if mode == "direct" else 0
        fused = self.fused_copies and mode == "direct"
        if getattr(self.worker, "_zoo_plan", (None,))[0] == id(plan):  # bound on an earlier refit: checked, not re-sent
            _raise(self.worker.zoo_refit_begin(id(plan), None, mode, None, fused))
            return
        manifests: list[Any] = [None] * plan.target_tp
        counts: list[Any] = [None] * plan.target_tp
        manifests[self._where], counts[self._where] = plan.manifest(self._where), plan.bucket_counts(self._where)
        _raise(self.worker.zoo_refit_begin(id(plan), manifests, mode, counts, fused))

    def load_bucket(self, bucket: RefitBucket) -> None:
        payloads: list[Any] = [None] * len(bucket.items)
        payloads[self._where] = [shard for _, shard in bucket.items[self.rank]]
        _raise(self.worker.update_weights_from_buckets(bucket.index, payloads))

    def end(self) -> None:
        _raise(self.worker.zoo_refit_end())


def _raise(error: Optional[str]) -> None:
    if error:
        raise ZooError(f"vLLM worker: {error}")


class ZooDisaggWorkerExtension(ZooWorkerExtension):
    """:class:`~mcore_zoo.rollout.vllm.ZooWorkerExtension` plus the disaggregated refit's engine
    side; methods return ``None`` on success or an error string (``collective_rpc`` gathers them)."""

    def zoo_join_refit(self, host: str, port: int, trainers: int, engines: int, engine_tp: int,
                       first_index: int = 0, timeout: float = 600.0) -> Optional[str]:  # fmt: skip
        """Join the refit group at ``host:port`` as engine process ``first_index + tp_rank``
        (``first_index``: this engine's replica times ``engine_tp``) and take the plan."""
        try:
            index = first_index + self._zoo_tp_rank()
            device = torch.device("cuda", torch.cuda.current_device())
            group = RefitGroup.join(host, port, rank=trainers + index, trainers=trainers, engines=engines, device=device,
                                    timeout=timeout)  # fmt: skip
            self._zoo_receiver = EngineReceiver(group, index, engine_tp=engine_tp)
            return None
        except Exception as exc:  # reported through collective_rpc
            return f"join: {type(exc).__name__}: {exc}"

    def zoo_receive_refit(self, fused_copies: bool = True) -> Optional[str]:
        """Receive one refit into this worker's parameters (:class:`WorkerSink`; ``fused_copies``
        as there)."""
        receiver: Optional[EngineReceiver] = getattr(self, "_zoo_receiver", None)
        if receiver is None:
            return "receive: not joined (zoo_join_refit first)"
        try:
            self._zoo_last_refit = receiver.receive(WorkerSink(self, receiver.rank, fused_copies=fused_copies))
            return None
        except Exception as exc:
            return f"receive: {type(exc).__name__}: {exc}"

    def zoo_receive_refit_profiled(self, path: str, fused_copies: bool = True) -> Optional[str]:
        """:meth:`zoo_receive_refit` under torch's profiler (CPU and, on CUDA, device activity) - a
        diagnosis of where a refit's time goes on the engine side: the ops by self device time to
        ``<path>-engine<rank>.txt`` and a Chrome trace to ``<path>-engine<rank>.json`` (``rank``: the
        worker's tensor-parallel rank)."""
        try:
            error, prof = profiled(lambda: self.zoo_receive_refit(fused_copies), torch.cuda.is_available())
            write_profile(prof, f"{path}-engine{self._zoo_tp_rank()}")
            return error
        except Exception as exc:
            return f"profiled receive: {type(exc).__name__}: {exc}"

    def zoo_refit_seconds(self) -> float:
        """Seconds of this worker's last receive (first header to the last write, synchronised)."""
        stats = getattr(self, "_zoo_last_refit", None)
        return stats.seconds if stats is not None else 0.0

    def zoo_measure_link(self, sender: int = 0, nbytes: int = 2**30, iters: int = 10, engine_rank: int = 0) -> Optional[dict]:
        """:func:`~mcore_zoo.rollout.disagg.measure_link` on the channel ``(sender, engine_rank)``:
        from trainer rank ``sender`` to engine rank ``engine_rank`` and its DP replicas (the sender
        and every member call it at the same time). ``None`` on a worker that is not a member.

        Only the named channel's members take part: a worker that measured every channel it holds
        would wait in broadcasts no trainer rank sends, and its refit messages would then meet
        those broadcasts (on NCCL, a hang). With the shared transport the worker alone measures
        its read of the sender's ring (``nbytes`` is then the ring's first buffer)."""
        receiver: Optional[EngineReceiver] = getattr(self, "_zoo_receiver", None)
        if receiver is None or receiver.rank != engine_rank or (sender, engine_rank) not in receiver.group.channels:
            return None
        if receiver.transport == "shared":  # the link is this worker's read of the sender's ring
            return receiver.measure_shared_read(sender, iters)
        return measure_link(receiver.group, (sender, engine_rank), nbytes, iters)

    def zoo_measure_paired_link(self, nbytes: int = 2**30, iters: int = 10) -> Optional[dict]:
        """:func:`~mcore_zoo.rollout.disagg.measure_link` on the channel from the trainer rank of
        this worker's index (``(rank, rank)``: trainer TP = engine TP), called on every worker at
        once while each trainer rank measures its own: every pair's link with all of them busy, as
        a refit uses them. ``None`` where this worker has no such channel or the transport is
        shared."""
        receiver: Optional[EngineReceiver] = getattr(self, "_zoo_receiver", None)
        if receiver is None or receiver.transport == "shared":
            return None
        return self.zoo_measure_link(receiver.rank, nbytes, iters, receiver.rank)

    def zoo_parameter_checksums(self, names: Optional[list[str]] = None) -> dict[str, list[int]]:
        """Per parameter (``names``, default all): :func:`tensor_checksum` of its bytes (exactness
        checks across processes)."""
        params = dict(self._zoo_model().named_parameters())
        return {name: tensor_checksum(p.data) for name, p in params.items() if names is None or name in names}


def profiled(fn: Any, cuda: bool) -> tuple[Any, Any]:
    """``(fn(), the finished torch.profiler.profile)``: ``fn`` run under torch's profiler with CPU
    activity, and CUDA activity when ``cuda`` (the device synchronised before the profile ends)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize()
    return result, prof


def write_profile(prof: Any, stem: str) -> None:
    """A finished profile's op table (40 rows by self device time; by CPU time without device
    activity) to ``stem + ".txt"`` and its Chrome trace to ``stem + ".json"``."""
    events = prof.key_averages()
    on_device = any(getattr(e, "self_device_time_total", 0) for e in events)
    with open(stem + ".txt", "w") as f:
        f.write(events.table(sort_by="self_device_time_total" if on_device else "self_cpu_time_total", row_limit=40) + "\n")
    prof.export_chrome_trace(stem + ".json")


def tensor_checksum(tensor: torch.Tensor) -> list[int]:
    """``[words, sum, weighted sum]`` of a tensor's bytes read as 16-bit words (the weighted sum
    multiplies word ``i`` by ``i mod 65521 + 1``: a moved word changes it). Equal for bitwise-equal
    tensors on any device; two tensors differing in any word almost surely differ here."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    words16 = flat.view(torch.int16)
    total = weighted = 0
    for start in range(0, words16.numel(), _CHECKSUM_CHUNK):  # chunks: a few int64 temporaries, not the tensor's 4x
        words = words16[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        weights = (torch.arange(words.numel(), device=words.device, dtype=torch.int64) + start) % 65521 + 1
        total += int(words.sum())
        weighted += int((words * weights).sum())
    return [int(words16.numel()), total, weighted]


#: 16-bit words per step of :func:`tensor_checksum`
_CHECKSUM_CHUNK = 1 << 26


def receive_refit(llm: Any, *, reset_prefix_cache: bool = True, fused_copies: bool = True) -> list[Optional[str]]:
    """Receive one refit in every worker of a ``vllm.LLM`` (blocking; the trainer ranks send at
    the same time), then drop the prefix cache. ``fused_copies``: :class:`WorkerSink`'s. Raises
    :class:`ZooError` naming a worker's error."""
    results = llm.collective_rpc("zoo_receive_refit", args=(fused_copies,))
    errors = [r for r in results if r]
    if errors:
        raise ZooError(f"disaggregated refit failed on {len(errors)} vLLM worker(s): " + " | ".join(map(str, errors[:4])))
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    return results


async def receive_refit_async(engine: Any, *, mode: str = "keep", fused_copies: bool = True) -> None:
    """Receive one refit in a serving ``AsyncLLM``: generation paused (``mode``: ``"keep"``
    freezes requests in flight and resumes them after, ``"wait"`` lets them finish first,
    ``"abort"`` drops them; the KV and prefix caches cleared), the workers receive
    (``fused_copies``: :class:`WorkerSink`'s), generation resumed. Raises :class:`ZooError` naming a worker's error (generation is resumed first)."""
    await engine.pause_generation(mode=mode, clear_cache=True)
    try:
        results = await engine.collective_rpc("zoo_receive_refit", args=(fused_copies,))
    finally:
        await engine.resume_generation()
    errors = [r for r in results if r]
    if errors:
        raise ZooError(f"disaggregated refit failed on {len(errors)} vLLM worker(s): " + " | ".join(map(str, errors[:4])))


__all__ = ["ZooDisaggWorkerExtension", "DISAGG_EXTENSION", "WorkerSink", "receive_refit", "receive_refit_async", "tensor_checksum"]
