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
single-process ones, and so do the actor's ``packed_forward`` log-probs.

Routing replay: every router is perturbed between the step that records the routes and the step
that replays them; the replayed step keeps the experts it is given per token (while the perturbed
routers on their own choose others), and its gradients (router included) equal the single-process
replayed step's. Under EP2 each rank replays its own record (``routing.replay``). Under CP2,
TP2 x EP2 with sequence parallel and PP2 x EP2 every rank is given the single-process record per
sequence (``train_step(replay_routes=)``, two micro-batches) and the step lays it out itself: each
CP rank its zigzag share, each TP rank its sequence-parallel slice of each micro-batch, each stage
its own layers - the rows each rank's routers chose themselves before the perturbation. Replaying
instead each TP rank's slice of the whole step's pack (what ``pack_routes`` of all sequences
gives) moves the gradients far off. Under CP2 the routes each rank records, merged over the CP
ranks (``merge_context_parallel_routes``), are the single-process record; under PP2 x EP2 each
stage records the single-process routes of its own layers.

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
# train_step's micro-batches (partition_by_tokens), each listing its sequences in ascending order:
# the order the step routes them (a single-process record holds them in that order)
GROUPS = partition_by_tokens(LENGTHS, None, STEP["num_microbatches"])
ORDER = [i for group in GROUPS for i in group]
ROUTED = [LENGTHS[i] for i in ORDER]
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


def _per_sequence(routes: list[torch.Tensor]) -> list[torch.Tensor]:
    """A single-process record of a step (per MoE layer, the sequences in ``ORDER``) -> per sequence
    of the batch ``[moe_layers, len, top_k]``, as a rollout engine reports routes."""
    unpacked = routing.unpack_routes(routes, ROUTED)
    per_sequence = [torch.empty(0)] * len(LENGTHS)
    for i, r in zip(ORDER, unpacked):
        per_sequence[i] = r
    return per_sequence


def _rank_routes(model, per_sequence: list[torch.Tensor], groups: list[list[int]]) -> list[torch.Tensor]:
    """The rows this rank's routers route when ``groups`` are packed one after the other: per pack,
    ``pack_routes`` of its sequences (this CP rank's share, this TP rank's sequence-parallel slice)
    of this stage's layers."""
    from megatron.core import parallel_state as ps

    from mcore_zoo.packing import alignment_for

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    numbers = routing.moe_layer_numbers(model)
    layers = [numbers.index(int(r.layer_number)) for r in routing.moe_routers(model)]
    packs = [routing.pack_routes([per_sequence[i][layers] for i in group], align=alignment_for(tp, cp, tp > 1),
                                 rank=ps.get_tensor_model_parallel_rank(), size=tp,
                                 cp_rank=ps.get_context_parallel_rank(), cp_size=cp)
             for group in groups]  # fmt: skip
    return [torch.cat(layer) for layer in zip(*packs)]


def _replayed_step(model, batch: dict, per_sequence: list[torch.Tensor] | None = None,
                   whole_pack: bool = False) -> dict:  # fmt: skip
    """Record the routes of one actor update, perturb the routers, replay routes in the next
    update: the recorded ones (``routing.replay``), or the single-process record per sequence
    (``per_sequence``: ``train_step(replay_routes=)``). Its gradients, the recorded routes, the
    rows this rank's routers were to replay, whether every router kept those experts, and whether
    the perturbed routers chose other experts on their own. ``whole_pack``: also the gradients of
    a step replaying this rank's slice of the whole step's pack (``pack_routes`` of all its
    sequences at once: under sequence parallelism with several micro-batches, other tokens'
    routes)."""
    with routing.record(model) as rec:
        _update(model, batch, False, **STEP)
    routes = rec.routes if per_sequence is None else _rank_routes(model, per_sequence, GROUPS)
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
        if per_sequence is None:
            with routing.replay(model, routes):
                grads, _ = _update(model, batch, False, **STEP)
        else:
            grads, _ = _update(model, batch, False, replay_routes=per_sequence, **STEP)
    finally:
        for h in hooks:
            h.remove()
    want = [torch.zeros_like(torch.cat(maps)).scatter(1, idx, True) for maps, idx in zip(chosen, routes)]
    found = {
        "grads": grads,
        "routes": rec.routes,
        "layers": [int(r.layer_number) for r in routers],
        "replayed": routes,
        "kept": all(torch.equal(torch.cat(maps), w) for maps, w in zip(chosen, want)),
        "moved": any(not torch.equal(f, w) for f, w in zip(free, want)),
    }
    if whole_pack:
        with routing.replay(model, _rank_routes(model, per_sequence, [ORDER])):
            found["whole_pack"], _ = _update(model, batch, False, **STEP)
    return found


