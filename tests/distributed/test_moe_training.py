"""Training a mixture-of-experts model under expert-parallel layouts on real gloo process groups.

Qwen3-MoE (4 layers, layer 1 dense) with its load-balancing loss switched on
(``output_router_logits``): after ``train_step`` of the example RL update (actor and critic, as in
``test_training.py``) the gradients under HF names equal the single-process ones within 1e-5 at
EP2, CP2 (zigzag THD; unwrapped and wrapped in Megatron-Core's DDP), TP2 x EP2 (sequence parallel,
which Megatron-Core requires for MoE training under TP), PP2 x EP2 and CP2 x EP2. The
load-balancing loss is part of those gradients (without it the single-process gradients move by
far more than the tolerance; under CP each rank attaches its tokens' part, scaled by the schedule's
``cp / num_microbatches`` like the main loss), the per-layer values the routers report
(``mcore_zoo.routing.aux_losses``, summed over TP / CP ranks and pipeline stages) equal the
single-process ones, and so do the actor's ``packed_forward`` log-probs. Under EP2, routing
recorded in one step and replayed in the next, with every router perturbed in between, keeps the
recorded experts, and the replayed step's gradients (router included) equal the single-process
replayed step's. Under CP2 the routes each rank records, merged over the CP ranks
(``merge_context_parallel_routes``), are the single-process record; the single-process record
taken to each rank's zigzag order (``context_parallel_routes``) and replayed with perturbed
routers keeps exactly those experts per token, and the gradients equal the single-process
replayed step's. Under PP2 x EP2 each stage records the single-process routes of its own layers
and replaying those does the same.

The load-balancing loss is a mean per micro-batch and counts every routed token, so every run
splits the batch into the same two micro-batches and the sequence lengths are multiples of 4 (TP2
with sequence parallelism and CP2, alignment ``2 * cp``, pad nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo import routing
from mcore_zoo.distributed import launch
from mcore_zoo.distributed.forward import partition_by_tokens
from mcore_zoo.placement import Parallelism

from .test_training import TOL, _batch, _build, _max_diff, _update, _value_checkpoint

ARCH = "Qwen3MoeForCausalLM"
OVERRIDES = {"num_hidden_layers": 4, "mlp_only_layers": [1], "output_router_logits": True, "router_aux_loss_coef": 0.05}
LENGTHS = [24, 12, 40, 8, 20, 12]
STEP = {"num_microbatches": 2}
REPLAYABLE = {"overrides": {"moe_enable_routing_replay": True}}
# the sequences in the order train_step routes them: its micro-batches, each in ascending order
ROUTED = [LENGTHS[i] for group in partition_by_tokens(LENGTHS, None, STEP["num_microbatches"]) for i in group]
ALIGN_CP2 = 4


def _aux_losses() -> torch.Tensor:
    """Per layer, the load-balancing loss the routers reported since the last call (summed over
    micro-batches), summed over the tensor / context-parallel ranks (each reports its tokens' part)
    and the pipeline stages (each reports its own layers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    values = routing.aux_losses()["load_balancing_loss"].clone()
    dist.all_reduce(values, group=ps.get_tensor_and_context_parallel_group())
    dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    return values


def _perturb_routers(model) -> None:
    """Add noise to every router, the same for a layer wherever it lives (seeded by its number)."""
    with torch.no_grad():
        for router in routing.moe_routers(model):
            gen = torch.Generator().manual_seed(int(router.layer_number))
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=gen).to(router.weight.dtype))


def _replayed_step(model, batch: dict, reference: dict | None = None) -> dict:
    """Record the routes of one actor update, perturb the routers, replay routes in the next
    update: the recorded ones, or the single-process record (``reference``: routes by layer number)
    of this stage's layers, in this CP rank's order. Its gradients, the recorded routes, whether
    every router kept the replayed experts, and whether the perturbed routers chose other experts
    on their own."""
    from megatron.core import parallel_state as ps

    with routing.record(model) as rec:
        _update(model, batch, False, **STEP)
    routes = rec.routes
    if reference is not None:
        routes = [reference[int(r.layer_number)] for r in routing.moe_routers(model)]
        rank, size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        if size > 1:
            routes = routing.context_parallel_routes(routes, ROUTED, align=ALIGN_CP2, cp_rank=rank, cp_size=size)
    _perturb_routers(model)
    routers = routing.moe_routers(model)
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, i, o, k=k: chosen[k].append(o[1].detach().clone()))
             for k, r in enumerate(routers)]  # fmt: skip
    try:
        _update(model, batch, False, **STEP)  # the perturbed routers on their own
        free = [torch.cat(maps) for maps in chosen]
        for maps in chosen:
            maps.clear()
        with routing.replay(model, routes):
            grads, _ = _update(model, batch, False, **STEP)
    finally:
        for h in hooks:
            h.remove()
    want = [torch.zeros_like(torch.cat(maps)).scatter(1, idx, True) for maps, idx in zip(chosen, routes)]
    return {
        "grads": grads,
        "routes": rec.routes,
        "layers": [int(r.layer_number) for r in routers],
        "replayed": routes,
        "kept": all(torch.equal(torch.cat(maps), w) for maps, w in zip(chosen, want)),
        "moved": any(not torch.equal(f, w) for f, w in zip(free, want)),
    }


