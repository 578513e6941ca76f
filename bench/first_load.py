"""The first ``load_hf_weights`` after ``build_model`` in a fresh process (CPU).

    python bench/first_load.py [--experts 128] [--layers 4] [--json out.json]

A Qwen3-MoE checkpoint with many experts (hidden 128, ``--experts`` per layer, ``--layers``
layers, random bf16 weights, written to a temporary directory) is built with ``backend="local"``
and loaded once: the load a job pays at its start, which binds the weight map's rules to the
model (cached for later loads) and may meet a full collection of Python's cyclic garbage
collector made due by the model's construction. Prints one JSON line: the load's wall and
main-thread CPU seconds, and the collector's runs inside it per generation (runs, seconds).
Run it in alternation with another source tree (``PYTHONPATH=OTHER/src``) to compare the two.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.registry import get_registry
    from mcore_zoo.testing.common import ReferenceCheckpoints, case_config

    ensure_model_parallel()
    arch = "Qwen3MoeForCausalLM"
    overrides = {"num_experts": args.experts, "num_hidden_layers": args.layers, "mlp_only_layers": [], "hidden_size": 128,
                 "moe_intermediate_size": 256}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = ReferenceCheckpoints(lambda name: Path(tmp) / name)(get_registry().get(arch), case_config(arch, overrides))
        model = mcore_zoo.build_model(path, backend="local")
        runs: list[list[Any]] = []

        def collected(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                runs.append([info["generation"], time.perf_counter()])
            elif runs:
                runs[-1][1] = time.perf_counter() - runs[-1][1]

        gc.callbacks.append(collected)
        wall, cpu = time.perf_counter(), time.thread_time()
        report = mcore_zoo.load_hf_weights(model, path)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        gc.callbacks.remove(collected)
    result = {
        "load_s": wall, "main_thread_cpu_s": cpu, "tensors": report.tensors_read,
        "collections": {f"gen{g}": {"runs": sum(1 for r in runs if r[0] == g), "s": sum(r[1] for r in runs if r[0] == g)}
                        for g in range(3)},
        "source": str(Path(mcore_zoo.__file__).resolve().parent),
    }  # fmt: skip
    line = json.dumps(result)
    print(line)
    if args.json is not None:
        with open(args.json, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
