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

``refit_source`` says which data path the receiving rank ran (``RefitStats.source``): ``"local"``
at TP1 (each engine shard copied straight from a view of the trainer's parameter), ``"tp-local"``
at TP2 (each rank's engine shards from views of its own TP chunks; ``VLLMAdapter`` reads its engine
rank under ``external_launcher``), ``"stream"`` where neither applies (the export, gathered over
TP). The host time per tensor around the copies is measured on the CPU by ``bench/refit_host.py``.
GB/s counts the bytes written into the engine (all engine ranks). The copy reference moves, per
GPU, the same number of bytes as that GPU's engine rank receives, with one ``Tensor.copy_`` (bytes
counted once, as for the refit).

Needs vLLM (bench/gpu/vllm-setup.sh; ``source bench/gpu/vllm-env.sh``) and, for ``te``, Transformer
Engine (../shared/gpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _kv_blocks(llm) -> int:
    """The engine's number of KV-cache blocks (what its prefix-cache reset walks), or -1."""
    try:
        return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    except Exception:
        return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--backend", default="te", choices=["te", "local"])
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--out")
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
    llm = vllm.LLM(**kwargs)
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
    # exactness: the engine's parameters against a reference refit into plain tensors on another
    # path (at TP2 the gathered export - the reference adapter names no engine rank; at TP1 the
    # slot-shaped copies instead of raw views)
    reference = DictAdapter(tp_size=args.tp, device="cuda")
    mcore_zoo.refit(model, reference, bucket_size=args.bucket_size, receiver=receiver)
    mismatch = llm.collective_rpc("zoo_compare_parameters", args=(reference.tensors[rank if args.tp > 1 else 0],))
    del reference
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
        "kv_cache_blocks": _kv_blocks(llm),
        "first_refit_seconds_with_plan": t_first, "build_seconds": t_build,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "first_refit_planned": first.planned, "refit_source": getattr(first, "source", ""),
        "exact": not any(mismatch), "mismatch": [m for m in mismatch if m],
    }  # fmt: skip
    if rank == 0:
        print(json.dumps(result, indent=2))
        print(f"| {result['gpu']} | TP{args.tp} | {args.layers} layers {args.backend} | {plan.nbytes / 1e9:.2f} GB |"
              f" {seconds * 1e3:.0f} ms | {result['refit_gbps']:.0f} GB/s ({result['refit_gbps_per_gpu']:.0f} per GPU) |"
              f" {copy:.0f} GB/s | {result['fraction_of_copy']:.0%} | {result['refit_source']} |")  # fmt: skip
        print(f"without the prefix-cache reset: {result['transfer_seconds_median'] * 1e3:.1f} ms,"
              f" {result['transfer_fraction_of_copy']:.0%} of the copy; the reset alone"
              f" {result['prefix_cache_reset_seconds_median'] * 1e3:.1f} ms ({result['kv_cache_blocks']} KV blocks)")  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


if __name__ == "__main__":
    main()
