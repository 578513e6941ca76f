"""Load throughput and peak memory per rank at EP1 and EP2 for a Qwen3-30B-A3B-shaped checkpoint (CPU).

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/moe_load.py --config ../shared/configs/qwen3-30b-a3b.json [--layers 4] [--rounds 5] \\
        [--workdir /work/tmp/moe-bench] [--json out/moe_load.json]

The checkpoint: the published config at full width (hidden 2048, 128 experts of
``moe_intermediate_size`` 768, vocabulary 151936, untied) with ``num_hidden_layers`` cut to
``--layers``; random bf16 weights, in the published order (embedding, layer by layer, norm, head)
and sharded like a published checkpoint (``--shard-gb`` per file, ``model.safetensors.index.json``).
It is written once under ``--workdir`` (kept outside the repository) and reused by later runs.

Each round runs, every measurement in fresh processes (``mcore_zoo.distributed.launch``, gloo),
after every file was read once (warm page cache) and a pause of ``--settle`` s, alternating the
order between rounds:

* **plain read**: the exact bytes a rank must read - at EP1 every tensor, at EP2 the shared tensors
  plus the rank's half of the experts - found in the safetensors headers, adjacent ranges merged,
  read with ``os.preadv`` into one buffer allocated before the clock (untouched: its pages are
  faulted in by the copy, as a freshly built model's parameters are), ``torch.get_num_threads()``
  threads; at EP2 both ranks read at the same time;
* **zoo load**: ``mcore_zoo.load_hf_weights(model, ckpt, replicas="read")`` into the model
  ``mcore_zoo.model_provider`` builds (no random init) at EP1 (one process) and EP2 (two; each
  rank reads its own share, as the plain read does; the default ``replicas="broadcast"`` would have
  rank 0 read the shared tensors and send them to rank 1). Timed: the load call on each rank.

Reported per rank: seconds, bytes read (the load's ``LoadReport.bytes_read``, checked against the
plain read's share), GB/s and the ratio to the plain read of the same round; peak RSS during the
load above the RSS just before it (``/proc/self/clear_refs`` resets ``VmHWM`` after the build),
against the rank's parameter bytes (its share).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from anchor_compare import _files, _warm
from load_export import peak, reset_peak

GB = 1e9
EXPERT = ".mlp.experts."


# ---------------------------------------------------------------------------- checkpoint
def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Qwen3-MoE checkpoint (every layer MoE), in the published order."""
    h, v, hd = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    e, i = config["num_experts"], config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate.weight": (e, h)})  # fmt: skip
        for x in range(e):
            shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (i, h), f"{p}mlp.experts.{x}.up_proj.weight": (i, h),
                           f"{p}mlp.experts.{x}.down_proj.weight": (h, i)})  # fmt: skip
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def ensure_checkpoint(directory: Path, config: dict[str, Any], shard_gb: float) -> Path:
    """Write the random bf16 checkpoint once (``done`` marks a finished one with this config)."""
    marker = directory / "done"
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return directory
    from mcore_zoo.weights.io import SafetensorsShardWriter

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    gen = torch.Generator().manual_seed(0)
    writer = SafetensorsShardWriter(directory, max_shard_size=int(shard_gb * GB))
    for name, shape in tensor_shapes(config).items():
        writer.add(name, torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen))
    writer.close()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps(config))
    return directory


def rank_share(ckpt: str, ep: int, ep_rank: int) -> list[str]:
    """The tensors an EP rank reads: every tensor but the other ranks' experts."""
    config = json.loads((Path(ckpt) / "config.json").read_text())
    per_rank = config["num_experts"] // ep
    mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    return [n for n in tensor_shapes(config) if EXPERT not in n or int(n.split(EXPERT)[1].split(".")[0]) in mine]


