"""mcore-zoo's loads against a plain read, and against Megatron-Bridge, in one run (CPU): TP1, TP2, MoE EP1 / EP2.

Megatron-Bridge lives in its own environment (its own Python, torch and megatron-core); this script
runs there too, for its side, importing that side's benchmark script (``--anchor-bench``: its
import shims and ``bridge_load``)::

    python bench/anchor_compare.py CKPT --anchor-python ANCHOR_VENV/bin/python --anchor-bench BENCH \\
        [--rounds 3] [--tp2] [--moe-config QWEN3_30B_A3B_CONFIG [--moe-layers 4]] [--compare-src OTHER/src] \\
        [--json out/anchor.json]
    python bench/anchor_compare.py --from-json out/anchor.json     # the tables again

The output starts with the machine (CPU model, cores, memory, kernel, load average before and
after) and the date, and the versions of both environments.

Every measurement runs in a fresh process, after the checkpoint's files were read once (warm page
cache) and a pause (``--settle``). Each round runs, alternating the order between rounds:

* **plain read**: ``safe_open`` + ``get_tensor(...).clone()`` of every tensor, all kept - in this
  environment and in the anchor's;
* **load**: zoo: ``mcore_zoo.build_model(CKPT, backend="local", load=CKPT, params_dtype=bf16)``,
  timed whole (config, parallel state, construction, plan, reads); Megatron-Bridge:
  ``bridge_load`` (gloo group, provider, construction, ``load_hf_weights``), timed as its own
  ``load`` phase times it. Imports are excluded on both sides: ``import megatron.bridge`` runs
  before the anchor's clock and imports transformers' model registry and the model's config class;
  the zoo's side imports the same before its clock (``load``), and once more without it (``cold
  config class``: the first ``transformers.CONFIG_MAPPING[model_type]`` of a process then runs
  inside the timed build, as in a script that has not touched transformers yet);
* **export**: the same load untimed, then one pass over the exported HF tensors (``views``) and
  one that clones each yielded tensor and drops it (``+ clone``); zoo: ``iter_hf_weights``, then an
  untimed check that every tensor equals the checkpoint's bitwise; Megatron-Bridge:
  ``export_hf_weights(model, cpu=True)``.

With ``--tp2``, each round also runs, in alternating order, the zoo's TP2 load (2 gloo processes,
``load_export.run_load``: ``model_provider`` without init, then ``load_hf_weights`` timed on each
rank) and a plain safetensors read of the same TP2 slices on 2 processes (``get_slice`` along the
axes the weight map splits on, ``clone``, kept: ``load_export.run_baseline_sliced``). With
``--moe-config``, a Qwen3-30B-A3B-shaped checkpoint (that config at full width, ``--moe-layers``
layers, written once under ``--moe-workdir``) is loaded at EP1 and EP2 against a plain read of each
rank's exact share (``moe_load.run_plain`` / ``moe_load.run_load``). For these, the ratio is the
plain read's job time / the load's job time (the slower rank's), per round; peak RSS per rank is
the peak above the RSS just before the load, against the rank's parameter bytes + the largest
checkpoint tensor + 10%.

Each measurement records wall time and the process's CPU time (all threads) in the timed region:
on a shared machine the wall time also counts waiting for a core, the CPU time does not. Peak RSS
is ``ru_maxrss`` of the measured process (imports included, as the anchor reports it). Ratios are
taken per round against the plain read of the same environment, then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load_export import peak, reset_peak


def _versions(*extra: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "megatron-core", "safetensors", "transformers", *extra):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def machine() -> dict[str, Any]:
    """What ran the measurements: CPU model, logical CPUs, memory, kernel, load average, date."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0.0)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": model, "logical_cpus": os.cpu_count(),
            "memory_gib": round(mem, 1), "kernel": platform.release(), "load_average": os.getloadavg()}  # fmt: skip


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _files(ckpt: str) -> list[Path]:
    index = Path(ckpt) / "model.safetensors.index.json"
    if index.is_file():
        return [Path(ckpt) / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [Path(ckpt) / "model.safetensors"]


def _warm(ckpt: str) -> None:
    for file in _files(ckpt):
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


# ---------------------------------------------------------------------------- the zoo's phases
def phase_raw(ckpt: str) -> dict[str, Any]:
    import torch  # noqa: F401
    from safetensors import safe_open

    c0, t0 = time.process_time(), time.perf_counter()
    state, nbytes = {}, 0
    for file in _files(ckpt):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name).clone()
                nbytes += state[name].numel() * state[name].element_size()
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "bytes": nbytes,
            "peak_rss_mb": _peak_mb()}


