"""Refit host overhead per tensor (CPU): the Python work ``mcore_zoo.refit`` does around the copies.

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/refit_host.py [--layers 32] [--engine-tp 1] [--iters 40] [--rounds 3] [--profile 25] [--json out.json]
    python bench/refit_host.py --device cuda   # the same on a GPU: CUDA tensors, each refit synchronised

The model is Llama-3-8B-shaped in everything but its widths: 32 layers, untied, so the same 291 HF
tensors as the 8B model (``bench/gpu/refit_bench.py``), at hidden 64 / FFN 128 / 4 heads / 2 KV
heads / vocabulary 1000, so that the copies themselves cost next to nothing and what is timed is
host time. Built with the ``local`` backend on the CPU, fp32.

The engine is a stand-in for an in-process ``vllm.LLM``: a module whose parameters carry vLLM's
names and shapes (``qkv_proj``, ``gate_up_proj``, the vocabulary padded to 64 rows - taken from
the refit plan's ``engine_tensors``), with the zoo's worker extension mixed in and a
``collective_rpc`` that calls it in process - what ``VLLMAdapter`` talks to with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. Timed, per configuration, ``--iters`` steady-state refits
(after one that computes the plan and binds it) in each of ``--rounds`` rounds, configurations in
alternating order:

* ``vllm``: ``VLLMAdapter(llm)`` in direct mode, in-process transport (the path of the GPU bench);
* ``vllm-stream``: the same with the export stream forced (what a TP / PP / EP > 1 trainer runs,
  less its collectives); only where the installed mcore_zoo has the local source to switch off;
* ``vllm-fused``: the same with the worker's fused copies (one run table per bucket,
  :mod:`mcore_zoo.kernels.copy_runs`): on CUDA the Triton kernel, on the CPU its runs replayed
  with ``memmove`` (``copy_runs.supported`` forced) - there a stand-in for the launch's host cost,
  so at engine TP 1 only;
* ``dict``: ``DictAdapter`` (an adapter that takes buckets of slot-shaped shards);
* ``copies``: the floor - one ``copy_`` per HF tensor between preallocated contiguous tensors of
  the same shapes, in a bare loop (what any refit must at least do on this CPU).

With ``--device cuda`` every tensor lives on the GPU and each timed call ends with
``torch.cuda.synchronize()``; the copies are tiny, so what is timed is the host time of launching
them - whether a refit of this many tensors is bound by its host work on that machine.

Reported: median milliseconds per refit and microseconds per HF tensor, and the overhead per tensor
above the ``copies`` floor. These are CPU host-time numbers: on a GPU the copies are asynchronous
launches, so a refit is host-bound when its host time exceeds the copies' device time (about 7.5 ms
for the 8B model on an H200); its GB/s is measured by ``bench/gpu/refit_bench.py``.

``torch.set_num_threads(--threads)`` (default 1): with intra-op threads, single small copies on a
busy machine occasionally wait milliseconds for a worker thread, which is noise here.
The script runs against whichever mcore_zoo is importable (``PYTHONPATH=/other/checkout/src`` to
compare with another checkout).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import platform
import pstats
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip


class StandInLLM:
    """``collective_rpc`` over in-process workers (``VLLMAdapter``'s in-process transport)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]


def stand_in_workers(plan: Any) -> list[Any]:
    """One worker per engine rank whose model has the plan's engine tensors as parameters."""
    from mcore_zoo.rollout import ZooWorkerExtension

    class Worker(ZooWorkerExtension):
        def __init__(self, tensors: list[Any], rank: int) -> None:
            model = torch.nn.Module()
            for t in tensors:
                holder = model
                *path, leaf = t.name.split(".")
                for part in path:
                    if not hasattr(holder, part):
                        holder.add_module(part, torch.nn.Module())
                    holder = getattr(holder, part)
                holder.register_parameter(leaf, torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype, device=DEVICE),
                                                                   requires_grad=False))  # fmt: skip
            self.model_runner = type("Runner", (), {"model": model})()
            self.rank = rank

        def _zoo_tp_rank(self) -> int:
            return self.rank

    return [Worker(tensors, rank) for rank, tensors in enumerate(plan.engine_tensors)]


