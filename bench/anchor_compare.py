"""mcore-zoo and Megatron-Bridge on the same HF checkpoint, in the same run (CPU, TP1).

Megatron-Bridge lives in its own environment (its own Python, torch and megatron-core); this script
runs there too, for its side, importing that side's benchmark script (``--anchor-bench``: its
import shims and ``bridge_load``)::

    python bench/anchor_compare.py CKPT --anchor-python ANCHOR_VENV/bin/python --anchor-bench BENCH \\
        [--rounds 3] [--json out/anchor.json]
    python bench/anchor_compare.py --from-json out/anchor.json     # the table again

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

Each measurement records wall time and the process's CPU time (all threads) in the timed region:
on a shared machine the wall time also counts waiting for a core, the CPU time does not. Peak RSS
is ``ru_maxrss`` of the measured process (imports included, as the anchor reports it). Ratios are
taken per round against the plain read of the same environment, then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


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
    c0, t0 = time.process_time(), time.perf_counter()
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, params_dtype=torch.bfloat16)
    return model, {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "peak_rss_mb": _peak_mb(),
                   "rss_before_mb": rss_before, "torch_threads": torch.get_num_threads()}  # fmt: skip


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
            "rss_before_mb": rss_before, **timings}  # fmt: skip


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
def _run(cmd: list[str]) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + "\n" + done.stderr[-6000:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (rc={done.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        out[key] = {"seconds": _stats([r[key]["seconds"] for r in rounds]),
                    "cpu_s": _stats([r[key]["cpu_s"] for r in rounds]),
                    "peak_rss_mb": _stats([r[key]["peak_rss_mb"] for r in rounds])}  # fmt: skip
        if "export_plus_clone_s" in rounds[0][key]:
            out[key]["plus_clone_s"] = _stats([r[key]["export_plus_clone_s"] for r in rounds])
        base = "zoo_raw" if key.startswith("zoo") else "mb_raw"
        if key != base:  # throughput against the plain read of the same round and environment
            out[key]["vs_raw"] = _stats([r[base]["seconds"] / r[key]["seconds"] for r in rounds])
            out[key]["cpu_vs_raw"] = _stats([r[base]["cpu_s"] / r[key]["cpu_s"] for r in rounds])
    out["zoo_load_vs_mb_load"] = _stats([r["mb_load"]["seconds"] / r["zoo_load"]["seconds"] for r in rounds])
    out["zoo_load_vs_mb_load_cpu"] = _stats([r["mb_load"]["cpu_s"] / r["zoo_load"]["cpu_s"] for r in rounds])
    out["zoo_export_bitwise_equal"] = all(r["zoo_export"]["bitwise_equal"] for r in rounds)
    return out


def markdown(s: dict[str, Any]) -> str:
    def span(st: dict[str, float], unit: str = "") -> str:
        return f"{st['median']:.2f}{unit} ({st['min']:.2f}-{st['max']:.2f})"

    def cells(r: dict[str, Any]) -> str:
        ratio = f"{span(r['vs_raw'], 'x')} | {span(r['cpu_vs_raw'], 'x')}" if "vs_raw" in r else "1 | 1"
        return f"{span(r['seconds'])} | {span(r['cpu_s'])} | {ratio} | {r['peak_rss_mb']['median']:.0f}"

    lines = [
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
        lines.append(f"| {side} | export, views | {cells(s[prefix + '_export'])} |")
    lines += [
        "",
        f"Export + a clone of each tensor, wall s: Megatron-Bridge {span(s['mb_export']['plus_clone_s'])},"
        f" mcore-zoo {span(s['zoo_export']['plus_clone_s'])}.",
        f"zoo load speed / Megatron-Bridge load speed, per round: {span(s['zoo_load_vs_mb_load'], 'x')} (wall),"
        f" {span(s['zoo_load_vs_mb_load_cpu'], 'x')} (CPU); zoo export bitwise equal to the checkpoint:"
        f" {s['zoo_export_bitwise_equal']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", nargs="?")
    p.add_argument("--anchor-python", required=False, help="the anchor environment's python")
    p.add_argument("--anchor-bench", required=False, help="the anchor's benchmark script (single-phase mode)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each measured process")
    p.add_argument("--json", default=None, help="write the summary and every measurement here")
    p.add_argument("--from-json", default=None, help="print the table of an earlier --json and exit")
    p.add_argument("--phase", choices=["raw", "load", "load-cold", "export", "mb-load", "mb-export"],
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    if args.from_json:
        print(markdown(summarise(json.loads(Path(args.from_json).read_text())["raw"])))
        return 0
    ckpt = os.path.abspath(args.ckpt)
    if args.phase:
        fn = {"raw": phase_raw, "load": phase_load, "export": phase_export,
              "load-cold": lambda c: phase_load(c, warm_config=False),
              "mb-load": lambda c: phase_mb_load(c, args.anchor_bench),
              "mb-export": lambda c: phase_mb_export(c, args.anchor_bench)}[args.phase]  # fmt: skip
        print("RESULT " + json.dumps(fn(ckpt)), flush=True)
        os._exit(0)  # skip the teardown of a 2 GB model; the result is printed
    if not (args.anchor_python and args.anchor_bench):
        p.error("--anchor-python and --anchor-bench are required")
    zoo = [sys.executable, os.path.abspath(__file__), ckpt, "--phase"]
    mb = [args.anchor_python, os.path.abspath(__file__), ckpt, "--anchor-bench", os.path.abspath(args.anchor_bench)]
    mb.append("--phase")
    steps = [("zoo_raw", zoo + ["raw"]), ("mb_raw", mb + ["raw"]), ("zoo_load", zoo + ["load"]),
             ("mb_load", mb + ["mb-load"]), ("zoo_load_cold", zoo + ["load-cold"]),
             ("zoo_export", zoo + ["export"]), ("mb_export", mb + ["mb-export"])]  # fmt: skip
    rounds = []
    for i in range(args.rounds):
        result = {}
        order = steps if i % 2 == 0 else [steps[1], steps[0], steps[3], steps[2], steps[4], steps[6], steps[5]]
        for key, cmd in order:
            _warm(ckpt)
            time.sleep(args.settle)
            result[key] = _run(cmd)
            print(key, json.dumps({k: v for k, v in result[key].items() if not isinstance(v, dict)}), file=sys.stderr)
        rounds.append(result)
    summary = summarise(rounds)
    summary["raw"] = rounds
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