def _zoo_build(ckpt: str, warm_config: bool) -> tuple[Any, dict[str, Any]]:
    import torch
    import megatron.core.models.gpt  # noqa: F401
    import transformers

    import mcore_zoo

    mcore_zoo.build_model, mcore_zoo.load_hf_weights, mcore_zoo.iter_hf_weights  # resolve lazy imports
    if warm_config:  # what `import megatron.bridge` does on the anchor's side before its clock
        transformers.CONFIG_MAPPING[json.loads((Path(ckpt) / "config.json").read_text())["model_type"]]
    rss_before = _peak_mb()
    start = reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, params_dtype=torch.bfloat16)
    seconds, cpu_s, above = time.perf_counter() - t0, time.process_time() - c0, peak() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, {"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mb": _peak_mb(), "rss_before_mb": rss_before,
                   "peak_above_start": above, "shard": shard, "largest": _largest(ckpt),
                   "torch_threads": torch.get_num_threads()}  # fmt: skip


def _largest(ckpt: str) -> int:
    """Bytes of the checkpoint's largest tensor."""
    from mcore_zoo.weights.io import HFCheckpoint

    with HFCheckpoint(ckpt) as c:
        return max(c.entry(n).nbytes for n in c.keys())


def phase_load(ckpt: str, warm_config: bool = True) -> dict[str, Any]:
    return _zoo_build(ckpt, warm_config)[1]


def phase_export(ckpt: str) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    import mcore_zoo

    model, _ = _zoo_build(ckpt, True)
    c0, t0 = time.process_time(), time.perf_counter()
    nbytes = tensors = 0
    for _, tensor in mcore_zoo.iter_hf_weights(model):
        nbytes += tensor.numel() * tensor.element_size()
        tensors += 1
        del tensor
    views, views_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    for _, tensor in mcore_zoo.iter_hf_weights(model):
        copy = tensor.clone()
        del copy, tensor
    clone = time.perf_counter() - t0
    peak = _peak_mb()
    handles = {}
    where = {name: file for file in _files(ckpt) for name in safe_open(str(file), framework="pt").keys()}
    equal = set()
    for name, tensor in mcore_zoo.iter_hf_weights(model):
        if where[name] not in handles:
            handles[where[name]] = safe_open(str(where[name]), framework="pt")
        source = handles[where[name]].get_tensor(name)
        same = source.dtype == tensor.dtype and source.shape == tensor.shape
        if same and torch.equal(source.view(torch.uint8), tensor.contiguous().view(torch.uint8)):
            equal.add(name)
    return {"seconds": views, "cpu_s": views_cpu, "export_plus_clone_s": clone, "bytes": nbytes, "tensors": tensors,
            "peak_rss_mb": peak, "bitwise_equal": equal == set(where)}  # fmt: skip


# ---------------------------------------------------------------------------- TP2 and MoE layouts
# Each runs its ranks as fresh processes (``mcore_zoo.distributed.launch``, gloo) and returns one
# result per rank; the functions are the ones bench/load_export.py and bench/moe_load.py time.
def phase_tp2(ckpt: str, which: str) -> list[dict[str, Any]]:
    from load_export import run_baseline_sliced, run_load

    from mcore_zoo.distributed import launch

    if which == "plain":
        return launch(run_baseline_sliced, 2, ckpt)
    ranks = launch(run_load, 2, ckpt, os.path.dirname(ckpt), False)
    return [{**r, "bytes": r["bytes_read"]} for r in ranks]


