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


class Collections:
    """Python's cyclic-collector runs while it is installed (``with Collections() as runs:``):
    :meth:`summary` gives, per generation, how many ran and their seconds."""

    def __init__(self) -> None:
        self.runs: list[list[Any]] = []  # [generation, seconds]

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.runs.append([info["generation"], time.perf_counter()])
        elif self.runs:
            self.runs[-1][1] = time.perf_counter() - self.runs[-1][1]

    def __enter__(self) -> "Collections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict[str, Any]]:
        return {f"gen{g}": {"runs": sum(1 for r in self.runs if r[0] == g), "s": sum(r[1] for r in self.runs if r[0] == g)}
                for g in range(3)}  # fmt: skip


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
        with Collections() as collections:
            wall, cpu = time.perf_counter(), time.thread_time()
            report = mcore_zoo.load_hf_weights(model, path)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    result = {
        "load_s": wall, "main_thread_cpu_s": cpu, "tensors": report.tensors_read,
        "collections": collections.summary(),
        "source": str(Path(mcore_zoo.__file__).resolve().parent),
    }  # fmt: skip
    line = json.dumps(result)
    print(line)
    if args.json is not None:
        with open(args.json, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
