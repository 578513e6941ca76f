"""Disaggregated refit speed: trainer and vLLM engine in separate processes on separate GPUs.

    # 2 GPUs: trainer on GPU 0, vLLM engine (TP1) on GPU 1; 8B-shaped dense, then Qwen3-30B-A3B-shaped MoE
    python3 bench/gpu/disagg_refit_bench.py --out /tmp/disagg
    # 4 GPUs: also trainer TP2 (GPUs 0, 1) -> engine TP2 (GPUs 2, 3)
    python3 bench/gpu/disagg_refit_bench.py --out /tmp/disagg --tp 1 --tp 2
    # the shared-buffer transport (the engine reads the trainer's ring over CUDA IPC): on another GPU, on the same one
    python3 bench/gpu/disagg_refit_bench.py --out /tmp/disagg-shared --transport shared
    python3 bench/gpu/disagg_refit_bench.py --out /tmp/disagg-same --transport shared --same-gpus
    # CPU, tiny shapes, a CPU stand-in engine (DictAdapter) instead of vLLM: the flow and the result files
    python3 bench/gpu/disagg_refit_bench.py --out /tmp/disagg-dry --dry-run

Per case (shape, trainer TP = engine TP) the main process starts the engine process (vLLM with
:data:`mcore_zoo.rollout.vllm_disagg.DISAGG_EXTENSION`, ``load_format="dummy"``, GPUs after the
trainer's) and the trainer processes (``mcore_zoo.distributed.launch``, randomly initialised bf16
model; speed does not depend on the values). Both join one refit group (TCP store on the
trainer's rank 0). Then, on the same links:

* ``link``: NCCL's own broadcast from trainer rank 0 to engine rank 0 (one 1 GiB buffer on the
  refit channel, median of 10): the per-link bandwidth the refit is held against; with
  ``--transport shared``, engine rank 0's copy of trainer rank 0's first ring buffer (what that
  transport moves: over NVLink from another GPU, within the GPU with ``--same-gpus``, where the
  trainer builds its model only once the engine has started and vLLM takes 0.3 of the memory);
* ``links_together`` (trainer TP > 1, broadcast): the same broadcast on every pair's channel at once
  (trainer rank ``r`` to engine rank ``r``), as a refit keeps them all busy: the slowest pair's
  GB/s, and the refit's per-link GB/s against it (``of_links_together``), beside ``of_link``;
* ``refit``: ``--iters`` refits (``DisaggSender.send`` on every trainer rank, ``receive_refit`` in
  the engine), the first one apart (it binds the engine side); time = the trainer's send (first
  pack to the last broadcast done, synchronised) and the engine workers' receive, both reported;
  GB/s = bytes sent / time, per link = the busiest link's bytes / time; the engine writes each
  bucket with one launch (``--unfused``: shard by shard);
* ``exact``: every engine parameter's checksum (:func:`~mcore_zoo.rollout.vllm_disagg.tensor_checksum`,
  computed in the engine) equal to that of the same tensor from the zoo's export on the trainer
  (the colocated refit into plain tensors: the export stream cut for the engine).

``--trace``: one more refit after the timed ones, under torch's profiler on both sides (every
trainer rank, every engine worker; CUDA activity on GPUs): ``OUT/trace-<shape>-tp<N>-<side><rank>.txt``
(the ops by self device time, or CPU time on the CPU) and ``.json`` (a Chrome trace) - where a
bucket's time goes (packing, checksums, the broadcasts, the engine's writes) and what overlaps.

Results: ``OUT/disagg.json`` and ``OUT/disagg.md``, rewritten after every case (a case that hangs
leaves the ones before it); the run fails (exit 1) when a case is not exact. Needs vLLM (bench/gpu/vllm-setup.sh; ``source bench/gpu/vllm-env.sh``) except with
``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "num_hidden_layers": 32,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "torch_dtype": "bfloat16",
    "num_hidden_layers": 48,
}  # fmt: skip
#: name -> (config, layers kept on an 80 GB trainer GPU: the model and its reference export fit)
SHAPES = {"dense-8b": (LLAMA3_8B, 32), "moe-30b-a3b": (QWEN3_30B_A3B, 12)}
#: bytes per broadcast of the link measurement (GPU, dry run)
_LINK_BYTES = {False: 2**30, True: 2**20}
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traced(fn, stem: str, cuda: bool):
    """``fn()`` under torch's profiler, its table and trace written to ``stem`` + ``.txt`` / ``.json``
    (:func:`mcore_zoo.rollout.vllm_disagg.write_profile`); returns what ``fn`` returns."""
    from mcore_zoo.rollout.vllm_disagg import profiled, write_profile

    result, prof = profiled(fn, cuda)
    write_profile(prof, stem)
    return result


def shape_config(name: str, layers: int, dry_run: bool) -> dict:
    config, default_layers = SHAPES[name]
    config = dict(config, num_hidden_layers=layers or default_layers)
    if dry_run:
        config.update({k: v for k, v in TINY.items() if k in config}, num_hidden_layers=2)
    return config


# ---------------------------------------------------------------------------- trainer side
def trainer(config: dict, tp: int, port: int, iters: int, bucket: str, dry_run: bool, transport: str = "broadcast",
            wait_for: str = "", trace: str = "") -> dict:
    """One trainer rank (launched): build, join, measure the link (broadcast transport: the engine
    measures its read of the ring with the shared one), refit, compute reference checksums.
    ``wait_for``: a file the engine writes once it has started (on shared GPUs the trainer
    allocates only after the engine's memory profiling)."""
    import torch
    import torch.distributed as dist

    import mcore_zoo
    from mcore_zoo.distributed.refit_group import RefitGroup
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.rollout import DictAdapter, DisaggSender
    from mcore_zoo.rollout.disagg import measure_link
    from mcore_zoo.rollout.vllm_disagg import tensor_checksum

    rank = dist.get_rank()
    while wait_for and not os.path.exists(wait_for):
        time.sleep(1)
    parallel = Parallelism(tp=tp)
    ensure_model_parallel(parallel)
    device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    model = mcore_zoo.build_model(config, backend="portable" if dry_run else "local", params_dtype=torch.bfloat16,
                                  parallel=parallel, device=device)  # fmt: skip
    group = RefitGroup.join("127.0.0.1", port, rank=rank, trainers=tp, engines=tp, device=device)
    sender = DisaggSender(model, group, engine_tp=tp, bucket_size=bucket, transport=transport)
    link = measure_link(group, (0, 0), _LINK_BYTES[dry_run]) if rank == 0 and transport == "broadcast" else None
    # then every pair's link at once (each trainer rank to the engine rank of its index), as the refit runs them
    paired = (rank, rank) in group.channels and transport == "broadcast" and tp > 1
    together = measure_link(group, (rank, rank), _LINK_BYTES[dry_run]) if paired else None
    first = sender.send()
    timed = [sender.send() for _ in range(iters)]
    if trace:  # one more refit, profiled (the engine receives it profiled too)
        traced(sender.send, f"{trace}-trainer{rank}", not dry_run)
    reference = DictAdapter(tp_size=tp, device=str(device)) if rank == 0 else None
    mcore_zoo.refit(model, reference, target_tp=tp, bucket_size=bucket)
    checksums = ({f"{r}/{name}": tensor_checksum(t) for r, per in enumerate(reference.tensors) for name, t in per.items()}
                 if reference else {})  # fmt: skip
    per_link = sender.transfer.bytes_per_link()
    return {"rank": rank, "link": link, "link_together": together, "first_seconds": first.seconds, "seconds": [s.seconds for s in timed],
            "bytes": timed[0].nbytes, "plan_bytes": sender.plan.nbytes, "busiest_link_bytes": max(per_link.values()),
            "links": len(per_link), "buckets": len(sender.plan.buckets), "checksums": checksums,
            "transfer": sender.transfer.describe()}  # fmt: skip


# ---------------------------------------------------------------------------- engine side
def engine(config: dict, tp: int, port: int, iters: int, out: str, dry_run: bool, fused: bool = True,
           memory: float = 0.6, trace: str = "") -> None:
    """The engine process: vLLM (or, dry run, one CPU stand-in per engine rank in threads)."""
    tmp = tempfile.mkdtemp(prefix="disagg-engine-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)
    if dry_run:
        result = _stand_in_engine(tp, port, iters, out, trace)
    else:
        result = _vllm_engine(tmp, tp, port, iters, fused, out, memory, trace)
    with open(out, "w") as f:
        json.dump(result, f)


def _vllm_engine(model_dir: str, tp: int, port: int, iters: int, fused: bool, out: str, memory: float,
                 trace: str = "") -> dict:  # fmt: skip
    import vllm

    from mcore_zoo.rollout.vllm_disagg import DISAGG_EXTENSION, receive_refit

    t0 = time.perf_counter()
    llm = vllm.LLM(model=model_dir, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                   max_model_len=1024, gpu_memory_utilization=memory, seed=0, tensor_parallel_size=tp,
                   worker_extension_cls=DISAGG_EXTENSION)  # fmt: skip
    started = time.perf_counter() - t0
    open(out + ".started", "w").close()  # the trainer may allocate now
    _check(llm.collective_rpc("zoo_join_refit", args=("127.0.0.1", port, tp, tp, tp, 0)))
    links = [r for r in llm.collective_rpc("zoo_measure_link", args=(0, _LINK_BYTES[False], 10, 0)) if r]
    if tp > 1:  # every pair's link at once, with the trainer ranks (trainer())
        llm.collective_rpc("zoo_measure_paired_link", args=(_LINK_BYTES[False], 10))
    receive_refit(llm, fused_copies=fused)
    seconds = []
    for _ in range(iters):
        receive_refit(llm, reset_prefix_cache=False, fused_copies=fused)
        seconds.append(max(llm.collective_rpc("zoo_refit_seconds")))
    if trace:
        _check(llm.collective_rpc("zoo_receive_refit_profiled", args=(trace, fused)))
    checksums = {}
    for rank, per in enumerate(llm.collective_rpc("zoo_parameter_checksums")):
        checksums.update({f"{rank}/{name}": value for name, value in per.items()})
    return {"engine_start_seconds": started, "seconds": seconds, "checksums": checksums, "link": links[0] if links else None,
            "fused_copies": all(llm.collective_rpc("zoo_refit_fused"))}


def _check(results) -> None:
    errors = [r for r in results if r]
    if errors:
        raise SystemExit(f"engine: {errors}")


def _stand_in_engine(tp: int, port: int, iters: int, out: str, trace: str = "") -> dict:
    """Dry run: each engine rank a thread with an EngineReceiver and a DictAdapter (CPU, gloo)."""
    import threading

    import torch

    from mcore_zoo.distributed.refit_group import RefitGroup
    from mcore_zoo.rollout import DictAdapter, EngineReceiver
    from mcore_zoo.rollout.disagg import measure_link
    from mcore_zoo.rollout.vllm_disagg import tensor_checksum

    results: dict = {}
    links: dict = {}
    open(out + ".started", "w").close()

    def run(index: int) -> None:
        group = RefitGroup.join("127.0.0.1", port, rank=tp + index, trainers=tp, engines=tp, device=torch.device("cpu"))
        receiver = EngineReceiver(group, index, engine_tp=tp)
        shared = receiver.transport == "shared"
        if index == 0:
            links[index] = receiver.measure_shared_read(0) if shared else measure_link(group, (0, 0), _LINK_BYTES[True])
        if tp > 1 and not shared and (index, index) in group.channels:  # every pair at once, with the trainer ranks
            measure_link(group, (index, index), _LINK_BYTES[True])
        sink = DictAdapter(tp_size=tp, engine_rank=receiver.rank)
        receiver.receive(sink)
        seconds = [receiver.receive(sink).seconds for _ in range(iters)]
        if trace and index == 0:  # the profiler traces one thread at a time: engine rank 0's receive
            traced(lambda: receiver.receive(sink), f"{trace}-engine0", False)
        elif trace:
            receiver.receive(sink)
        results[index] = (seconds, {f"{receiver.rank}/{n}": tensor_checksum(t) for n, t in sink.tensors[receiver.rank].items()})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = [max(results[i][0][k] for i in results) for k in range(iters)]
    checksums = {k: v for i in results for k, v in results[i][1].items()}
    return {"engine_start_seconds": 0.0, "seconds": seconds, "checksums": checksums, "link": links.get(0)}


# ---------------------------------------------------------------------------- one case, all cases
def run_case(name: str, tp: int, args) -> dict:
    from mcore_zoo.distributed import launch

    config = shape_config(name, args.layers, args.dry_run)
    port = _free_port()
    engine_out = os.path.join(args.out, f"engine-{name}-tp{tp}.json")
    for stale in (engine_out, engine_out + ".started"):
        if os.path.exists(stale):
            os.remove(stale)
    env = dict(os.environ)
    if not args.dry_run:  # the trainer on the first tp GPUs, the engine on the next tp
        visible = args.gpus or [str(i) for i in range(2 * tp)]
        if len(visible) < (tp if args.same_gpus else 2 * tp):
            raise SystemExit(f"TP{tp} -> TP{tp} needs {2 * tp} GPUs, {len(visible)} visible")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:tp] if args.same_gpus else visible[tp : 2 * tp])
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:tp])
    cmd = [sys.executable, __file__, "--engine-role", json.dumps(config), "--tp", str(tp), "--port", str(port),
           "--iters", str(args.iters), "--engine-out", engine_out] + (["--dry-run"] if args.dry_run else [])
    cmd += ["--unfused"] if args.unfused else []
    trace = os.path.join(os.path.abspath(args.out), f"trace-{name}-tp{tp}") if args.trace else ""
    cmd += ["--trace-prefix", trace] if trace else []
    cmd += ["--engine-memory", str(args.engine_memory or (0.3 if args.same_gpus else 0.6))]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    try:
        wait_for = engine_out + ".started" if args.same_gpus else ""
        ranks = launch(trainer, tp, config, tp, port, args.iters, args.bucket_size, args.dry_run, args.transport, wait_for,
                       trace, backend="gloo" if args.dry_run else "nccl", timeout=args.timeout)  # fmt: skip
        if proc.wait(timeout=args.timeout) != 0:
            raise SystemExit(f"engine process exited {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(engine_out) as f:
        eng = json.load(f)
    head = ranks[0]
    link = head["link"] or eng["link"]  # broadcast: NCCL's, measured by both; shared: the engine's read of the ring
    want = {k: v for r in ranks for k, v in r["checksums"].items()}
    differ = sorted(k for k in want if eng["checksums"].get(k) != want[k])
    missing = sorted(set(want) - set(eng["checksums"]))
    trainer_s = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.iters))
    engine_s = statistics.median(eng["seconds"]) if eng["seconds"] else 0.0
    seconds = max(trainer_s, engine_s)
    sent = sum(r["bytes"] for r in ranks)
    busiest = max(r["busiest_link_bytes"] for r in ranks)
    paired = [r["link_together"] for r in ranks if r.get("link_together")]
    together = min(paired, key=lambda x: x["gbps"]) if paired else None  # the slowest pair, all pairs busy
    return {
        "shape": name, "layers": config["num_hidden_layers"], "trainer_tp": tp, "engine_tp": tp,
        "bytes": sent, "plan_bytes": head["plan_bytes"], "buckets": head["buckets"], "links": sum(r["links"] for r in ranks),
        "first_refit_seconds": max(r["first_seconds"] for r in ranks), "trainer_seconds": trainer_s,
        "engine_seconds": engine_s, "seconds": seconds, "gbps": sent / seconds / 1e9,
        "gbps_per_link": busiest / seconds / 1e9, "link": link, "transport": args.transport, "same_gpus": args.same_gpus,
        "of_link": (busiest / seconds / 1e9) / link["gbps"], "links_together": together, "links_together_pairs": len(paired),
        "of_links_together": (busiest / seconds / 1e9) / together["gbps"] if together else None,
        "engine_start_seconds": eng["engine_start_seconds"],
        "exact": not differ and not missing and bool(want), "tensors": len(want), "differ": differ[:8], "missing": missing[:8],
        "transfer": head["transfer"], "fused_copies": eng.get("fused_copies", False),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    ap.add_argument("--tp", type=int, action="append", help="trainer TP = engine TP (default 1; 2 needs 4 GPUs)")
    ap.add_argument("--layers", type=int, default=0, help="default: per shape (all 32 of the 8B, 12 of the MoE)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, gloo, a stand-in engine")
    ap.add_argument("--transport", choices=("broadcast", "shared"), default="broadcast",
                    help="shared: the engine reads the trainer's ring (CUDA IPC; one host)")
    ap.add_argument("--same-gpus", action="store_true", help="the engine on the trainer's GPUs (shared transport)")
    ap.add_argument("--engine-memory", type=float, default=0.0,
                    help="vLLM's gpu_memory_utilization (default 0.6; 0.3 with --same-gpus: the trainer's model and reference export share the GPU)")
    ap.add_argument("--unfused", action="store_true", help="engine writes shard by shard (default: one launch per bucket)")
    ap.add_argument("--trace", action="store_true", help="one more refit under torch's profiler on both sides (module docstring)")
    ap.add_argument("--trace-prefix", default="", help=argparse.SUPPRESS)
    ap.add_argument("--engine-role", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--engine-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_role:
        engine(json.loads(args.engine_role), args.tp[0], args.port, args.iters, args.engine_out, args.dry_run, not args.unfused,
               args.engine_memory or 0.6, args.trace_prefix)
        return
    if not args.out:
        ap.error("--out is required")
    if args.same_gpus and args.transport != "shared":
        ap.error("--same-gpus needs --transport shared (NCCL takes one rank per GPU)")
    os.makedirs(args.out, exist_ok=True)
    args.gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]  # every case picks from these
    results = []
    for tp in args.tp or [1]:
        for shape in args.shape or sorted(SHAPES):
            results.append(run_case(shape, tp, args))
            write_results(args.out, args.dry_run, results)  # after every case: a later case that hangs keeps these
    if not all(r["exact"] for r in results):
        raise SystemExit("not exact: " + "; ".join(f"{r['shape']} TP{r['trainer_tp']}: {r['differ'] or r['missing']}"
                                                   for r in results if not r["exact"]))  # fmt: skip


def write_results(out: str, dry_run: bool, results: list[dict]) -> None:
    """``OUT/disagg.json`` and ``OUT/disagg.md`` of the cases run so far (the table printed too)."""
    with open(os.path.join(out, "disagg.json"), "w") as f:
        json.dump({"dry_run": dry_run, "cases": results}, f, indent=1)
    lines = ["| shape | layers | trainer -> engine | transport | GB | refit s (trainer / engine) | GB/s | GB/s per link | link GB/s"
             " (NCCL broadcast / ring read) | of link | every pair at once: slowest link GB/s | of it | exact | engine copies |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        where = "shared, same GPUs" if r["same_gpus"] else r["transport"]
        together = r.get("links_together")
        paired = (f" {together['gbps']:.1f} ({r['links_together_pairs']} pairs) | {100 * r['of_links_together']:.0f}% |"
                  if together else " - | - |")  # fmt: skip
        lines.append(f"| {r['shape']} | {r['layers']} | TP{r['trainer_tp']} -> TP{r['engine_tp']} | {where} | {r['bytes'] / 1e9:.2f} |"
                     f" {r['trainer_seconds']:.3f} / {r['engine_seconds']:.3f} | {r['gbps']:.1f} | {r['gbps_per_link']:.1f} |"
                     f" {r['link']['gbps']:.1f} | {100 * r['of_link']:.0f}% |{paired} {'yes' if r['exact'] else 'NO'} |"
                     f" {'fused' if r['fused_copies'] else 'each'} |")  # fmt: skip
    with open(os.path.join(out, "disagg.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
