"""A model's own process groups: several models at several parallel layouts in one job.

Megatron-Core keeps one set of parallel groups per process (``parallel_state``). A model whose
layout differs from that set - the reference at TP1 x DP4 beside an actor at TP2 x PP2 - is built
on groups of its own instead, handed to Megatron-Core as a ``ProcessGroupCollection``
(``pg_collection=``, which ``GPTModel``, its layers, the pipeline schedules, the DDP wrapper,
``finalize_model_grads`` and ``get_megatron_optimizer`` take). Nothing in ``parallel_state`` is
created or changed for it, so the models built on it keep working as they were.

:func:`own_placement` lays a layout out over the job's ranks in Megatron-Core's default order
(tensor, context, data, pipeline: consecutive ranks share a tensor-parallel group) and creates the
groups once per layout; models at the same layout share them. Every rank of the job calls it, in
the same order (``torch.distributed.new_group`` is collective over the whole job), which building
models in the same order on every rank gives.

A model may also be placed on part of the job - a reward model on 2 of 8 ranks
(``build_model(..., ranks=[6, 7])``): its layout is laid out over those ranks only, in the same
order, and a rank outside them holds no part of it (:attr:`~mcore_zoo.placement.Placement.holds_model`;
``build_model`` returns a :class:`~mcore_zoo.handle.ModelOnOtherRanks` there, on which operations
raise :class:`~mcore_zoo.errors.NotOnThisRankError`).

What Megatron-Core 0.16 still reads from ``parallel_state`` inside a model, and which the zoo
therefore refuses on own groups (:func:`check_own_groups`, :data:`GLOBAL_READERS`): MoE layers,
multi-token prediction, expert parallelism, and distributed checkpoints.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional, Sequence

from .config.parallelism import Parallelism
from .errors import LayoutError, UnsupportedLayoutError
from .placement import Placement, ProcessGroups, process_count, process_rank

#: What a model on its own groups cannot have, with the Megatron-Core module that reads the
#: process-wide parallel state instead of the model's groups.
GLOBAL_READERS: dict[str, str] = {
    "moe": "megatron.core.transformer.moe.moe_utils (the expert-bias token counts and the aux-loss"
           " tracking reduce over parallel_state's tensor-and-data-parallel, pipeline and data groups)",
    "mtp": "megatron.core.transformer.multi_token_prediction (reads parallel_state's pipeline rank and"
           " stage to place the MTP block)",
    "ep": "expert parallelism (the zoo lays out dense groups only; expert groups follow the dense ones)",
    "dist_checkpoint": "megatron.core.transformer.utils.make_sharded_tensors_for_checkpoint and"
                       " LanguageModule.sharded_state_dict (replica ids from parallel_state's ranks)",
}  # fmt: skip

_LOCK = threading.Lock()
#: the groups made so far, by (tp, pp, cp, world size, default group): process-wide, shared by every
#: model at one layout
_MADE: dict[tuple[int, ...], tuple[ProcessGroups, dict[str, int]]] = {}


def check_own_groups(arch: Any, parallel: Parallelism, ranks: Optional[Sequence[int]] = None) -> None:
    """Raise :class:`~mcore_zoo.errors.UnsupportedLayoutError` when a model of ``arch`` at
    ``parallel`` (placed on ``ranks`` of the job, default all) needs something Megatron-Core reads
    from ``parallel_state`` (:data:`GLOBAL_READERS`)."""
    name = getattr(arch, "architecture", "this model")
    why = "differs from the job's parallel state" if ranks is None else f"is placed on ranks {list(ranks)} of the job"
    wanted = [("moe", getattr(arch, "moe", None) is not None), ("mtp", bool(getattr(arch, "mtp_num_layers", 0))),
              ("ep", parallel.ep > 1 or (parallel.etp or parallel.tp) != parallel.tp)]  # fmt: skip
    for key, needed in wanted:
        if needed:
            raise UnsupportedLayoutError(
                f"{name} at {_describe(parallel)} {why}, so it would be built on its"
                f" own process groups; that needs {GLOBAL_READERS[key]} to take the model's groups. Build it at the"
                " parallel state's layout on every rank, or in a job of its own"
            )


def refuse_other_expert_tp(arch: Any, parallel: Parallelism, state: Parallelism) -> None:
    """Raise :class:`~mcore_zoo.errors.UnsupportedLayoutError` when ``parallel`` and the job's
    parallel state ``state`` differ in the expert tensor-parallel size only (gpt-oss's experts with
    biases are built at ``etp=1``, a state made for ``Parallelism(tp=2)`` has ``etp=2``): Megatron-Core
    builds the experts on the state's expert groups, and own groups carry no MoE layers, so the state
    itself must have the model's expert split."""
    same = all(getattr(parallel, k) == getattr(state, k) for k in ("tp", "pp", "cp", "ep", "chunks_per_stage"))
    want, have = parallel.etp or parallel.tp, state.etp or state.tp
    if not same or want == have or getattr(arch, "moe", None) is None:
        return
    name = getattr(arch, "architecture", "this model")
    why = (" (its experts carry biases, which Megatron-Core builds at expert tensor-parallel size 1 only)"
           if getattr(arch, "mlp_bias", False) and want == 1 else "")  # fmt: skip
    raise UnsupportedLayoutError(
        f"{name}: the model's experts are split over expert tensor-parallel size etp={want}{why}, the job's parallel"
        f" state over etp={have}. Megatron-Core builds the experts on the parallel state's expert groups (a model's"
        f" own groups carry no MoE layers): create the parallel state with etp={want}, e.g."
        f" mcore_zoo.ensure_model_parallel(Parallelism(tp={parallel.tp}, pp={parallel.pp}, ep={parallel.ep},"
        f" etp={want}))"
    )