# ---------------------------------------------------------------------------- measured runs
def _ranges(ckpt: str, names: list[str]) -> list[tuple[str, int, int]]:
    """``(file, offset, bytes)`` of the tensors, adjacent ones merged."""
    from mcore_zoo.weights.io import HFCheckpoint

    with HFCheckpoint(ckpt) as c:
        entries = sorted((c.entry(n) for n in names), key=lambda e: (e.file, e.offset))
    merged: list[list[Any]] = []
    for e in entries:
        if merged and merged[-1][0] == e.file and merged[-1][1] + merged[-1][2] == e.offset:
            merged[-1][2] += e.nbytes
        else:
            merged.append([e.file, e.offset, e.nbytes])
    return [(str(Path(ckpt) / f), o, n) for f, o, n in merged]


def run_plain(ckpt: str, ep: int, piece: int = 64 << 20) -> dict[str, Any]:
    """This rank's share with ``preadv`` into one preallocated, untouched buffer (module docstring)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ranges = _ranges(ckpt, rank_share(ckpt, ep, rank))
    total = sum(n for _, _, n in ranges)
    buffer = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    jobs, at = [], 0
    for path, offset, n in ranges:
        for start in range(0, n, piece):
            size = min(piece, n - start)
            jobs.append((path, offset + start, at + start, size))
        at += n
    fds = {path: os.open(path, os.O_RDONLY) for path, _, _ in ranges}

    def read(job: tuple[str, int, int, int]) -> None:
        path, offset, dest, size = job
        done = 0
        while done < size:
            got = os.preadv(fds[path], [view[dest + done : dest + size]], offset + done)
            if got <= 0:
                raise OSError(f"short read of {path} at {offset + done}")
            done += got

    dist.barrier()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(read, jobs))
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {"rank": rank, "bytes": total, "seconds": seconds, "threads": torch.get_num_threads()}


def run_load(ckpt: str, ep: int) -> dict[str, Any]:
    """One rank: build without init, then the timed ``load_hf_weights`` with its peak RSS."""
    import torch.distributed as dist

    import mcore_zoo
    import mcore_zoo.distributed  # noqa: F401 - imported by the first load otherwise (not IO)
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism

    ensure_model_parallel(Parallelism(ep=ep))
    provider = mcore_zoo.model_provider(ckpt, backend="local", params_dtype=torch.bfloat16, perform_initialization=False)
    model = provider(pre_process=True, post_process=True)
    share = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    before = reset_peak()
    t0 = time.perf_counter()
    report = mcore_zoo.load_hf_weights(model, ckpt, replicas="read")
    seconds = time.perf_counter() - t0
    rank = dist.get_rank()
    want = sum(n for _, _, n in _ranges(ckpt, rank_share(ckpt, ep, rank)))
    return {"rank": rank, "bytes": report.bytes_read, "share_bytes": want, "seconds": seconds,
            "param_bytes": share, "rss_before": before, "peak_above_start": peak() - before,
            "threads": torch.get_num_threads()}  # fmt: skip


# ---------------------------------------------------------------------------- driver
def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per layout and rank: GB/s of the plain read and of the load, their ratio per round, peak RSS."""
    out: dict[str, Any] = {"rounds": len(rounds), "layouts": {}}
    for ep in (1, 2):
        ranks = []
        for rank in range(ep):
            plain = [r[f"plain_ep{ep}"][rank] for r in rounds]
            load = [r[f"load_ep{ep}"][rank] for r in rounds]
            ranks.append({
                "rank": rank, "bytes_read": load[0]["bytes"], "share_bytes": load[0]["share_bytes"],
                "plain_bytes": plain[0]["bytes"], "param_bytes": load[0]["param_bytes"],
                "plain_gbps": _stats([p["bytes"] / p["seconds"] / GB for p in plain]),
                "load_gbps": _stats([x["bytes"] / x["seconds"] / GB for x in load]),
                "load_s": _stats([x["seconds"] for x in load]),
                "ratio": _stats([(x["bytes"] / x["seconds"]) / (p["bytes"] / p["seconds"]) for x, p in zip(load, plain)]),
                "peak_above_start": max(x["peak_above_start"] for x in load),
                "rss_before": statistics.median(x["rss_before"] for x in load),
                "bytes_match": all(x["bytes"] == x["share_bytes"] == p["bytes"] for x, p in zip(load, plain)),
            })  # fmt: skip
        job = [sum(r[f"{k}_ep{ep}"][i]["bytes"] for i in range(ep)) / max(x["seconds"] for x in r[f"{k}_ep{ep}"]) / GB
               for k in ("plain", "load") for r in rounds]  # fmt: skip
        n = len(rounds)
        out["layouts"][f"ep{ep}"] = {"ranks": ranks, "job_plain_gbps": _stats(job[:n]), "job_load_gbps": _stats(job[n:])}
    return out


