"""Process groups: work under ``torchrun``, inside a trainer that already initialised Megatron's
parallel state, or in a plain single process (CLI, tests).

The zoo never re-initialises what a trainer set up: :func:`ensure_model_parallel` only creates the
default process group and Megatron-Core's groups when they do not exist yet.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import compat, cpu_shim
from .errors import LayoutError, ZooError
from .placement import Parallelism, Placement, process_count


def ensure_process_group(backend: Optional[str] = None) -> None:
    """Initialise ``torch.distributed`` if needed: from torchrun's environment when present, else
    as a single process. ``backend`` defaults to NCCL with CUDA, gloo without."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _init_process_group(backend=backend)
        return
    # one process needs no rendezvous: an in-memory store, so that no port is taken (nor one
    # inherited from another job's MASTER_PORT reused)
    _init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _init_process_group(**kwargs: object) -> None:
    """``dist.init_process_group``; a rendezvous address that cannot be used (``MASTER_PORT`` busy,
    often inherited from another job's environment) is a :class:`ZooError` naming it."""
    try:
        dist.init_process_group(**kwargs)  # type: ignore[arg-type]
    except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
        text = " ".join(str(exc).split())
        if "address already in use" in text.lower() or "EADDRINUSE" in text or type(exc).__name__ == "DistNetworkError":
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise ZooError(f"torch.distributed cannot rendezvous at MASTER_ADDR:MASTER_PORT = {where}"
                           f" ({text[:200]}): the port is in use - set MASTER_PORT to a free port, or unset it"
                           " for a single process") from None  # fmt: skip
        raise


def ensure_model_parallel(parallel: Optional[Parallelism] = None, *, seed: int = 1234) -> Parallelism:
    """Make sure Megatron-Core's parallel state exists; return the layout in effect.

    If it is already initialised (a trainer did it), its layout is returned and ``parallel`` must
    agree with it (when given). Otherwise the process group and Megatron's groups are created for
    ``parallel`` (default: everything 1) and the model-parallel RNG is seeded.
    """
    from megatron.core import parallel_state

    cpu_shim.activate()
    if parallel_state.model_parallel_is_initialized():
        current = Placement.current()
        if parallel is None:
            return current.parallel
        current.check_sizes(parallel, what="requested")
        return parallel
    parallel = parallel or Parallelism()
    ensure_process_group()
    world = process_count()
    if world % parallel.world_size_needed():
        raise LayoutError(
            f"world size {world} is not divisible by tp*pp*cp = {parallel.tp}*{parallel.pp}*{parallel.cp}"
        )
    compat.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel


def placement_for(parallel: Parallelism, arch: object = None, ranks: Optional[Sequence[int]] = None) -> Placement:
    """Where a model at ``parallel`` is built: on Megatron-Core's parallel state when the job has
    none yet (it is created for ``parallel``, as :func:`ensure_model_parallel` does) or when it has
    the same sizes; else on process groups of the model's own
    (:func:`mcore_zoo.model_groups.own_placement`), leaving the parallel state - and every model
    built on it - as it is. ``arch`` (the model's :class:`~mcore_zoo.config.arch.ArchConfig`) is
    checked for what own groups cannot carry (:func:`mcore_zoo.model_groups.check_own_groups`).
    ``ranks``: the job's global ranks the model is placed on, when not all of them: the model is
    then always on groups of its own over those ranks (the job's parallel state, created at all 1
    if there is none, spans every rank)."""
    from megatron.core import parallel_state

    from .model_groups import check_own_groups, model_ranks, own_placement, refuse_other_expert_tp

    cpu_shim.activate()
    if ranks is not None:
        ensure_process_group()
        if len(model_ranks(ranks, process_count())) < process_count():
            ensure_model_parallel()  # the job's state (and the model-parallel RNG) must exist
            check_own_groups(arch, parallel, ranks)
            return own_placement(parallel, ranks)
    if parallel_state.model_parallel_is_initialized():
        current = Placement.current()
        try:
            return current.with_model_options(parallel)
        except LayoutError:  # another layout than the job's parallel state
            refuse_other_expert_tp(arch, parallel, current.parallel)
            check_own_groups(arch, parallel)
            return own_placement(parallel)
    ensure_model_parallel(parallel)
    return Placement.current().with_model_options(parallel)