def refuse_own_groups(placement: Placement, operation: str, key: str) -> None:
    """Raise :class:`~mcore_zoo.errors.UnsupportedLayoutError` when ``placement`` is a model's own
    groups and ``operation`` runs through a Megatron-Core module that reads ``parallel_state``."""
    if placement.own_groups:
        raise UnsupportedLayoutError(f"{operation}: the model is built on its own process groups"
                                     f" ({_describe(placement.parallel)}); {GLOBAL_READERS[key]} read the job's"
                                     " parallel state instead")  # fmt: skip


def refuse_part_of_job(placement: Placement, operation: str) -> None:
    """Raise :class:`~mcore_zoo.errors.UnsupportedLayoutError` when ``placement`` is a model placed
    on part of the job's ranks and ``operation`` agrees over every rank of the job (the default
    process group), which the ranks outside the model would not join."""
    if placement.ranks is not None:
        raise UnsupportedLayoutError(f"{operation}: the model is placed on ranks {list(placement.ranks)} of the job, and"
                                     f" {operation} agrees over every rank of the job; copy its weights into a model"
                                     " on every rank first (copy_weights), or save it (save_hf_checkpoint)")  # fmt: skip


def _describe(parallel: Parallelism) -> str:
    return " x ".join(f"{k.upper()}{getattr(parallel, k)}" for k in ("tp", "pp", "cp") if getattr(parallel, k) > 1) or "TP1"


def own_placement(parallel: Parallelism, ranks: Optional[Sequence[int]] = None) -> Placement:
    """This rank's :class:`Placement` for a model at ``parallel`` on the model's own process groups
    (made on the first call for the layout; every rank of the job calls it). ``ranks``: the job's
    global ranks the model is placed on (default: all of them); the data-parallel size is what
    they leave, ``len(ranks) / (tp * pp * cp)``. On a rank outside ``ranks`` the placement holds
    no part of the model (:attr:`Placement.holds_model`)."""
    world = process_count()
    members = tuple(range(world)) if ranks is None else model_ranks(ranks, world)
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if len(members) % model_parallel:
        where = "world size" if ranks is None else f"the {len(members)} ranks {list(members)}:"
        raise LayoutError(f"{where} {len(members)} is not divisible by tp*pp*cp = {parallel.tp}*{parallel.pp}*{parallel.cp}")
    import torch.distributed as dist

    key = (parallel.tp, parallel.pp, parallel.cp, members, id(dist.group.WORLD))  # a re-initialised job: new groups
    with _LOCK:
        if key not in _MADE:
            _MADE[key] = _make_groups(parallel.tp, parallel.pp, parallel.cp, members)
    groups, coords = _MADE[key]
    subset = None if len(members) == world else members
    return Placement(parallel=parallel, rank=process_rank(), world_size=len(members), groups=groups, ranks=subset,
                     **coords)  # fmt: skip