DEVICE = "cpu"


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block (a switch of the package's, flipped for one run)."""
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


def timed(fn: Callable[[], Any], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def profile(run: Callable[[], Any], top: int) -> list[dict[str, Any]]:
    """cProfile of one call of ``run``: the ``top`` functions by own time, printed in microseconds
    (the profiler's own overhead inflates every entry; the shares are what to read)."""
    gc.collect()  # a collection inside the one profiled call would be charged to whatever runs
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in stats.values())
    rows = sorted(((tt, ct, nc, f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({func})")
                   for (file, line, func), (_, nc, tt, ct, _) in stats.items()), reverse=True)[:top]  # fmt: skip
    print(f"one vllm refit under cProfile: {total * 1e3:.2f} ms of own time in all functions")
    print(f"{'own us':>9} {'with callees us':>16} {'calls':>6}  function")
    for tt, ct, nc, where in rows:
        print(f"{tt * 1e6:9.0f} {ct * 1e6:16.0f} {nc:6d}  {where}")
    return [{"own_us": tt * 1e6, "cumulative_us": ct * 1e6, "calls": nc, "function": where} for tt, ct, nc, where in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions (tottime) of one vllm refit")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--full-width", action="store_true", help="Llama-3-8B widths in bf16 (a GPU run: device time too)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = args.device

    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import DictAdapter, VLLMAdapter, get_plan

    try:  # the worker's fused copies (absent before they existed)
        from mcore_zoo.kernels import copy_runs
    except ImportError:
        copy_runs = None
    try:  # the switch between the local source and the export stream (absent before it existed)
        from mcore_zoo.rollout import program as programs
    except ImportError:
        programs = None

    ensure_model_parallel()
    shape = dict(SHAPE, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256) if args.full_width else SHAPE  # fmt: skip
    config = dict(LLAMA3_8B, **shape, num_hidden_layers=args.layers)
    model = mcore_zoo.build_model(config, backend="local", device=args.device,
                                  params_dtype=torch.bfloat16 if args.full_width else torch.float32)  # fmt: skip
    tp, size = args.engine_tp, args.bucket_size
    plan = get_plan(model, target_tp=tp, bucket_size=size)
    tensors = len(plan.hf)

    def vllm_refit() -> Callable[[], Any]:
        adapter = VLLMAdapter(StandInLLM(stand_in_workers(plan)), tp_size=tp, transport="inproc")
        return lambda: mcore_zoo.refit(model, adapter, bucket_size=size)

    def forced_stream(make: Callable[[], Callable[[], Any]]) -> Callable[[], Callable[[], Any]]:
        def run_with_stream() -> Callable[[], Any]:
            inner = make()

            def refit() -> Any:
                with patched(programs, "local_source", lambda handle: False):
                    return inner()

            return refit

        return run_with_stream

    def fused_refit() -> Callable[[], Any]:
        """``VLLMAdapter`` with the worker's fused copies (one run table per bucket); on the CPU its
        runs execute with ``memmove`` (``copy_runs.supported`` forced), on CUDA with the kernel."""
        adapter = VLLMAdapter(StandInLLM(stand_in_workers(plan)), tp_size=tp, transport="inproc")

        def refit() -> Any:
            with patched(copy_runs, "supported", lambda device: True):
                return mcore_zoo.refit(model, adapter, bucket_size=size)

        return refit

    def dict_refit() -> Callable[[], Any]:
        adapter = DictAdapter(tp_size=tp)
        return lambda: mcore_zoo.refit(model, adapter, bucket_size=size)

    def copies() -> Callable[[], Any]:
        pairs = [(torch.empty(shape, dtype=dt, device=DEVICE), torch.randn(shape).to(DEVICE, dt)) for _, shape, dt in plan.hf]

        def run() -> None:
            for dst, src in pairs:
                dst.copy_(src)

        return run

    configs: dict[str, Callable[[], Callable[[], Any]]] = {"vllm": vllm_refit, "dict": dict_refit, "copies": copies}
    if copy_runs is not None and (args.device == "cuda" or tp == 1):
        # not on the CPU at engine TP > 1: a TP1 trainer's column slices are one run per row there,
        # and memmove replays runs one by one in Python, where the kernel takes them in one launch
        configs["vllm-fused"] = fused_refit
    if programs is not None and hasattr(programs, "local_source"):
        configs["vllm-stream"] = forced_stream(vllm_refit)
    if args.full_width:  # memory: the model, one stand-in engine and the copies' pairs
        configs = {k: v for k, v in configs.items() if k in ("vllm", "vllm-fused", "copies")}
    runs = {name: make() for name, make in configs.items()}
    first = {name: run() for name, run in runs.items()}  # plan and binding: not timed
    sources = {name: getattr(stats, "source", "") for name, stats in first.items() if stats is not None}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            gc.collect()
            times[name] += timed(runs[name], args.iters)

    floor = statistics.median(times["copies"])
    result: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": args.threads, "layers": args.layers, "device": args.device, "full_width": args.full_width,
        "engine_tp": tp, "hf_tensors": tensors,
        "buckets": len(plan.buckets), "sources": sources, "configs": {},
    }  # fmt: skip
    print(f"{tensors} HF tensors, engine TP{tp}, {len(plan.buckets)} bucket(s), torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'config':<12} {'source':<7} {'ms/refit':>9} {'us/tensor':>10} {'over copies us/tensor':>22}")
    for name, ts in times.items():
        median = statistics.median(ts)
        row = {"ms": median * 1e3, "us_per_tensor": median / tensors * 1e6, "overhead_us_per_tensor": (median - floor) / tensors * 1e6,
               "ms_p10_p90": [sorted(ts)[len(ts) // 10] * 1e3, sorted(ts)[len(ts) * 9 // 10] * 1e3]}  # fmt: skip
        result["configs"][name] = row
        print(f"{name:<12} {sources.get(name, '-') or '-':<7} {row['ms']:9.2f} {row['us_per_tensor']:10.2f} {row['overhead_us_per_tensor']:22.2f}")
    if args.profile:
        result["profile"] = profile(runs["vllm"], args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
