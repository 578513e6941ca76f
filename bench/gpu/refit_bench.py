"""Refit speed: an 8B-shaped model (Llama-3-8B widths) from Megatron-Core into a running vLLM engine
on the same GPU(s), next to a plain device-to-device copy of the same bytes.

    # one GPU
    python3 bench/gpu/refit_bench.py --backend te --layers 32 --out /tmp/refit-tp1.json
    # TP2 on two GPUs: trainer TP2, engine TP2 (vLLM's external_launcher: one engine rank per
    # trainer rank, every rank feeds its own engine rank: refit(..., receiver="all"))
    torchrun --nproc_per_node 2 bench/gpu/refit_bench.py --tp 2 --backend te --layers 32 --out /tmp/refit-tp2.json

The engine starts from ``load_format="dummy"`` (only config.json is written); the trainer model
is randomly initialised (speed does not depend on the values). One refit computes the plan and
binds its data path (reported apart), then ``--iters`` refits are timed (median): wall time from
the first gather to the engine's last write, synchronised, and the engine's prefix-cache reset that
``VLLMAdapter`` runs while the GPU finishes the copies (before the worker's end synchronises). The same refits are then timed without that reset
(``transfer_*``: the weights alone), and the reset alone (``llm.reset_prefix_cache()``: vLLM walks
every KV-cache block in Python, so it costs in proportion to the cache's block count). Then ``exact``: every engine parameter
compared bit for bit (``zoo_compare_parameters``) with a reference refit into plain tensors on
another path (at TP2 the gathered export; at TP1 slot-shaped copies instead of raw views).

The same refits are also timed with one ``copy_`` per shard (``per_shard_*``:
``VLLMAdapter(fused_copies=False)``); ``fused_copies`` says whether the timed refits ran the fused
copies (one Triton launch per bucket, :mod:`mcore_zoo.kernels.copy_runs`). ``--trace DIR`` also
profiles one refit each way with ``torch.profiler`` (Chrome traces in DIR, a summary under
``diagnostics``: when the GPU started and finished, its busy time and idle gaps, device time per
kernel) and times the bare loop of the per-shard copies (``copy_floor``).

``refit_source`` says which data path the receiving rank ran (``RefitStats.source``): ``"local"``
at TP1 (each engine shard copied straight from a view of the trainer's parameter), ``"tp-local"``
at TP2 (each rank's engine shards from views of its own TP chunks; ``VLLMAdapter`` reads its engine
rank under ``external_launcher``), ``"stream"`` where neither applies (the export, gathered over
TP). The host time per tensor around the copies is measured on the CPU by ``bench/refit_host.py``.
GB/s counts the bytes written into the engine (all engine ranks). The copy reference moves, per
GPU, the same number of bytes as that GPU's engine rank receives, with one ``Tensor.copy_`` (bytes
counted once, as for the refit).

``engine_start_seconds`` is the ``vllm.LLM`` construction (its warm-up included), and rank 0 prints
a line per stage with the seconds since start: on a fresh four-GPU H100 machine the TP4 engine
took 97 s to start (``init engine ... took 97.46 s`` in vLLM's log, 92 s of it in the warm-up that
JIT-compiles the engine's Triton kernels, most likely compiled for the first time on that machine:
the smaller engines of the ``vllm-exact`` runs started after it took 11-15 s), while all the
refits that reset the prefix cache ran within about 3 s. A time limit has to cover that start; the
number of timed refits barely moves it.

Needs vLLM (bench/gpu/vllm-setup.sh; ``source bench/gpu/vllm-env.sh``) and, for ``te``, Transformer
Engine (../shared/gpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip


def copy_bandwidth(nbytes: int, iters: int = 20) -> float:
    """GB/s of one device-to-device ``copy_`` of ``nbytes`` (median over ``iters``)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def copy_floor(refit_once, iters: int = 5) -> dict:
    """The device floor of the refit's own copies: every ``Tensor.copy_`` one refit makes (engine
    region <- trainer view, as the worker issues them) is recorded, then replayed as a bare loop
    (median of ``iters``): what the copies cost with no bookkeeping around them. Also how many are
    plain memcpys (both sides contiguous) and their bytes."""
    import torch

    pairs, original = [], torch.Tensor.copy_

    def record(dst, src, non_blocking=False):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code.co_name in ("_copy", "write"):  # the worker's copies only
            pairs.append((dst, src))
        return original(dst, src, non_blocking)

    torch.Tensor.copy_ = record
    try:
        refit_once()
    finally:
        torch.Tensor.copy_ = original
    times = []
    with torch.no_grad():  # the trainer's views require grad; the worker writes under no_grad too
        for _ in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    plain = [d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype for d, s in pairs]
    size = [d.numel() * d.element_size() for d, _ in pairs]
    result = {
        "copies": len(pairs), "bytes": sum(size), "loop_seconds_median": statistics.median(times[1:]),
        "plain_memcpy_copies": sum(plain), "plain_memcpy_bytes": sum(n for n, p in zip(size, plain) if p),
        "other": sorted({(tuple(s.shape), s.stride(), tuple(d.shape), d.stride(), str(s.dtype), str(d.dtype))
                         for (d, s), p in zip(pairs, plain) if not p}, key=str)[:12],
        "largest_copies_mb": sorted((n / 1e6 for n in size), reverse=True)[:5],
        "copies_under_1mb": sum(1 for n in size if n < 1e6),
    }  # fmt: skip
    pairs.clear()
    return result


