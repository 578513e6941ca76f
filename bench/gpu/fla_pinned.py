"""Run a script or module with flash-linear-attention's Triton kernels on one fixed config each,
no autotuning: ``python3 bench/gpu/fla_pinned.py (-m MODULE | SCRIPT) [ARGS...]``.

fla autotunes every kernel at its first call for each key (shapes, dtypes, varlen or not): each
candidate config is compiled and timed. On a fresh machine a gated DeltaNet forward + backward in
fp32 and bf16, packed and padded, compiles hundreds of configs one after another on one CPU core
(a test and a speed run printed nothing in 300 s each, the GPU idle). For a parity run the config
does not matter (the same math; the kernels' results are checked against the torch path within
tolerance), so this launcher pins each fla autotuner to one config: the candidate closest to 4
warps and 2 stages, ties to the first listed. Speed runs should autotune (the figures are then
fla's own); ``--print`` lists each pinned kernel and its config.

Only autotuners of functions defined in ``fla`` modules are pinned; ``TRITON_PRINT_AUTOTUNING=1``
shows any other kernel that still autotunes.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any


def _pick(configs: list[Any]) -> Any:
    """The config closest to 4 warps and 2 stages (first listed among equals)."""
    return min(configs, key=lambda c: (abs((c.num_warps or 4) - 4), abs((c.num_stages or 2) - 2)))


def pin_fla_autotuners(verbose: bool = False) -> None:
    """Make every Triton autotuner of an fla kernel run one config (chosen at its first call)."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self, "base_fn", None) or getattr(self.fn, "fn", self.fn)
        module = getattr(fn, "__module__", "") or ""
        if len(self.configs) > 1 and module.split(".")[0] == "fla":
            self.configs = [_pick(self.configs)]
            if verbose:
                print(f"fla_pinned: {module}.{getattr(fn, '__name__', fn)} -> {self.configs[0]}", flush=True)
        return original(self, *args, **kwargs)

    Autotuner.run = run


def main(argv: list[str]) -> None:
    verbose = "--print" in argv[:1]
    if verbose:
        argv = argv[1:]
    if not argv:
        sys.exit(__doc__)
    pin_fla_autotuners(verbose)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