def _steps(ckpt: str, value_ckpt: str, parallel: Parallelism, batch: dict, replay: bool,
           ddp: bool = False, reference: dict | None = None) -> dict:  # fmt: skip
    """The actor and critic updates at ``parallel`` (the running parallel state), the load-balancing
    losses of the actor's step, the actor's ``packed_forward`` log-probs, and with ``replay`` the
    recorded-then-replayed actor step; ``ddp``: the models wrapped in Megatron-Core's DDP."""
    r: dict = {}
    actor = _build(ckpt, parallel, critic=False, ddp=ddp, **REPLAYABLE)
    routing.aux_losses()  # a clean tracker
    r["actor"], r["actor_loss"] = _update(actor, batch, False, **STEP)
    r["aux"] = _aux_losses()
    with torch.no_grad():
        out = mcore_zoo.packed_forward(actor, batch["seqs"], return_logits=False, temperature=0.9)
    r["logprobs"] = out.logprobs
    routing.aux_losses()
    critic = _build(value_ckpt, parallel, critic=True, ddp=ddp)
    r["critic"], r["critic_loss"] = _update(critic, batch, True, **STEP)
    routing.aux_losses()
    if replay:
        r["replay"] = _replayed_step(actor, batch, reference if parallel.cp > 1 or parallel.pp > 1 else None)
    return r