def model_ranks(ranks: Sequence[int], world: int) -> tuple[int, ...]:
    """``ranks`` as the sorted global ranks of a model placed on part of a job of ``world`` ranks;
    a :class:`~mcore_zoo.errors.LayoutError` for a rank outside the job, a repeated one or none."""
    members = tuple(sorted(int(r) for r in ranks))
    wrong = [r for r in members if not 0 <= r < world]
    if not members or wrong or len(set(members)) != len(members):
        raise LayoutError(f"ranks={list(ranks)}: give distinct ranks of the job (0 .. {world - 1})")
    return members


def _make_groups(tp: int, pp: int, cp: int, members: tuple[int, ...]) -> tuple[ProcessGroups, dict[str, int]]:
    """Every group of the layout over ``members`` (the job's ranks the model is placed on; each
    rank of the job creates all of them, in one order) and this rank's coordinates. The model's
    ``i``-th rank sits at ``i = t + tp * (c + cp * (d + dp * p))``. One distributed-optimizer
    instance spans the model's ranks (``intra_dist_opt``: the gradient norm is reduced over it). A
    rank outside ``members`` gets no groups and zero coordinates."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    dp = len(members) // (tp * pp * cp)
    sizes = {"t": tp, "c": cp, "d": dp, "p": pp}

    def rank_of(t: int, c: int, d: int, p: int) -> int:
        return members[t + tp * (c + cp * (d + dp * p))]

    me = process_rank()
    index = members.index(me) if me in members else 0
    mine = {"t": index % tp, "c": index // tp % cp, "d": index // (tp * cp) % dp, "p": index // (tp * cp * dp)}

    def group(varying: str, ranks_of: Any = None) -> Any:
        """The group of the ranks that differ from this one only in the ``varying`` axes; every
        such group of the job is created (``new_group`` is collective), this rank's returned."""
        fixed = [a for a in "tcdp" if a not in varying]
        found = None
        for values in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, values))
            ranks = sorted(rank_of(**base, **dict(zip(varying, v)))
                           for v in itertools.product(*(range(sizes[a]) for a in varying)))  # fmt: skip
            if ranks_of is not None:
                ranks = ranks_of(ranks)
            made = dist.new_group(ranks)
            if me in ranks:
                found = made
        return found

    def stage_ends(ranks: list[int]) -> list[int]:
        return ranks if len(ranks) == 1 else [ranks[0], ranks[-1]]

    tp_g, cp_g, dp_g, pp_g = group("t"), group("c"), group("d"), group("p")
    dp_cp, tp_cp, mp, every = group("cd"), group("tc"), group("tp"), group("tcdp")
    embedding, position = group("p", stage_ends), group("p", lambda ranks: ranks[:1])
    single = _singletons(members, me)
    if me not in members:
        return ProcessGroups(), {}
    collection = ProcessGroupCollection(
        tp=tp_g, pp=pp_g, mp=mp, embd=embedding, pos_embd=position, cp=cp_g, tp_cp=tp_cp, hcp=None,
        ep=single, expt_tp=tp_g, tp_ep=tp_g, tp_ep_pp=mp, tp_dp_cp=None, dp=dp_g, dp_cp=dp_cp,
        expt_dp=dp_cp, intra_dp_cp=dp_cp, intra_expt_dp=dp_cp, inter_dist_opt=None, intra_dist_opt=every,
    )  # fmt: skip
    first_or_last = mine["p"] in (0, pp - 1)
    groups = ProcessGroups(tp=tp_g, pp=pp_g, cp=cp_g, dp_cp=dp_cp, ep=single, etp=tp_g, expert_dp=dp_cp,
                           model_parallel=mp, embedding=embedding if first_or_last else None, every=every,
                           collection=collection)  # fmt: skip
    coords = {"tp_rank": mine["t"], "pp_rank": mine["p"], "cp_rank": mine["c"], "ep_rank": 0, "etp_rank": mine["t"],
              "dp_rank": mine["c"] + cp * mine["d"]}  # fmt: skip
    return groups, coords


def _singletons(members: tuple[int, ...], me: int) -> Any:
    """One group per rank of the model (the expert-parallel group of a layout without expert
    parallelism); this rank's."""
    import torch.distributed as dist

    found = None
    for r in members:
        made = dist.new_group([r])
        if r == me:
            found = made
    return found


__all__ = ["GLOBAL_READERS", "check_own_groups", "model_ranks", "own_placement", "refuse_own_groups", "refuse_part_of_job"]