def _steps(ckpt: str, value_ckpt: str, parallel: Parallelism, batch: dict, replay: str | None,
           ddp: bool = False, reference: list[torch.Tensor] | None = None) -> dict:  # fmt: skip
    """The actor and critic updates at ``parallel`` (the running parallel state), the load-balancing
    losses of the actor's step, the actor's ``packed_forward`` log-probs, and with ``replay`` the
    recorded-then-replayed actor step (``"recorded"``: this rank's record; ``"reference"``: the
    single-process record per sequence, ``reference``; ``"reference+whole-pack"``: and the old
    whole-pack slicing); ``ddp``: the models wrapped in Megatron-Core's DDP."""
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
        per_sequence = None if replay == "recorded" else reference
        r["replay"] = _replayed_step(actor, batch, per_sequence, whole_pack=replay.endswith("whole-pack"))
    return r


def _run_layouts(ckpt: str, value_ckpt: str, layouts: list, reference: list[torch.Tensor] | None = None) -> dict:
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
    ref = _steps(str(ckpt), str(value_ckpt), Parallelism(), batch, replay="recorded")
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
                # the rows replayed from the single-process routes are the ones this rank's routers
                # chose themselves before the perturbation
                assert all(torch.equal(a, b) for a, b in zip(replay["replayed"], replay["routes"])), where
                if "whole_pack" in replay:  # this rank's slice of the whole step's pack: other tokens' experts
                    off = _max_diff(replay["whole_pack"], ref["replay"]["grads"])
                    assert off > 100 * TOL, f"{where}: replaying a slice of the whole pack went unnoticed ({off})"
                    worst[name + " whole-pack slicing"] = max(worst.get(name + " whole-pack slicing", 0.0), off)
                worst[name + " replay"] = max(worst.get(name + " replay", 0.0), diff)
            worst[name] = max(worst.get(name, 0.0), actor, critic)
            worst[name + " logprobs"] = max(worst.get(name + " logprobs", 0.0), logprobs)
    return worst


@pytest.mark.slow
def test_two_ranks_ep2_cp2(moe_checkpoints, moe_reference):
    """EP2 (two data-parallel replicas sharing the experts), with routing replay of each rank's own
    record; CP2 unwrapped (the single-process record replayed per sequence through
    ``train_step(replay_routes=)``, each rank routing its zigzag share) and wrapped in DDP (the
    load-balancing loss's gradient summed over the CP ranks' parts)."""
    ckpt, value_ckpt = moe_checkpoints
    reference = _per_sequence(moe_reference["replay"]["routes"])
    layouts = [("ep2", Parallelism(ep=2), "recorded"), ("cp2", Parallelism(cp=2), "reference"),
               ("cp2-ddp", Parallelism(cp=2), None, True)]  # fmt: skip
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
    """TP2 x EP2 with sequence parallel, PP2 x EP2, CP2 x EP2 (the experts see both CP shares of
    both replicas). Under TP2 x EP2 and PP2 x EP2 the single-process record is replayed per
    sequence through ``train_step(replay_routes=)``: each TP rank routes its sequence-parallel
    slice of each of the two micro-batches, each stage its own layers. Replaying instead each TP
    rank's slice of the whole step's pack (what ``pack_routes`` gave before) moves the gradients
    far off."""
    ckpt, value_ckpt = moe_checkpoints
    layers, routes = moe_reference["replay"]["layers"], moe_reference["replay"]["routes"]
    layouts = [("tp2ep2sp", Parallelism(tp=2, ep=2, sequence_parallel=True), "reference+whole-pack"),
               ("pp2ep2", Parallelism(pp=2, ep=2), "reference"),
               ("cp2ep2", Parallelism(cp=2, ep=2), None)]  # fmt: skip
    found = launch(_run_layouts, 4, str(ckpt), str(value_ckpt), layouts, _per_sequence(routes))
    print("max |dgrad| vs the single-process update:", _check(found, moe_reference))
    by_layer = dict(zip(layers, routes))
    for rank, ranks in enumerate(found):  # PP2: every stage recorded the single-process routes of its layers
        replay = ranks["pp2ep2"]["replay"]
        recorded = zip(replay["routes"], replay["layers"])
        assert replay["layers"] and all(torch.equal(a, by_layer[n]) for a, n in recorded), rank
    for rank, ranks in enumerate(found):  # TP2: each rank routed half of each micro-batch
        replay = ranks["tp2ep2sp"]["replay"]
        assert replay["replayed"][0].shape[0] * 2 == routes[0].shape[0], rank