def _run_layouts(ckpt: str, value_ckpt: str, layouts: list, reference: dict | None = None) -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel

    batch = _batch(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"], LENGTHS)
    found = {}
    for name, parallel, replay, *ddp in layouts:
        ensure_model_parallel(parallel)
        found[name] = _steps(ckpt, value_ckpt, parallel, batch, replay, *ddp, reference=reference)
        ps.destroy_model_parallel()
    return found


@pytest.fixture(scope="module")
def moe_checkpoints(reference_checkpoint, tmp_path_factory):
    ckpt = reference_checkpoint(ARCH, OVERRIDES)
    return ckpt, _value_checkpoint(ckpt, tmp_path_factory.mktemp("moe-critic"))


@pytest.fixture(scope="module")
def moe_reference(moe_checkpoints, mpu) -> dict:
    """The single-process steps; and the actor's gradients without the load-balancing loss."""
    ckpt, value_ckpt = moe_checkpoints
    batch = _batch(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"], LENGTHS)
    ref = _steps(str(ckpt), str(value_ckpt), Parallelism(), batch, replay=True)
    without = _build(str(ckpt), Parallelism(), critic=False, overrides={"moe_aux_loss_coeff": 0.0})
    ref["actor_without_aux"], _ = _update(without, batch, False, **STEP)
    return ref


def _check(found: list[dict], ref: dict) -> dict[str, float]:
    assert _max_diff(ref["actor_without_aux"], ref["actor"]) > 100 * TOL, "the load-balancing loss moved no gradient"
    assert (ref["aux"] > 0).sum() == 3, ref["aux"]  # the three MoE layers
    assert ref["replay"]["kept"] and ref["replay"]["moved"], "single process: replay"
    worst: dict[str, float] = {}
    for name in found[0]:
        for rank, ranks in enumerate(found):
            r, where = ranks[name], f"{name} rank {rank}"
            actor = _max_diff(r["actor"], ref["actor"])
            critic = _max_diff(r["critic"], ref["critic"])
            assert actor <= TOL, f"{where}: actor gradients differ by {actor}"
            assert critic <= TOL, f"{where}: critic gradients differ by {critic}"
            assert abs(r["actor_loss"] - ref["actor_loss"]) <= TOL, where
            assert abs(r["critic_loss"] - ref["critic_loss"]) <= TOL, where
            logprobs = max((a - b).abs().max().item() for a, b in zip(r["logprobs"], ref["logprobs"]))
            assert logprobs <= TOL, f"{where}: packed_forward log-probs differ by {logprobs}"
            aux = (r["aux"] - ref["aux"]).abs().max().item()
            assert aux <= TOL, f"{where}: load-balancing losses {r['aux'].tolist()} vs {ref['aux'].tolist()}"
            if "replay" in r:
                replay = r["replay"]
                assert replay["kept"], f"{where}: the replayed step did not keep the recorded experts"
                assert replay["moved"], f"{where}: the perturbed routers chose the recorded experts anyway"
                diff = _max_diff(replay["grads"], ref["replay"]["grads"])
                assert diff <= TOL, f"{where}: replayed-step gradients differ by {diff}"
                router = [k for k in replay["grads"] if k.endswith("mlp.gate.weight")]
                assert router and all(replay["grads"][k].abs().sum() > 0 for k in router), f"{where}: router gradients"
            worst[name] = max(worst.get(name, 0.0), actor, critic)
            worst[name + " logprobs"] = max(worst.get(name + " logprobs", 0.0), logprobs)
    return worst


@pytest.mark.slow
def test_two_ranks_ep2_cp2(moe_checkpoints, moe_reference):
    """EP2 (two data-parallel replicas sharing the experts), with routing replay; CP2 unwrapped (with
    the single-process record replayed in each rank's zigzag order) and wrapped in DDP (the
    load-balancing loss's gradient summed over the CP ranks' parts)."""
    ckpt, value_ckpt = moe_checkpoints
    reference = dict(zip(moe_reference["replay"]["layers"], moe_reference["replay"]["routes"]))
    layouts = [("ep2", Parallelism(ep=2), True), ("cp2", Parallelism(cp=2), True),
               ("cp2-ddp", Parallelism(cp=2), False, True)]  # fmt: skip
    found = launch(_run_layouts, 2, str(ckpt), str(value_ckpt), layouts, reference)
    print("max |dgrad| vs the single-process update:", _check(found, moe_reference))
    _check_context_parallel_routes([ranks["cp2"]["replay"] for ranks in found], moe_reference["replay"]["routes"])


def _check_context_parallel_routes(ranks: list[dict], reference: list[torch.Tensor]) -> None:
    """The CP2 ranks' records merged are the single-process record (and unpack per sequence to
    its routes); each rank replayed its zigzag share, which a plain split of the pack is not."""
    merged = routing.merge_context_parallel_routes([r["routes"] for r in ranks], ROUTED, align=ALIGN_CP2)
    assert all(torch.equal(m, ref) for m, ref in zip(merged, reference)), "CP2 record, merged, differs"
    per_sequence = routing.unpack_routes(merged, ROUTED, align=ALIGN_CP2)
    assert all(torch.equal(a, b) for a, b in zip(per_sequence, routing.unpack_routes(reference, ROUTED)))
    assert routing.pack_routes(per_sequence, align=ALIGN_CP2, cp_rank=1, cp_size=2)[0].equal(ranks[1]["replayed"][0])
    half = reference[0].shape[0] // 2
    for rank, r in enumerate(ranks):
        assert all(torch.equal(a, b) for a, b in zip(r["replayed"], r["routes"])), f"rank {rank}: replayed vs recorded"
        plain = [x[rank * half : (rank + 1) * half] for x in reference]
        assert any(not torch.equal(a, b) for a, b in zip(plain, r["replayed"])), "a plain split gives the same routes"


@pytest.mark.slow
def test_four_ranks_tp2ep2_pp2ep2_cp2ep2(moe_checkpoints, moe_reference):
    """TP2 x EP2 with sequence parallel, PP2 x EP2 (each stage replaying the single-process
    record of its own layers), CP2 x EP2 (the experts see both CP shares of both replicas)."""
    ckpt, value_ckpt = moe_checkpoints
    reference = dict(zip(moe_reference["replay"]["layers"], moe_reference["replay"]["routes"]))
    layouts = [("tp2ep2sp", Parallelism(tp=2, ep=2, sequence_parallel=True), False),
               ("pp2ep2", Parallelism(pp=2, ep=2), True),
               ("cp2ep2", Parallelism(cp=2, ep=2), False)]  # fmt: skip
    found = launch(_run_layouts, 4, str(ckpt), str(value_ckpt), layouts, reference)
    print("max |dgrad| vs the single-process update:", _check(found, moe_reference))
    for rank, ranks in enumerate(found):  # PP2: every stage recorded the single-process routes of its layers
        replay = ranks["pp2ep2"]["replay"]
        assert replay["layers"] and all(torch.equal(a, reference[n]) for a, n in zip(replay["routes"], replay["layers"])), rank