def trace_summary(path: str, label: str = "zoo_refit") -> dict:
    """What one profiled refit did, from its Chrome trace (``torch.profiler``): host span of the
    ``label`` annotation, when the GPU started and finished, its busy time (union of kernels and
    memcpys), idle gaps, device time per op name (memcpy GB/s from the trace's bytes) and the host's
    last launch (host-bound when it lands near the GPU's end)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    marks = [e for e in events if e.get("name") == label and e.get("cat") == "user_annotation"]
    if not marks:
        return {"error": f"no {label!r} annotation in the trace"}
    t0 = marks[0]["ts"]
    t1 = t0 + marks[0]["dur"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= t0),
                    key=lambda e: e["ts"])  # fmt: skip
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1
                and any(k in e["name"] for k in ("Launch", "Memcpy", "Memset"))]  # fmt: skip
    if not device:
        return {"error": "no device events after the annotation"}
    busy, gaps, end = 0.0, [], device[0]["ts"]
    for e in device:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            gaps.append((start - end, e["name"][:60]))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    by_name: dict = {}
    for e in device:
        d = by_name.setdefault(e["name"][:80], {"count": 0, "us": 0.0, "bytes": 0})
        d["count"] += 1
        d["us"] += e["dur"]
        d["bytes"] += int(e.get("args", {}).get("bytes", 0) or 0)
    for d in by_name.values():
        d["gbps"] = d["bytes"] / d["us"] / 1e3 if d["bytes"] and d["us"] else None
    host_ops: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1:
            h = host_ops.setdefault(e["name"], [0, 0.0])
            h[0] += 1
            h[1] += e["dur"]
    return {
        "host_span_ms": (t1 - t0) / 1e3, "device_first_ms": (device[0]["ts"] - t0) / 1e3,
        "device_last_end_ms": (end - t0) / 1e3, "device_busy_ms": busy / 1e3,
        "device_idle_ms": (end - device[0]["ts"] - busy) / 1e3, "device_ops": len(device),
        "gaps_over_20us": sum(1 for g, _ in gaps if g > 20), "largest_gaps_us": sorted(gaps, reverse=True)[:10],
        "last_launch_ms": (max(e["ts"] + e["dur"] for e in launches) - t0) / 1e3 if launches else None,
        "launches": len(launches),
        "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:12]),
        "host_ops_top": dict(sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:15]),
    }  # fmt: skip


def profile_refit(refit_once, path: str, label: str = "zoo_refit") -> dict:
    """One refit under ``torch.profiler`` (CPU and CUDA), its trace written to ``path`` and
    summarised (:func:`trace_summary`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(label):
            refit_once()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return trace_summary(path, label)


def _kv_blocks(llm) -> int:
    """The engine's number of KV-cache blocks (what its prefix-cache reset walks), or -1."""
    try:
        return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    except Exception:
        return -1


_START = time.perf_counter()


def _stage(rank: int, what: str) -> None:
    """One line on rank 0 with the seconds since the script started: where a run's time limit goes
    (vLLM's engine start, with its kernel warm-up, can outweigh every timed refit)."""
    if rank == 0:
        print(f"refit_bench: {time.perf_counter() - _START:.1f} s: {what}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--backend", default="te", choices=["te", "local"])
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--out")
    ap.add_argument("--trace", help="folder: profile one refit with and one without the prefix-cache reset"
                    " (Chrome traces, a summary in the JSON) and time the refit's bare copy loop")
    args = ap.parse_args()

    import torch

    if args.backend == "te":
        import transformer_engine.pytorch  # noqa: F401  (before any other CUDA library: ../shared/gpu/README.md)
    import torch.distributed as dist
    import vllm

    import mcore_zoo
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.rollout import VLLM_WORKER_EXTENSION, DictAdapter, VLLMAdapter, get_plan

    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    config = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    tmp = tempfile.mkdtemp(prefix="refit-bench-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)

    t0 = time.perf_counter()
    model = mcore_zoo.build_model(config, backend=args.backend, params_dtype=torch.bfloat16,
                                  parallel=Parallelism(tp=args.tp))  # fmt: skip
    t_build = time.perf_counter() - t0
    kwargs = dict(model=tmp, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=1024, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
                  tensor_parallel_size=args.tp, worker_extension_cls=VLLM_WORKER_EXTENSION)  # fmt: skip
    if args.tp > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    t_engine = time.perf_counter() - t0
    _stage(rank, f"engine started in {t_engine:.1f} s")
    adapter = VLLMAdapter(llm)
    receiver = "all" if args.tp > 1 else 0

    t0 = time.perf_counter()
    first = mcore_zoo.refit(model, adapter, bucket_size=args.bucket_size, receiver=receiver)
    t_first = time.perf_counter() - t0
    plan = get_plan(model, target_tp=args.tp, bucket_size=args.bucket_size)
    runs = []
    for _ in range(args.iters):
        if dist.is_initialized():
            dist.barrier()
        runs.append(mcore_zoo.refit(model, adapter, bucket_size=args.bucket_size, receiver=receiver).seconds)
    seconds = statistics.median(runs)
    _stage(rank, f"{args.iters} timed refits, median {seconds * 1e3:.1f} ms")
    fused = bool(llm.collective_rpc("zoo_refit_fused")[0])  # whether those refits ran the fused copies
    # the same refits without the engine's prefix-cache reset (VLLMAdapter.end calls
    # llm.reset_prefix_cache(): vLLM walks every KV-cache block in Python, so its cost follows the
    # cache's block count, not the weights), and that reset alone
    bare = VLLMAdapter(llm, reset_prefix_cache=False)
    mcore_zoo.refit(model, bare, bucket_size=args.bucket_size, receiver=receiver)
    transfer, resets = [], []
    for _ in range(args.iters):
        if dist.is_initialized():
            dist.barrier()
        transfer.append(mcore_zoo.refit(model, bare, bucket_size=args.bucket_size, receiver=receiver).seconds)
        t0 = time.perf_counter()
        llm.reset_prefix_cache()
        resets.append(time.perf_counter() - t0)
    # the same refits with one copy_ per shard (fused_copies=False): what the fused copies replace
    per_shard = VLLMAdapter(llm, fused_copies=False)
    mcore_zoo.refit(model, per_shard, bucket_size=args.bucket_size, receiver=receiver)
    shard_runs = []
    for _ in range(args.iters):
        if dist.is_initialized():
            dist.barrier()
        shard_runs.append(mcore_zoo.refit(model, per_shard, bucket_size=args.bucket_size, receiver=receiver).seconds)
    _stage(rank, "refits without the reset and per shard timed")
    # exactness: the engine's parameters against a reference refit into plain tensors on another
    # path (at TP2 the gathered export - the reference adapter names no engine rank; at TP1 the
    # slot-shaped copies instead of raw views)
    reference = DictAdapter(tp_size=args.tp, device="cuda")
    mcore_zoo.refit(model, reference, bucket_size=args.bucket_size, receiver=receiver)
    mismatch = llm.collective_rpc("zoo_compare_parameters", args=(reference.tensors[rank if args.tp > 1 else 0],))
    del reference
    _stage(rank, "exactness compared")
    diagnostics = {}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for name, ad in (("with_reset", adapter), ("weights_only", bare)):
            if dist.is_initialized():
                dist.barrier()
            diagnostics[name] = profile_refit(
                lambda ad=ad: mcore_zoo.refit(model, ad, bucket_size=args.bucket_size, receiver=receiver),
                os.path.join(args.trace, f"refit-tp{args.tp}-{name}-rank{rank}.json"))  # fmt: skip
        if dist.is_initialized():
            dist.barrier()
        diagnostics["per_shard"] = profile_refit(
            lambda: mcore_zoo.refit(model, per_shard, bucket_size=args.bucket_size, receiver=receiver),
            os.path.join(args.trace, f"refit-tp{args.tp}-per-shard-rank{rank}.json"))  # fmt: skip
        if dist.is_initialized():
            dist.barrier()
        diagnostics["copy_floor"] = copy_floor(
            lambda: mcore_zoo.refit(model, per_shard, bucket_size=args.bucket_size, receiver=receiver))
    per_rank = sum(s.nbytes for slots in plan.slots.values() for s in slots[rank if args.tp > 1 else 0])
    copy = copy_bandwidth(per_rank)
    result = {
        "gpu": torch.cuda.get_device_name(), "tp": args.tp, "layers": args.layers, "backend": args.backend,
        "bucket_size": args.bucket_size, "buckets": len(plan.buckets), "engine_bytes": plan.nbytes,
        "engine_bytes_per_rank": per_rank, "refit_seconds_median": seconds, "refit_seconds_all": runs,
        "refit_gbps": plan.nbytes / seconds / 1e9, "refit_gbps_per_gpu": per_rank / seconds / 1e9,
        "copy_gbps_per_gpu": copy, "fraction_of_copy": per_rank / seconds / 1e9 / copy,
        "transfer_seconds_median": statistics.median(transfer), "transfer_seconds_all": transfer,
        "transfer_gbps_per_gpu": per_rank / statistics.median(transfer) / 1e9,
        "transfer_fraction_of_copy": per_rank / statistics.median(transfer) / 1e9 / copy,
        "prefix_cache_reset_seconds_median": statistics.median(resets),
        "fused_copies": fused, "per_shard_seconds_median": statistics.median(shard_runs),
        "per_shard_seconds_all": shard_runs,
        "per_shard_fraction_of_copy": per_rank / statistics.median(shard_runs) / 1e9 / copy,
        "kv_cache_blocks": _kv_blocks(llm),
        "first_refit_seconds_with_plan": t_first, "build_seconds": t_build, "engine_start_seconds": t_engine,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "first_refit_planned": first.planned, "refit_source": getattr(first, "source", ""),
        "exact": not any(mismatch), "mismatch": [m for m in mismatch if m],
    }  # fmt: skip
    if diagnostics:
        result["diagnostics"] = diagnostics
    if rank == 0:
        print(json.dumps(result, indent=2))
        print(f"| {result['gpu']} | TP{args.tp} | {args.layers} layers {args.backend} | {plan.nbytes / 1e9:.2f} GB |"
              f" {seconds * 1e3:.0f} ms | {result['refit_gbps']:.0f} GB/s ({result['refit_gbps_per_gpu']:.0f} per GPU) |"
              f" {copy:.0f} GB/s | {result['fraction_of_copy']:.0%} | {result['refit_source']} |")  # fmt: skip
        print(f"without the prefix-cache reset: {result['transfer_seconds_median'] * 1e3:.1f} ms,"
              f" {result['transfer_fraction_of_copy']:.0%} of the copy; the reset alone"
              f" {result['prefix_cache_reset_seconds_median'] * 1e3:.1f} ms ({result['kv_cache_blocks']} KV blocks)")  # fmt: skip
        print(f"fused copies {result['fused_copies']}; one copy_ per shard instead: {result['per_shard_seconds_median'] * 1e3:.1f} ms,"
              f" {result['per_shard_fraction_of_copy']:.0%} of the copy")  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


if __name__ == "__main__":
    main()
