"""Where a model sits in the job: the requested parallel sizes and this rank's place in them.

Two values, computed once:

* :class:`Parallelism` - the layout a user asks for (sizes only: ``tp``, ``pp``, ``vpp``, ``cp``,
  ``ep``, ``etp``, sequence parallel). Pure data: it can be validated against an architecture
  before any process group exists (defined in :mod:`mcore_zoo.config.parallelism`, with the rest
  of what a build asks for; importable from here).
* :class:`Placement` - the layout in effect for this process: the sizes, this rank's coordinate in
  every group and the process groups themselves. :meth:`Placement.current` reads Megatron-Core's
  ``parallel_state`` once (or describes a single process when it is not initialised); a model at
  another layout than that state gets a placement on groups of its own
  (:func:`mcore_zoo.model_groups.own_placement`, :attr:`Placement.pg_collection`); a built model
  carries its placement in its handle (:mod:`mcore_zoo.handle`), and every operation (load, export,
  forward, checkpoints) reads ranks and groups from there.

This is the only module that asks "which rank am I" or "how many ranks are there" - of
Megatron-Core's ``parallel_state``, of ``torch.distributed`` (:func:`process_rank`,
:func:`process_count`, :func:`group_rank`, :func:`group_size`) and of an inference engine's
workers (:func:`vllm_tp_rank`); ``tests/unit/test_architecture.py`` checks it. It imports
Megatron-Core lazily, so it can be imported by light modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .config.parallelism import Parallelism
from .errors import LayoutError


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one placement (``None`` where the group has one member or none exists)."""

    tp: Any = None
    pp: Any = None
    cp: Any = None
    dp_cp: Any = None  # data parallel with context parallel: ranks holding identical dense weights
    ep: Any = None
    etp: Any = None  # expert tensor parallel: the split of each expert's FFN
    expert_dp: Any = None  # ranks holding identical expert weights
    model_parallel: Any = None  # TP x PP (x CP): one model replica
    embedding: Any = None  # first and last pipeline stage: tied embedding copies (PP > 1)
    # every rank holding part of the model, for a model on groups of its own (None: the job's
    # default group)
    every: Any = None
    # Megatron-Core's ProcessGroupCollection of a model built on its own groups
    # (mcore_zoo.model_groups); None: the model uses parallel_state's groups
    collection: Any = None


