"""Main-thread host time per tensor of a load through the staging ring (``mcore_zoo.weights.staging``).

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/staging_host.py [--mode tensors|model] [--count 1500] [--kib 64] [--rounds 5] \\
        [--device cpu|cuda] [--profile 30] [--json out.json]

What it measures: the Python work the load's calling thread does per tensor on the staging path
(``HFCheckpoint.read_into`` -> ``_read_box`` -> ``StagingRing.read`` -> region copies), not the
reads themselves (the page cache is warm; the read threads run beside the main thread). Reported
per round: the main thread's CPU time (``time.thread_time``) and the wall time of the whole load,
each also per tensor; the best and median over ``--rounds``.

* ``--mode tensors``: a safetensors file of ``--count`` bf16 tensors of ``--kib`` KiB each, shaped
  like MoE expert weights (``[rows, 512]``), read whole into preallocated destinations with
  ``HFCheckpoint.read_into`` inside ``queued_reads()`` - the call sequence of ``load_hf_weights``.
* ``--mode model``: ``mcore_zoo.load_hf_weights`` of a small Qwen3-MoE checkpoint with many
  experts (``--experts`` per layer, ``--layers`` layers; ``backend="local"``: per-expert
  parameters, gate/up read into the halves of ``linear_fc1``) into a model built once - the real
  per-tensor call path (rule steps, ``read_rule_into``, direct views).

``--device cpu`` (default) stages CPU destinations through an unpinned ring
(``StagingRing(pin=False, cpu_destinations=True)``, copies synchronous); ``--device cuda`` uses the
default pinned ring and CUDA destinations (copies on a side stream). ``--profile N`` prints the
``N`` most expensive functions (cProfile timed by the main thread's CPU time, one extra round);
``--breakdown``: one extra round with wall-clock timers around the load's steps on the main thread
(``bench/gpu/load_gpu.py``'s ``timed_load``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from mcore_zoo.weights.io import HFCheckpoint
from mcore_zoo.weights.staging import StagingRing

Load = Callable[[HFCheckpoint], int]


def ring_for(device: str) -> StagingRing:
    return StagingRing() if device == "cuda" else StagingRing(pin=False, cpu_destinations=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensors_case(directory: Path, count: int, kib: int, device: str) -> tuple[Path, Load, int]:
    """Write the checkpoint; return ``(its path, one load from an opened checkpoint, tensors per load)``."""
    from safetensors.torch import save_file

    cols = 512
    rows = kib * 1024 // (2 * cols)
    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i // 384}.mlp.experts.{i % 384}.weight": torch.randn(rows, cols, generator=gen).bfloat16()
             for i in range(count)}  # fmt: skip
    save_file(state, str(directory / "model.safetensors"))
    outs = {name: torch.empty(rows, cols, dtype=torch.bfloat16, device=device) for name in state}

    def load(ckpt: HFCheckpoint) -> int:
        with ckpt.queued_reads():
            for name, out in outs.items():
                ckpt.read_into(name, out)
        return len(outs)

    with HFCheckpoint(directory, staging=ring_for(device)) as ckpt:
        load(ckpt)
    for name, t in state.items():  # the staged bytes are the file's
        assert torch.equal(outs[name].cpu(), t), name
    return directory, load, count


def model_case(directory: Path, experts: int, layers: int, device: str) -> tuple[Path, Load, int]:
    """Write a Qwen3-MoE checkpoint and build its model once; return ``(the checkpoint's path, one
    load from an opened checkpoint, tensors per load)``."""
    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.registry import get_registry
    from mcore_zoo.testing.common import ReferenceCheckpoints, case_config

    ensure_model_parallel()
    overrides = {"num_experts": experts, "num_hidden_layers": layers, "mlp_only_layers": [], "hidden_size": 128,
                 "moe_intermediate_size": 256}  # fmt: skip
    refs = ReferenceCheckpoints(lambda name: directory / name)
    arch = "Qwen3MoeForCausalLM"
    path = refs(get_registry().get(arch), case_config(arch, overrides))
    model = mcore_zoo.build_model(path, backend="local")
    if device == "cuda":
        model.cuda()

    def load(ckpt: HFCheckpoint) -> int:
        return mcore_zoo.load_hf_weights(model, ckpt).tensors_read

    with HFCheckpoint(path, staging=ring_for(device)) as ckpt:
        tensors = load(ckpt)
    return path, load, tensors


def timed(path: Path, load: Load, device: str, profiler: Optional[cProfile.Profile] = None) -> tuple[float, float, int]:
    """``(main-thread CPU seconds, wall seconds, tensors)`` of one load, from a checkpoint opened
    (headers read) before the clock - a load opens its checkpoint once, so nothing carries over
    from an earlier round but the page cache."""
    with HFCheckpoint(path, staging=ring_for(device)) as ckpt:
        sync(device)
        if profiler is not None:
            profiler.enable()
        cpu, wall = time.thread_time(), time.perf_counter()
        tensors = load(ckpt)
        sync(device)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if profiler is not None:
            profiler.disable()
    return cpu, wall, tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tensors", "model"), default="tensors")
    parser.add_argument("--count", type=int, default=1500, help="tensors mode: tensors in the file")
    parser.add_argument("--kib", type=int, default=64, help="tensors mode: KiB per tensor")
    parser.add_argument("--experts", type=int, default=128, help="model mode: experts per layer")
    parser.add_argument("--layers", type=int, default=4, help="model mode: decoder layers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile rows (one extra round)")
    parser.add_argument("--breakdown", action="store_true",
                        help="one extra round with timers around the load's steps (bench/gpu/load_gpu.py's timed_load)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="staging-host-") as tmp:
        if args.mode == "tensors":
            path, load, tensors = tensors_case(Path(tmp), args.count, args.kib, args.device)
        else:
            path, load, tensors = model_case(Path(tmp), args.experts, args.layers, args.device)
        rounds = [timed(path, load, args.device) for _ in range(args.rounds)]
        cpu = [r[0] for r in rounds]
        wall = [r[1] for r in rounds]
        result = {
            "mode": args.mode, "device": args.device, "tensors": tensors, "rounds": args.rounds,
            "cpu_s": {"best": min(cpu), "median": statistics.median(cpu)},
            "wall_s": {"best": min(wall), "median": statistics.median(wall)},
            "cpu_us_per_tensor": {"best": 1e6 * min(cpu) / tensors, "median": 1e6 * statistics.median(cpu) / tensors},
            "wall_us_per_tensor": {"best": 1e6 * min(wall) / tensors, "median": 1e6 * statistics.median(wall) / tensors},
        }  # fmt: skip
        if args.mode == "tensors":
            result.update(count=args.count, kib=args.kib)
        else:
            result.update(experts=args.experts, layers=args.layers)
        if args.breakdown:
            sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
            from load_gpu import timed_load

            with HFCheckpoint(path, staging=ring_for(args.device)) as ckpt:
                result["breakdown"] = timed_load(lambda: (load(ckpt), sync(args.device)))
        print(json.dumps(result, indent=1))
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        if args.profile:
            profiler = cProfile.Profile(time.thread_time)  # CPU time: not the waits for the GIL
            timed(path, load, args.device, profiler)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
