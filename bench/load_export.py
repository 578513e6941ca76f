"""Loading / export / conversion throughput and peak memory on a synthetic ~2 GB checkpoint (CPU).

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/load_export.py [--size-gb 2] [--repeat 8] [--json out/bench.json]

What it measures (all in one run, same files, warm page cache - the files were just written):

* **baseline**: a plain safetensors read of the whole checkpoint into process memory -
  ``safetensors.torch.load_file`` of every file and a ``clone()`` of every tensor, all kept (as
  a loader holds a state dict; ``load_file`` alone only maps the file); each round runs it in a
  fresh process next to the loads, and ratios are taken per round;
* **sliced baseline**: the same on 2 processes for the TP2 slices (``get_slice`` along the axes
  the weight map splits on, ``clone``, kept) - what a TP2 rank would read with safetensors alone;
* **load TP1 / TP2**: ``mcore_zoo.load_hf_weights`` into a Megatron-Core model built by
  ``mcore_zoo.model_provider`` (no random init), 1 and 2 gloo ranks, each in a fresh process;
  throughput = bytes this job read / wall time, and peak RSS per rank above the RSS just before
  the load (``/proc/self/clear_refs`` resets the peak) against the rank's shard (its parameter
  bytes) + the largest checkpoint tensor + 10%;
* **export**: ``mcore_zoo.iter_hf_weights`` (TP1: no communication; TP2: all-gathers) and
  ``mcore_zoo.save_hf_checkpoint`` to disk;
* **convert**: ``mcore_zoo.dist_checkpoint.hf_to_mcore`` and back (``mcore_to_hf``, 100 MB shards), with
  their peak RSS, in a process whose private data is capped (``RLIMIT_DATA``, default 1000 MB,
  half the default model): they stream, so they fit.

The checkpoint is generated in a temporary directory (``--workdir``) and deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

MB = 1e6


# ---------------------------------------------------------------------------- memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the peak-RSS counter (VmHWM) to the current RSS; returns the current RSS (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak() -> int:
    return _status("VmHWM")


# ---------------------------------------------------------------------------- checkpoint
def synthetic_config(size_gb: float) -> dict[str, Any]:
    """A Llama-shaped config whose bf16 weights take about ``size_gb`` GB (untied, GQA 16/4)."""
    hidden, ffn, vocab = 2048, 5632, 32000
    per_layer = hidden * hidden * 2 + 2 * (hidden // 4) * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "attention_dropout": 0.0,
        "pretraining_tp": 1, "rope_scaling": None, "head_dim": hidden // 16,
    }  # fmt: skip


def write_checkpoint(directory: Path, config: dict[str, Any], shard_bytes: int = 500_000_000) -> int:
    """HF-style sharded safetensors with random bf16 weights; returns the total bytes."""
    from safetensors.torch import save_file

    h, f, v, kv = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["hidden_size"] // 4
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })  # fmt: skip
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = total = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        used += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return total


# ---------------------------------------------------------------------------- measured runs
def run_baseline(ckpt: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    before = reset_peak()
    t0 = time.perf_counter()
    state = {}
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        state.update({name: tensor.clone() for name, tensor in load_file(str(file)).items()})
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    peak_above = peak() - before
    t0 = time.perf_counter()  # again, into the now resident tensors: no first-touch page faults
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name].copy_(tensor)
    warm = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": seconds, "warm_seconds": warm, "peak_above_start": peak_above}


def run_baseline_sliced(ckpt: str) -> dict[str, Any]:
    """A plain safetensors read of this rank's tensor-parallel slices (``get_slice`` along the
    axes the weight map splits on, ``clone``, all kept): the same bytes a TP rank loads."""
    import torch.distributed as dist
    from safetensors import safe_open

    import mcore_zoo

    rank, size = dist.get_rank(), dist.get_world_size()
    arch = mcore_zoo.lookup(ckpt)
    axes = {n: a for b in arch.weight_map(arch.config_from_hf(ckpt)).expand_full() for n, a in zip(b.hf, b.tp_axes)}

    def slices() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(Path(ckpt).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    shape, axis = piece.get_shape(), axes[name]
                    index = [slice(None)] * len(shape)
                    if axis is not None:
                        step = shape[axis] // size
                        index[axis] = slice(rank * step, (rank + 1) * step)
                    yield name, piece[tuple(index)]

    dist.barrier()
    t0 = time.perf_counter()
    state = {name: piece.clone() for name, piece in slices()}
    dist.barrier()
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()  # again, into the now resident tensors
    for name, piece in slices():
        state[name].copy_(piece)
    dist.barrier()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"bytes": nbytes, "seconds": seconds, "warm_seconds": time.perf_counter() - t0}


def run_load(ckpt: str, out_dir: str, export: bool) -> dict[str, Any]:
    """One rank: build without init, load (timed, peak RSS), then export (timed)."""
    import torch.distributed as dist

    import mcore_zoo
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.weights.io import HFCheckpoint

    import mcore_zoo.distributed  # noqa: F401 - imported by the first load otherwise (not IO)

    world = dist.get_world_size()
    ensure_model_parallel(Parallelism(tp=world))
    provider = mcore_zoo.model_provider(ckpt, backend="local", params_dtype=torch.bfloat16, perform_initialization=False)
    model = provider(pre_process=True, post_process=True)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    with HFCheckpoint(ckpt) as c:
        largest = max(math.prod(c.shape(n)) * c.dtype(n).itemsize for n in c.keys())
    dist.barrier()
    before = reset_peak()
    t0 = time.perf_counter()
    report = mcore_zoo.load_hf_weights(model, ckpt)
    dist.barrier()
    seconds = time.perf_counter() - t0
    result = {
        "seconds": seconds, "bytes_read": report.bytes_read, "shard": shard, "largest": largest,
        "peak_above_start": peak() - before, "rss_before": before,
    }  # fmt: skip
    t0 = time.perf_counter()  # again, into the now resident parameters: no first-touch page faults
    mcore_zoo.load_hf_weights(model, ckpt)
    dist.barrier()
    result["warm_seconds"] = time.perf_counter() - t0
    if export:
        t0 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in mcore_zoo.iter_hf_weights(model))
        result["iter_seconds"], result["iter_bytes"] = time.perf_counter() - t0, nbytes
        target = os.path.join(out_dir, f"export-tp{world}")
        t0 = time.perf_counter()
        mcore_zoo.save_hf_checkpoint(model, target, max_shard_size="500MB")
        result["save_seconds"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)
    return result


def run_convert(ckpt: str, out_dir: str, cap: int) -> dict[str, Any]:
    """Both conversions with the process's private data (``RLIMIT_DATA``: heap and private
    writable mappings) capped at ``cap`` bytes above what it uses once imports are done - less
    than the model: an implementation that materialised the model would fail."""
    import resource

    from mcore_zoo.dist_checkpoint import hf_to_mcore, mcore_to_hf, meta_model

    meta_model(ckpt)  # imports Megatron-Core & co. outside the timed, memory-measured region
    limit = _status("VmData") + cap
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    mcore_dir, back = os.path.join(out_dir, "mcore"), os.path.join(out_dir, "back")
    before = reset_peak()
    t0 = time.perf_counter()
    hf_to_mcore(ckpt, mcore_dir)
    to_mcore = {"seconds": time.perf_counter() - t0, "peak_above_start": peak() - before}
    before = reset_peak()
    t0 = time.perf_counter()
    mcore_to_hf(mcore_dir, back, max_shard_size="100MB")
    to_hf = {"seconds": time.perf_counter() - t0, "peak_above_start": peak() - before}
    shutil.rmtree(mcore_dir, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    return {"to_mcore": to_mcore, "to_hf": to_hf, "data_cap": cap}


# ---------------------------------------------------------------------------- report
def summarise(total: int, runs: dict[str, list[Any]], convert: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    def gbps(nbytes: float, seconds: float) -> float:
        return nbytes / seconds / 1e9

    out: dict[str, Any] = {"checkpoint_bytes": total, "layers": config["num_hidden_layers"], "load": {}, "export": {}}
    for tp in (1, 2):
        rounds = runs[f"tp{tp}"]
        job = [gbps(sum(r["bytes_read"] for r in ranks), max(r["seconds"] for r in ranks)) for ranks in rounds]
        if tp == 1:
            base = [gbps(r["bytes"], r["seconds"]) for r in runs["baseline"]]
        else:
            base = [gbps(sum(r["bytes"] for r in ranks), max(r["seconds"] for r in ranks)) for ranks in runs["baseline_tp2"]]
        ratios = [j / b for j, b in zip(job, base)]
        base_runs = runs["baseline"] if tp == 1 else runs["baseline_tp2"]
        warm_job = [gbps(sum(r["bytes_read"] for r in ranks), max(r["warm_seconds"] for r in ranks)) for ranks in rounds]
        warm_base = [
            gbps(r["bytes"], r["warm_seconds"]) if tp == 1
            else gbps(sum(x["bytes"] for x in r), max(x["warm_seconds"] for x in r))
            for r in base_runs
        ]  # fmt: skip
        warm_ratios = [j / b for j, b in zip(warm_job, warm_base)]
        per_rank = []
        for rank in range(tp):
            worst = max(ranks[rank]["peak_above_start"] for ranks in rounds)
            r = rounds[0][rank]
            target = (r["shard"] + r["largest"]) * 1.1
            per_rank.append({"peak_above_start_MB": worst / MB, "shard_MB": r["shard"] / MB, "largest_MB": r["largest"] / MB,
                             "target_MB": target / MB, "within_target": worst <= target})  # fmt: skip
        out["load"][f"tp{tp}"] = {
            "rounds": len(rounds), "GBps_median": statistics.median(job), "GBps_best": max(job),
            "baseline_GBps_median": statistics.median(base), "baseline_GBps_best": max(base),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios), "ranks": per_rank,
            "warm_GBps_median": statistics.median(warm_job), "warm_baseline_GBps_median": statistics.median(warm_base),
            "warm_ratio_median": statistics.median(warm_ratios), "warm_ratio_min": min(warm_ratios), "warm_ratio_max": max(warm_ratios),
        }  # fmt: skip
        ex = [ranks[0] for ranks in rounds if "iter_seconds" in ranks[0]]
        if ex:
            out["export"][f"tp{tp}"] = {
                "iter_GBps": statistics.median(gbps(r["iter_bytes"], r["iter_seconds"]) for r in ex),
                "save_GBps": statistics.median(gbps(total, r["save_seconds"]) for r in ex),
            }
    out["convert"] = {
        direction: {"GBps": gbps(total, v["seconds"]), "peak_above_start_MB": v["peak_above_start"] / MB}
        for direction, v in convert.items()
        if direction != "data_cap"
    }
    out["convert_data_cap_MB"] = convert["data_cap"] / MB
    return out


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"Checkpoint: {s['checkpoint_bytes'] / 1e9:.2f} GB bf16 ({s['layers']} Llama layers, hidden 2048, GQA 16/4, vocab 32000),"
        " warm page cache.",
        "",
        "Each round runs, each in fresh processes after a pause (order alternating between rounds): a plain safetensors read of the whole checkpoint",
        "(`load_file` + `clone`), the TP1 load, the TP2 load, and a plain safetensors read of the TP2",
        "slices on 2 processes (`get_slice` along the weight map's axes + `clone`). Ratios are taken per",
        "round, TP1 against the whole read, TP2 against the sliced read (the machine is shared and noisy).",
        "",
        "| load | rounds | job GB/s (median / best) | plain read GB/s (median / best) | ratio median | ratio min - max |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for tp, r in s["load"].items():
        lines.append(
            f"| `load_hf_weights` {tp.upper()} | {r['rounds']} | {r['GBps_median']:.2f} / {r['GBps_best']:.2f}"
            f" | {r['baseline_GBps_median']:.2f} / {r['baseline_GBps_best']:.2f} | {r['ratio_median']:.2f}x"
            f" | {r['ratio_min']:.2f}x - {r['ratio_max']:.2f}x |"
        )
    lines += [
        "",
        "The same, repeated in each process into the now resident destinations (no first-touch page faults):",
        "",
        "| load, warm destination | job GB/s (median) | plain read GB/s (median) | ratio median | ratio min - max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for tp, r in s["load"].items():
        lines.append(
            f"| `load_hf_weights` {tp.upper()} | {r['warm_GBps_median']:.2f} | {r['warm_baseline_GBps_median']:.2f}"
            f" | {r['warm_ratio_median']:.2f}x | {r['warm_ratio_min']:.2f}x - {r['warm_ratio_max']:.2f}x |"
        )
    lines += ["", "| run | rank | peak RSS above start MB | shard MB | largest tensor MB | target MB | within |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for tp, r in s["load"].items():
        for rank, m in enumerate(r["ranks"]):
            lines.append(f"| load {tp.upper()} | {rank} | {m['peak_above_start_MB']:.0f} | {m['shard_MB']:.0f} | {m['largest_MB']:.0f}"
                         f" | {m['target_MB']:.0f} | {'yes' if m['within_target'] else 'NO'} |")  # fmt: skip
    lines += ["", "| export | iter_hf_weights GB/s | save_hf_checkpoint GB/s |", "| --- | --- | --- |"]
    for tp, r in s["export"].items():
        lines.append(f"| {tp.upper()} | {r['iter_GBps']:.2f} | {r['save_GBps']:.2f} |")
    lines += ["", f"Conversion ran with the process's private data capped (RLIMIT_DATA) at {s['convert_data_cap_MB']:.0f} MB"
              f" above its size after imports; the model is {s['checkpoint_bytes'] / MB:.0f} MB.", "",
              "| convert (one process) | GB/s | peak RSS above start MB |", "| --- | --- | --- |"]
    for direction, r in s["convert"].items():
        lines.append(f"| {direction.replace('_', ' ')} | {r['GBps']:.2f} | {r['peak_above_start_MB']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--settle", type=float, default=3.0, help="seconds of pause before each measured process")
    p.add_argument("--convert-cap-mb", type=float, default=1000, help="private-data cap of the conversion process")
    p.add_argument("--workdir", default=None, help="where the temporary checkpoint goes (default: the system temp dir)")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    from mcore_zoo.distributed import launch

    work = Path(tempfile.mkdtemp(prefix="mcore-zoo-bench-", dir=args.workdir))
    try:
        config = synthetic_config(args.size_gb)
        ckpt = work / "ckpt"
        ckpt.mkdir()
        t0 = time.perf_counter()
        total = write_checkpoint(ckpt, config)
        print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        runs: dict[str, list[Any]] = {"baseline": [], "tp1": [], "tp2": [], "baseline_tp2": []}
        run_baseline(str(ckpt))  # warm the page cache
        for i in range(args.repeat):  # odd rounds run the plain reads first, even rounds the loads
            steps = [
                ("baseline", lambda: launch(run_baseline, 1, str(ckpt))[0]),
                ("tp1", lambda: launch(run_load, 1, str(ckpt), str(work), i == 0)),
                ("baseline_tp2", lambda: launch(run_baseline_sliced, 2, str(ckpt))),
                ("tp2", lambda: launch(run_load, 2, str(ckpt), str(work), i == 0)),
            ]
            for key, step in steps if i % 2 else [steps[1], steps[0], steps[3], steps[2]]:
                time.sleep(args.settle)  # whatever ran right after a 2 GB process exited was measured slower
                runs[key].append(step())
        convert = launch(run_convert, 1, str(ckpt), str(work), int(args.convert_cap_mb * MB))[0]
        summary = summarise(total, runs, convert, config)
        summary["raw"] = runs
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(markdown(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
