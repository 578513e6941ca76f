"""Run a function on N fresh processes with ``torch.distributed`` initialised (tests, CLI, benches).

:func:`launch` is for code that is not already under ``torchrun``: it spawns ``world_size``
processes, initialises the default process group (gloo on CPU; NCCL when every rank can have its
own GPU), calls ``fn(*args)`` on each and returns every rank's return value (rank order). An
exception on any rank is re-raised here with that rank's traceback.

The ranks meet through a file store in a fresh temporary directory, not a TCP port: a port found
free here can be taken by another process's connection (an ephemeral port of a concurrent job's
gloo pair, say) in the seconds before rank 0 listens on it, and the run then fails with
``EADDRINUSE``. ``MASTER_ADDR`` / ``MASTER_PORT`` are still set in every rank (a free port),
for code that starts a world of its own from the environment.

Inside a launched function, set up Megatron's groups with
:func:`mcore_zoo.parallel.ensure_model_parallel` as usual.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ZooError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(world_size: int) -> int:
    """The intra-op thread count (``torch.set_num_threads``) each of ``world_size`` launched ranks
    runs at: this machine's cores shared out, at least one. On the CPU a GEMM's rounding depends on
    how its work is split over threads, so a single-process reference that is to match the ranks
    bitwise runs at this count too (:func:`mcore_zoo.testing.common.at_rank_threads`)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, results: Any, args: Sequence[Any],
           env: dict, store: str) -> None:  # fmt: skip
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(rank_threads(world_size))
    dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        # Pickled to bytes here: through the queue, torch shares tensor storage by file descriptor,
        # which the parent can no longer fetch once this process has exited.
        value = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
        results.put((rank, True, value))
    except BaseException as exc:  # reported to the parent with the traceback
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    env: Optional[dict] = None,
    timeout: float = 600.0,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` new processes; return their results in rank order.

    ``fn`` must be importable (a module-level function) and its result picklable. ``backend``
    defaults to NCCL when at least ``world_size`` GPUs are visible, else gloo.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    collected: dict[int, Any] = {}
    failures: list[str] = []

    def drain() -> None:  # read while running: a large result would otherwise block its writer
        while not results.empty():
            rank, ok, value = results.get()
            if ok:
                collected[rank] = pickle.loads(value)  # written by our own ranks (_entry) just above
            else:
                failures.append(f"rank {rank}: {value}")

    # the file store's directory (module docstring), removed once every rank has ended
    with tempfile.TemporaryDirectory(prefix="mcore-zoo-launch-", ignore_cleanup_errors=True) as rendezvous:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, port, backend, results, args, dict(env or {}), os.path.join(rendezvous, "store")),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while True:
            drain()
            try:
                if context.join(timeout=0.2):
                    break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                drain()
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                raise ZooError("distributed run failed:\n" + ("\n".join(failures) or str(exc))) from None
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise ZooError(f"distributed run timed out after {timeout:.0f} s")
    drain()
    if failures:
        raise ZooError("distributed run failed:\n" + "\n".join(failures))
    missing = [r for r in range(world_size) if r not in collected]
    if missing:
        raise ZooError(f"distributed run: ranks {missing} returned nothing")
    return [collected[r] for r in range(world_size)]


__all__ = ["launch"]