@dataclass(frozen=True)
class Placement:
    """This process's place in the parallel layout of a model.

    Attributes:
        parallel: the sizes (:class:`Parallelism`).
        rank, world_size: global rank and size (0 / 1 without ``torch.distributed``).
        tp_rank, pp_rank, cp_rank, ep_rank, etp_rank, dp_rank: coordinates in each group.
        groups: the process groups (not compared; ``None`` for a single process).
        ranks: the job's global ranks the model is placed on, when that is a subset of the job
            (``build_model(..., ranks=...)``); ``None``: every rank of the job. ``world_size`` is
            then the number of those ranks, and a rank outside them holds no part of the model
            (:attr:`holds_model`; its coordinates are 0 and it has no groups).
    """

    parallel: Parallelism = Parallelism()
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    dp_rank: int = 0
    groups: ProcessGroups = field(default_factory=ProcessGroups, compare=False, repr=False)
    ranks: Optional[tuple[int, ...]] = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls, parallel: Optional[Parallelism] = None) -> "Placement":
        """One process holding the whole model (no process groups needed)."""
        return cls(parallel or Parallelism())

    @classmethod
    def current(cls) -> "Placement":
        """The placement of the initialised Megatron parallel state (single process if none)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls.single()
        import torch.distributed as dist

        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        parallel = Parallelism(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            vpp=vpp if vpp and vpp > 1 else None,
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
        )
        groups = ProcessGroups(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            expert_dp=ps.get_expert_data_parallel_group(),
            model_parallel=ps.get_model_parallel_group(),
            embedding=ps.get_embedding_group(check_initialized=False),
        )
        return cls(
            parallel=parallel,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            groups=groups,
        )

    def with_model_options(self, parallel: Parallelism) -> "Placement":
        """This placement with the model-only options of ``parallel`` (sequence parallel) applied;
        the sizes must agree."""
        self.check_sizes(parallel, what="requested")
        return dataclasses.replace(self, parallel=parallel)

    # ------------------------------------------------------------------ checks
    def check_sizes(self, parallel: Parallelism, *, what: str = "model built for") -> None:
        """Raise :class:`LayoutError` listing every size on which ``parallel`` and this placement
        disagree (``vpp`` compared as chunks per stage)."""
        mine = self.parallel
        wrong = [
            f"{name}: {what} {getattr(parallel, name)}, parallel state has {getattr(mine, name)}"
            for name in ("tp", "pp", "cp", "ep")
            if getattr(parallel, name) != getattr(mine, name)
        ]
        if parallel.chunks_per_stage != mine.chunks_per_stage:
            wrong.append(f"vpp: {what} {parallel.vpp}, parallel state has {mine.vpp}")
        if (parallel.etp or parallel.tp) != (mine.etp or mine.tp):  # None: the expert split follows tp
            wrong.append(f"etp: {what} {parallel.etp or parallel.tp}, parallel state has {mine.etp or mine.tp}")
        if wrong:
            raise LayoutError("model and parallel state disagree:\n" + "\n".join(f"  - {w}" for w in wrong))

    def check_holds_model(self, what: str = "the model") -> None:
        """Raise :class:`~mcore_zoo.errors.NotOnThisRankError` when this rank is outside the ranks
        the model is placed on (:attr:`holds_model`); ``what`` names the model in the message."""
        if not self.holds_model:
            from .errors import NotOnThisRankError

            raise NotOnThisRankError(f"{what} is placed on ranks {list(self.ranks or ())} of the job; rank {self.rank}"
                                     " holds no part of it. Run its forward, training step, load and export on"
                                     " those ranks only (copy_weights into it runs on every rank)")  # fmt: skip

    def check_still_current(self) -> None:
        """Raise :class:`LayoutError` when the running parallel state is not the one this placement
        was taken from (a model built for TP 1 used under a TP 2 state, say). A placement on its own
        groups (:attr:`own_groups`) depends on no parallel state: nothing to check."""
        if not self.own_groups:
            Placement.current().check_sizes(self.parallel)

    # ------------------------------------------------------------------ own groups
    @property
    def own_groups(self) -> bool:
        """Whether the model has process groups of its own (:mod:`mcore_zoo.model_groups`) rather
        than Megatron-Core's ``parallel_state``."""
        return self.groups.collection is not None

    @property
    def pg_collection(self) -> Any:
        """The ``ProcessGroupCollection`` to hand Megatron-Core (``pg_collection=``) for a model on
        its own groups; ``None`` for a model on ``parallel_state`` (Megatron-Core's default)."""
        return self.groups.collection

    @property
    def holds_model(self) -> bool:
        """Whether this rank holds part of the model (every rank does unless the model is placed
        on a subset of the job's ranks, :attr:`ranks`)."""
        return self.ranks is None or self.rank in self.ranks

    # ------------------------------------------------------------------ shortcuts
    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def cp(self) -> int:
        return self.parallel.cp

    @property
    def ep(self) -> int:
        return self.parallel.ep

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size (``tp`` unless set)."""
        return self.parallel.etp or self.parallel.tp

    @property
    def vpp(self) -> int:
        """Virtual-pipeline chunks per stage (1 without interleaving)."""
        return self.parallel.chunks_per_stage

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def distributed(self) -> bool:
        """More than one process in the job."""
        return self.world_size > 1


# ---------------------------------------------------------------------- rank queries
def process_rank() -> int:
    """This process's global rank (0 when ``torch.distributed`` is not initialised)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def process_count() -> int:
    """The number of processes in the job (1 when ``torch.distributed`` is not initialised)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def group_size(group: Any) -> int:
    """The number of ranks in process group ``group`` (``None``: the default group)."""
    import torch.distributed as dist

    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in process group ``group`` (``None``: the default group)."""
    import torch.distributed as dist

    return dist.get_rank(group)


def vllm_tp_rank() -> int:
    """The tensor-parallel rank of this vLLM worker (asked inside a worker process)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().rank_in_group


__all__ = [
    "Parallelism", "Placement", "ProcessGroups", "group_rank", "group_size", "process_count", "process_rank", "vllm_tp_rank",
]