def phase_moe(ckpt: str, which: str, ep: int) -> list[dict[str, Any]]:
    from moe_load import run_load, run_plain

    from mcore_zoo.distributed import launch

    ranks = launch(run_plain if which == "plain" else run_load, ep, ckpt, ep)
    if which == "load":
        largest = _largest(ckpt)
        ranks = [{**r, "shard": r["param_bytes"], "largest": largest} for r in ranks]
    return ranks


def moe_checkpoint(config_path: str, layers: int, workdir: str) -> str:
    """The Qwen3-30B-A3B-shaped checkpoint of ``bench/moe_load.py`` (written once, then reused)."""
    from moe_load import ensure_checkpoint

    config = json.loads(Path(config_path).read_text())
    config["num_hidden_layers"] = layers
    config["max_window_layers"] = min(config.get("max_window_layers", layers), layers)
    return str(ensure_checkpoint(Path(workdir) / f"qwen3-30b-a3b-{layers}l", config, 1.0))


# ---------------------------------------------------------------------------- Megatron-Bridge's phases
# Run by the anchor environment's python: its benchmark script's own functions (import shims,
# ``bridge_load``: gloo group, provider, construction, ``load_hf_weights``), timed as its ``load``
# and ``export`` phases time them, plus the CPU time.
def _anchor(bench: str) -> Any:
    sys.path.insert(0, str(Path(bench).resolve().parent))
    import bench as anchor  # type: ignore[import-not-found]

    anchor.install_import_shims()
    import megatron.bridge  # noqa: F401 - imports excluded, as in the anchor's own phases

    return anchor


def phase_mb_load(ckpt: str, bench: str) -> dict[str, Any]:
    anchor, timings = _anchor(bench), {}
    rss_before = _peak_mb()
    c0, t0 = time.process_time(), time.perf_counter()
    anchor.bridge_load(ckpt, timings)
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "peak_rss_mb": _peak_mb(),
            "rss_before_mb": rss_before, "versions": _versions("megatron-bridge"), **timings}  # fmt: skip


def phase_mb_export(ckpt: str, bench: str) -> dict[str, Any]:
    import gc

    anchor = _anchor(bench)
    bridge, model = anchor.bridge_load(ckpt, {})
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    nbytes = tensors = 0
    for _, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        nbytes += tensor.numel() * tensor.element_size()
        tensors += 1
        del tensor
    views, views_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    for _, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        copy = tensor.clone()
        del copy, tensor
    return {"seconds": views, "cpu_s": views_cpu, "export_plus_clone_s": time.perf_counter() - t0, "bytes": nbytes,
            "tensors": tensors, "peak_rss_mb": _peak_mb()}  # fmt: skip