def markdown(s: dict[str, Any]) -> str:
    def span(st: dict[str, float], fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(st['median'])} ({fmt.format(st['min'])}-{fmt.format(st['max'])})"

    lines = [
        "| layout | rank | bytes read (GB) | = plain-read share | load s | load GB/s | plain read GB/s | load / plain"
        " | peak RSS above start (GB) | rank's parameters (GB) | peak / parameters |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, layout in s["layouts"].items():
        for r in layout["ranks"]:
            lines.append(
                f"| {name.upper()} | {r['rank']} | {r['bytes_read'] / GB:.3f} | {'yes' if r['bytes_match'] else 'NO'}"
                f" | {span(r['load_s'])} | {span(r['load_gbps'])} | {span(r['plain_gbps'])} | {span(r['ratio'], '{:.2f}x')}"
                f" | {r['peak_above_start'] / GB:.3f} | {r['param_bytes'] / GB:.3f} | {r['peak_above_start'] / r['param_bytes']:.3f} |"
            )  # fmt: skip
    lines.append("")
    for name, layout in s["layouts"].items():
        lines.append(f"{name.upper()} job throughput (all ranks' bytes / the slowest rank's time): load"
                     f" {span(layout['job_load_gbps'])} GB/s, plain read {span(layout['job_plain_gbps'])} GB/s.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "shared/configs/qwen3-30b-a3b.json"))
    p.add_argument("--layers", type=int, default=4, help="num_hidden_layers of the checkpoint (full width)")
    p.add_argument("--shard-gb", type=float, default=1.0, help="bytes per safetensors file")
    p.add_argument("--workdir", default="/work/tmp/moe-bench", help="where the checkpoint is written once and kept")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each measured run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mcore_zoo.distributed import launch

    config = json.loads(Path(args.config).read_text())
    config["num_hidden_layers"] = args.layers
    config["max_window_layers"] = min(config.get("max_window_layers", args.layers), args.layers)
    ckpt = ensure_checkpoint(Path(args.workdir) / f"qwen3-30b-a3b-{args.layers}l", config, args.shard_gb)
    total = sum(f.stat().st_size for f in _files(str(ckpt)))
    print(f"checkpoint {ckpt}: {len(_files(str(ckpt)))} files, {total / GB:.2f} GB", file=sys.stderr)
    steps = [("plain_ep1", lambda: launch(run_plain, 1, str(ckpt), 1)),
             ("load_ep1", lambda: launch(run_load, 1, str(ckpt), 1)),
             ("plain_ep2", lambda: launch(run_plain, 2, str(ckpt), 2)),
             ("load_ep2", lambda: launch(run_load, 2, str(ckpt), 2))]  # fmt: skip
    rounds = []
    for i in range(args.rounds):
        result = {}
        for key, run in steps if i % 2 == 0 else [steps[1], steps[0], steps[3], steps[2]]:
            _warm(str(ckpt))
            time.sleep(args.settle)
            result[key] = run()
            print(f"round {i} {key}", json.dumps(result[key]), file=sys.stderr, flush=True)
        rounds.append(result)
    summary = summarise(rounds)
    summary.update(checkpoint_bytes=total, files=len(_files(str(ckpt))), command=" ".join(sys.argv),
                   versions={"torch": torch.__version__, "python": platform.python_version(),
                             "megatron-core": _version("megatron-core"), "safetensors": _version("safetensors")},
                   cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d"), raw=rounds)  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("raw", "layouts")}))
    print(markdown(summary))
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