# ---------------------------------------------------------------------------- driver
def _run(cmd: list[str], src: str | None = None) -> Any:
    env = None if src is None else {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + "\n" + done.stderr[-6000:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (rc={done.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


LAYOUTS = {"tp2": "TP2", "ep1": "MoE EP1", "ep2": "MoE EP2"}  # per-rank phases: plain read / load pairs
MB = 1e6


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    single = [key for key in rounds[0] if isinstance(rounds[0][key], dict)]
    for key in single:
        out[key] = {"seconds": _stats([r[key]["seconds"] for r in rounds]),
                    "cpu_s": _stats([r[key]["cpu_s"] for r in rounds]),
                    "peak_rss_mb": _stats([r[key]["peak_rss_mb"] for r in rounds])}  # fmt: skip
        if "export_plus_clone_s" in rounds[0][key]:
            out[key]["plus_clone_s"] = _stats([r[key]["export_plus_clone_s"] for r in rounds])
        base = "zoo_raw" if key.startswith("zoo") else "mb_raw"
        if key != base:  # throughput against the plain read of the same round and environment
            out[key]["vs_raw"] = _stats([r[base]["seconds"] / r[key]["seconds"] for r in rounds])
            out[key]["cpu_vs_raw"] = _stats([r[base]["cpu_s"] / r[key]["cpu_s"] for r in rounds])
        if "peak_above_start" in rounds[0][key]:
            out[key]["memory"] = _memory([r[key] for r in rounds])
    out["zoo_load_vs_mb_load"] = _stats([r["mb_load"]["seconds"] / r["zoo_load"]["seconds"] for r in rounds])
    out["zoo_load_vs_mb_load_cpu"] = _stats([r["mb_load"]["cpu_s"] / r["zoo_load"]["cpu_s"] for r in rounds])
    out["zoo_export_bitwise_equal"] = all(r["zoo_export"]["bitwise_equal"] for r in rounds)
    if "zoo_load_other" in rounds[0]:  # this checkout's load / the other checkout's, measured back to back
        out["zoo_load_vs_other"] = _stats([r["zoo_load_other"]["seconds"] / r["zoo_load_again"]["seconds"] for r in rounds])
        out["zoo_load_vs_other_cpu"] = _stats([r["zoo_load_other"]["cpu_s"] / r["zoo_load_again"]["cpu_s"] for r in rounds])
    out["layouts"] = {}
    for layout in LAYOUTS:
        if f"{layout}_load" not in rounds[0]:
            continue
        plain, load = [r[f"{layout}_plain"] for r in rounds], [r[f"{layout}_load"] for r in rounds]
        ranks = len(load[0])
        out["layouts"][layout] = {
            "plain_s": _stats([max(x["seconds"] for x in p) for p in plain]),
            "load_s": _stats([max(x["seconds"] for x in ld) for ld in load]),
            "vs_plain": _stats([max(x["seconds"] for x in p) / max(x["seconds"] for x in ld) for p, ld in zip(plain, load)]),
            "bytes_match": all(x["bytes"] == y["bytes"] for p, ld in zip(plain, load) for x, y in zip(p, ld)),
            "ranks": [{"bytes": load[0][i]["bytes"], **_memory([ld[i] for ld in load])} for i in range(ranks)],
        }  # fmt: skip
    return out


def _memory(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst peak RSS above the start over the rounds, against the shard + the largest tensor + 10%."""
    worst, shard, largest = max(r["peak_above_start"] for r in runs), runs[0]["shard"], runs[0]["largest"]
    target = (shard + largest) * 1.1
    return {"peak_above_start_mb": worst / MB, "shard_mb": shard / MB, "largest_mb": largest / MB,
            "target_mb": target / MB, "within": worst <= target}  # fmt: skip


def _span(st: dict[str, float], unit: str = "") -> str:
    return f"{st['median']:.2f}{unit} ({st['min']:.2f}-{st['max']:.2f})"


def markdown(s: dict[str, Any]) -> str:
    def cells(r: dict[str, Any], ratio: bool = True) -> str:
        ratio = (f"{_span(r['vs_raw'], 'x')} | {_span(r['cpu_vs_raw'], 'x')}" if "vs_raw" in r else "1 | 1") if ratio else " | "
        return f"{_span(r['seconds'])} | {_span(r['cpu_s'])} | {ratio} | {r['peak_rss_mb']['median']:.0f}"

    lines = []
    if "machine" in s:
        m, after = s["machine"], s.get("load_average_after")
        lines += [
            f"Measured {m['date']} on {m['logical_cpus']} logical CPUs ({m['cpu']}), {m['memory_gib']} GiB,"
            f" kernel {m['kernel']}; load average {'/'.join(f'{x:.1f}' for x in m['load_average'])} before"
            + (f", {'/'.join(f'{x:.1f}' for x in after)} after." if after else "."),
            f"mcore-zoo side: {', '.join(f'{k} {v}' for k, v in s.get('versions', {}).items())}.",
            f"Megatron-Bridge side: {', '.join(f'{k} {v}' for k, v in s.get('anchor_versions', {}).items())}.",
            "",
        ]
    lines += [
        f"{s['rounds']} rounds. Seconds: median (min - max) over the rounds; wall time and the process's CPU"
        " time (all threads) in the timed region. x plain read: the plain read's time / this time, per round,"
        " against the plain read in the same environment (> 1: faster than the plain read).",
        "",
        "| side | phase | wall s | CPU s | x plain read (wall) | x plain read (CPU) | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, prefix in (("Megatron-Bridge", "mb"), ("mcore-zoo", "zoo")):
        lines.append(f"| {side} | plain read + clone | {cells(s[prefix + '_raw'])} |")
        lines.append(f"| {side} | HF -> mcore load (construct + load) | {cells(s[prefix + '_load'])} |")
        if prefix == "zoo":
            lines.append(f"| {side} | the same, cold config class | {cells(s['zoo_load_cold'])} |")
            if "zoo_load_other" in s:
                lines.append(f"| {side} | the same, again (paired with the next row) | {cells(s['zoo_load_again'])} |")
                lines.append(f"| {side} | the same, `--compare-src` checkout | {cells(s['zoo_load_other'])} |")
        lines.append(f"| {side} | export, views | {cells(s[prefix + '_export'], ratio=False)} |")
    lines += [
        "",
        f"Export + a clone of each tensor, wall s: Megatron-Bridge {_span(s['mb_export']['plus_clone_s'])},"
        f" mcore-zoo {_span(s['zoo_export']['plus_clone_s'])}.",
        f"zoo load speed / Megatron-Bridge load speed, per round: {_span(s['zoo_load_vs_mb_load'], 'x')} (wall),"
        f" {_span(s['zoo_load_vs_mb_load_cpu'], 'x')} (CPU); zoo export bitwise equal to the checkpoint:"
        f" {s['zoo_export_bitwise_equal']}.",
    ]
    if "zoo_load_vs_other" in s:
        lines.append(f"This checkout's load speed / the `--compare-src` checkout's, per round (back to back):"
                     f" {_span(s['zoo_load_vs_other'], 'x')} (wall), {_span(s['zoo_load_vs_other_cpu'], 'x')} (CPU).")
    if s.get("layouts"):
        lines += [
            "",
            "Loads at other layouts against the plain read of the same bytes (job time: the slower rank's):",
            "",
            "| layout | plain read s | zoo load s | x plain read (wall) | same bytes |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key, r in s["layouts"].items():
            lines.append(f"| {LAYOUTS[key]} | {_span(r['plain_s'])} | {_span(r['load_s'])} | {_span(r['vs_plain'], 'x')}"
                         f" | {'yes' if r['bytes_match'] else 'NO'} |")  # fmt: skip
    lines += ["", "Peak RSS per rank during the zoo's load, above the RSS just before it (worst round), against the rank's"
              " parameters + the largest checkpoint tensor + 10%:", "",
              "| layout | rank | peak above start MB | parameters MB | largest tensor MB | target MB | within |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    memory = [("TP1 (construct + load)", [s["zoo_load"]["memory"]])] if "memory" in s["zoo_load"] else []
    memory += [(LAYOUTS[k], r["ranks"]) for k, r in s.get("layouts", {}).items()]
    for name, ranks in memory:
        for i, m in enumerate(ranks):
            lines.append(f"| {name} | {i} | {m['peak_above_start_mb']:.0f} | {m['shard_mb']:.0f} | {m['largest_mb']:.0f}"
                         f" | {m['target_mb']:.0f} | {'yes' if m['within'] else 'NO'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", nargs="?")
    p.add_argument("--anchor-python", required=False, help="the anchor environment's python")
    p.add_argument("--anchor-bench", required=False, help="the anchor's benchmark script (single-phase mode)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each measured process")
    p.add_argument("--tp2", action="store_true", help="also the TP2 load against the TP2 slices' plain read")
    p.add_argument("--moe-config", default=None, help="a Qwen3-30B-A3B config.json: also its EP1 / EP2 loads")
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--moe-workdir", default=os.path.join(tempfile.gettempdir(), "mcore-zoo-moe-bench"),
                   help="where the MoE checkpoint is written once and kept (outside the repository)")  # fmt: skip
    p.add_argument("--compare-src", default=None, help="another checkout's src/: its TP1 load is measured too"
                   " (key zoo_load_other), alternated with this one's, as a before / after of the same run")  # fmt: skip
    p.add_argument("--json", default=None, help="write the summary and every measurement here")
    p.add_argument("--from-json", default=None, help="print the tables of an earlier --json and exit")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        summary = summarise(data["raw"])
        summary.update({k: data[k] for k in ("machine", "load_average_after", "versions", "anchor_versions") if k in data})
        print(markdown(summary))
        return 0
    ckpt = os.path.abspath(args.ckpt)
    if args.phase:
        phases = {"raw": phase_raw, "load": phase_load, "export": phase_export,
                  "load-cold": lambda c: phase_load(c, warm_config=False),
                  "mb-load": lambda c: phase_mb_load(c, args.anchor_bench),
                  "mb-export": lambda c: phase_mb_export(c, args.anchor_bench),
                  "tp2-plain": lambda c: phase_tp2(c, "plain"), "tp2-load": lambda c: phase_tp2(c, "load"),
                  "ep1-plain": lambda c: phase_moe(c, "plain", 1), "ep1-load": lambda c: phase_moe(c, "load", 1),
                  "ep2-plain": lambda c: phase_moe(c, "plain", 2), "ep2-load": lambda c: phase_moe(c, "load", 2)}  # fmt: skip
        print("RESULT " + json.dumps(phases[args.phase](ckpt)), flush=True)
        os._exit(0)  # skip the teardown of a 2 GB model; the result is printed
    if not (args.anchor_python and args.anchor_bench):
        p.error("--anchor-python and --anchor-bench are required")
    zoo = [sys.executable, os.path.abspath(__file__), ckpt, "--phase"]
    mb = [args.anchor_python, os.path.abspath(__file__), ckpt, "--anchor-bench", os.path.abspath(args.anchor_bench)]
    mb.append("--phase")
    # pairs measured back to back; odd rounds run each pair in the other order
    pairs = [[("zoo_raw", ckpt, zoo + ["raw"]), ("mb_raw", ckpt, mb + ["raw"])],
             [("zoo_load", ckpt, zoo + ["load"]), ("mb_load", ckpt, mb + ["mb-load"])],
             [("zoo_load_cold", ckpt, zoo + ["load-cold"])],
             [("zoo_export", ckpt, zoo + ["export"]), ("mb_export", ckpt, mb + ["mb-export"])]]  # fmt: skip
    if args.compare_src:
        pairs.insert(2, [("zoo_load_other", ckpt, zoo + ["load"]), ("zoo_load_again", ckpt, zoo + ["load"])])
    if args.tp2:
        pairs.append([("tp2_plain", ckpt, zoo + ["tp2-plain"]), ("tp2_load", ckpt, zoo + ["tp2-load"])])
    if args.moe_config:
        moe = moe_checkpoint(args.moe_config, args.moe_layers, args.moe_workdir)
        moe_cmd = [sys.executable, os.path.abspath(__file__), moe, "--phase"]
        for ep in (1, 2):
            pairs.append([(f"ep{ep}_plain", moe, moe_cmd + [f"ep{ep}-plain"]), (f"ep{ep}_load", moe, moe_cmd + [f"ep{ep}-load"])])
    header = {"machine": machine(), "versions": _versions(), "command": " ".join(sys.argv)}
    rounds = []
    for i in range(args.rounds):
        result = {}
        for pair in pairs:
            for key, target, cmd in pair if i % 2 == 0 else pair[::-1]:
                _warm(target)
                time.sleep(args.settle)
                result[key] = _run(cmd, os.path.abspath(args.compare_src) if key == "zoo_load_other" else None)
                shown = result[key] if isinstance(result[key], list) else [result[key]]
                print(f"round {i} {key}", json.dumps([{k: v for k, v in x.items() if not isinstance(v, dict)} for x in shown]),
                      file=sys.stderr, flush=True)  # fmt: skip
        rounds.append(result)
    summary = summarise(rounds)
    summary.update(header, load_average_after=os.getloadavg(), anchor_versions=rounds[0]["mb_load"].get("versions", {}))
    summary["raw"] = rounds
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
