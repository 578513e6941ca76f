"""Several models at several parallel layouts in one job, as an RL trainer holds them: on a
4-rank gloo job, the actor at TP2 x PP2 (the job's parallel state), the reference at TP1 x DP4
and the critic (value head) at PP2 x DP2, each on process groups of its own
(:mod:`mcore_zoo.model_groups`). Each model's log-probs / values equal the same model's in one
process within 1e-5, each model's gradients after ``train_step`` within 3e-6 (the example RL
update of ``examples/rl_step.py``), the reference's export is its checkpoint bit for bit, and the
actor's log-probs are the same bits before and after the other two models were built and run,
and the actor's weights copied into the reference (``copy_weights``, small buckets) arrive bit for
bit. With Megatron-Core's DDP wrapper and distributed optimizer on each model's groups
(:func:`mcore_zoo.distributed.optimizer.wrap_for_training`), the clipped gradient norm and the
updated weights equal one process's. Models placed on part of the job (``build_model(...,
ranks=...)``: a policy copy at TP2 on two of the four ranks, a reward model at DP2 on the other
two) match one process where they are held and are refused by name elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import UnsupportedLayoutError
from mcore_zoo.placement import Parallelism
from mcore_zoo.testing.common import load_safetensors_dir

from ..conftest import SharedLaunch
from .test_training import _batch, _update, _value_checkpoint

NUMERICS = "hf-exact"
FORWARD_TOL = 1e-5
GRAD_TOL = 3e-6

#: (name, layout, value head): the actor first (its layout becomes the job's parallel state)
MODELS = [
    ("actor", Parallelism(tp=2, pp=2), False),
    ("reference", Parallelism(), False),
    ("critic", Parallelism(pp=2), True),
]


def _build(ckpt: str, parallel: Parallelism, critic: bool, **kw):
    kw = {**kw, "head": "value"} if critic else kw
    return mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel, load=ckpt, **kw)


def _forward(model, batch: dict, critic: bool) -> list[torch.Tensor]:
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, batch["seqs"], return_logits=False)
    return [t.clone() for t in (out.values if critic else out.logprobs)]


def _run_models(ckpt: str, value_ckpt: str) -> dict:
    """Every model built, run and trained in this process (the job's ranks, or one process)."""
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    models, found = {}, {}
    for name, parallel, critic in MODELS:
        models[name] = _build(value_ckpt if critic else ckpt, parallel, critic)
        found[name] = {"forward": _forward(models[name], batch, critic)}
    for name, parallel, critic in MODELS:
        found[name]["own_groups"] = mcore_zoo.handle_of(models[name]).placement.own_groups
        found[name]["grads"], found[name]["loss"] = _update(models[name], batch, critic)
    found["actor"]["forward_after"] = _forward(models["actor"], batch, False)
    found["reference"]["export"] = {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(models["reference"])}
    found["copy"] = _copy_actor_into_reference(models["actor"], models["reference"])
    return found


def _copy_actor_into_reference(actor, reference) -> dict:
    """The actor moved off its checkpoint (a step along its gradients), then copied into the
    reference at its other layout in small buckets: the reference exports the actor's bits."""
    from mcore_zoo.distributed.copy import copy_weights

    with torch.no_grad():
        for p in actor.parameters():
            p.sub_(0.5 * p.grad)
    report = copy_weights(actor, reference, bucket_size="64KB")
    want = dict(mcore_zoo.iter_hf_weights(actor))
    got = dict(mcore_zoo.iter_hf_weights(reference))
    same = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    moved = any(not torch.equal(got[k], v) for k, v in load_safetensors_dir(mcore_zoo.handle_of(actor).hf_source).items())
    return {"bitwise": same, "moved": moved, "buckets": report.buckets, "parameters": report.parameters}


def _single_process(ckpt: Path, value_ckpt: Path) -> dict:
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    found = {}
    for name, _, critic in MODELS:
        model = _build(str(value_ckpt if critic else ckpt), Parallelism(), critic)
        found[name] = {"forward": _forward(model, batch, critic)}
        found[name]["grads"], found[name]["loss"] = _update(model, batch, critic)
    return found


def _largest(got: list, want: list) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.fixture(scope="module")
def checkpoints(reference_checkpoint, tmp_path_factory):
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 4})
    return ckpt, _value_checkpoint(ckpt, tmp_path_factory.mktemp("critic") / "untied")


@pytest.fixture(scope="module")
def one_process(checkpoints, mpu) -> dict:
    """:func:`_single_process` of the module's checkpoints, the reference of every four-rank job."""
    return _single_process(*checkpoints)


@pytest.fixture(scope="module")
def four_rank_runs(checkpoints, tmp_path_factory) -> SharedLaunch:
    """One four-rank launch for this module's jobs: the three models in one job, Megatron-Core's
    optimizer on each model's groups, and models on part of the job."""
    ckpt, value_ckpt = map(str, checkpoints)
    return SharedLaunch(4, lambda: {
        "models": (_run_models, ckpt, value_ckpt),
        "optimizer": (_run_optimizer, ckpt, value_ckpt),
        "part-of-the-job": (_run_on_part_of_the_job, ckpt, value_ckpt, str(tmp_path_factory.mktemp("part-of-the-job"))),
    })  # fmt: skip


@pytest.mark.slow
def test_actor_reference_critic_at_three_layouts_in_one_job(checkpoints, one_process, four_rank_runs):
    ckpt, _ = checkpoints
    ref = one_process
    found = four_rank_runs["models"]
    source = load_safetensors_dir(ckpt)
    worst: dict[str, tuple[float, float]] = {}
    for rank, per_rank in enumerate(found):
        for name, _, _ in MODELS:
            r, want = per_rank[name], ref[name]
            where = f"{name} rank {rank}"
            assert r["own_groups"] == (name != "actor"), f"{where}: own groups {r['own_groups']}"
            forward = _largest(r["forward"], want["forward"])
            assert forward <= FORWARD_TOL, f"{where}: forward differs by {forward}"
            assert set(r["grads"]) == set(want["grads"]), where
            grads = max((r["grads"][k] - want["grads"][k]).abs().max().item() for k in want["grads"])
            assert grads <= GRAD_TOL, f"{where}: gradients differ by {grads}"
            assert abs(r["loss"] - want["loss"]) <= FORWARD_TOL, f"{where}: loss {r['loss']} != {want['loss']}"
            worst[name] = tuple(max(a, b) for a, b in zip(worst.get(name, (0.0, 0.0)), (forward, grads)))
        actor = per_rank["actor"]
        assert all(torch.equal(a, b) for a, b in zip(actor["forward_after"], actor["forward"])), \
            f"rank {rank}: the actor's log-probs changed after the other models were built"
        copy = per_rank["copy"]
        assert copy["bitwise"] and copy["moved"], f"rank {rank}: actor -> reference copy {copy}"
        assert copy["buckets"] > 1 and copy["parameters"] > 0, f"rank {rank}: {copy}"
        exported = per_rank["reference"]["export"]
        assert set(exported) == set(source) and all(torch.equal(exported[k], source[k]) for k in source), \
            f"rank {rank}: the reference's export is not its checkpoint"
    print("largest |difference| (forward, gradients) vs one process:", worst)


def test_what_own_groups_cannot_carry_is_refused_by_name():
    """MoE layers, multi-token prediction and expert parallelism read Megatron-Core's process-wide
    parallel state: a model that needs them at another layout than the job's is refused, naming
    the module."""
    from mcore_zoo.model_groups import check_own_groups

    dense = SimpleNamespace(architecture="LlamaForCausalLM", moe=None, mtp_num_layers=0)
    check_own_groups(dense, Parallelism(tp=2))
    moe = SimpleNamespace(architecture="MixtralForCausalLM", moe=object(), mtp_num_layers=0)
    with pytest.raises(UnsupportedLayoutError, match=r"MixtralForCausalLM at TP2 .*moe_utils"):
        check_own_groups(moe, Parallelism(tp=2))
    mtp = SimpleNamespace(architecture="DeepseekV3ForCausalLM", moe=None, mtp_num_layers=1)
    with pytest.raises(UnsupportedLayoutError, match="multi_token_prediction"):
        check_own_groups(mtp, Parallelism(pp=2))
    with pytest.raises(UnsupportedLayoutError, match="expert parallelism"):
        check_own_groups(dense, Parallelism(ep=2))
    with pytest.raises(UnsupportedLayoutError, match=r"MixtralForCausalLM at TP1 is placed on ranks \[6, 7\] .*moe_utils"):
        check_own_groups(moe, Parallelism(), ranks=(6, 7))


def test_a_distributed_checkpoint_load_on_own_groups_is_refused_by_name():
    from mcore_zoo.model_groups import refuse_own_groups
    from mcore_zoo.placement import Placement, ProcessGroups

    refuse_own_groups(Placement.single(), "load_mcore_checkpoint", "dist_checkpoint")  # the job's state: fine
    own = Placement(Parallelism(tp=2), groups=ProcessGroups(collection=object()))
    assert own.own_groups and own.pg_collection is not None
    with pytest.raises(UnsupportedLayoutError, match="load_mcore_checkpoint: .*sharded_state_dict"):
        refuse_own_groups(own, "load_mcore_checkpoint", "dist_checkpoint")


# ---------------------------------------------------------------------------- the optimizer path
LR, CLIP, EPS = 0.1, 1.0, 1.0


def _optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    # Adam (the distributed optimizer's), first step: lr * g / (|g| + eps) of the clipped gradient g;
    # eps = 1 keeps that a smooth function of g, comparable entry by entry
    return OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, adam_eps=EPS, clip_grad=CLIP,
                           use_distributed_optimizer=True, bf16=False, fp16=False, params_dtype=torch.float32)  # fmt: skip


def _run_optimizer(ckpt: str, value_ckpt: str) -> dict:
    """Each model wrapped in Megatron-Core's DDP with the distributed optimizer on its own groups
    (``wrap_for_training``), one ``train_step`` and one ``optimizer.step()``."""
    from mcore_zoo.distributed.optimizer import wrap_for_training

    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    setups, found = {}, {}
    for name, parallel, critic in MODELS:
        model = _build(value_ckpt if critic else ckpt, parallel, critic)
        setups[name] = wrap_for_training(model, _optimizer_config())
    for name, parallel, critic in MODELS:
        setup = setups[name]
        setup.zero_grad()
        _update(setup.model, batch, critic)  # the distributed optimizer: each replica holds its shard of the reduced gradients
        success, norm, _ = setup.optimizer.step()
        found[name] = {"success": success, "norm": norm,
                       "weights": {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(setup.model)}}  # fmt: skip
    return found


@pytest.mark.slow
def test_megatron_optimizer_on_each_models_groups(checkpoints, one_process, four_rank_runs):
    """Megatron-Core's DDP wrapper, ``get_megatron_optimizer`` (distributed optimizer),
    ``finalize_model_grads`` and gradient clipping, each model on its own groups: the clipped
    gradient norm ``optimizer.step()`` reports and the updated weights equal one process's update
    (Adam's first step on the single-process gradients, clipped by their norm)."""
    ckpt, value_ckpt = checkpoints
    ref = one_process
    sources = {False: load_safetensors_dir(ckpt), True: load_safetensors_dir(value_ckpt)}
    found = four_rank_runs["optimizer"]
    worst: dict[str, float] = {}
    for name, _, critic in MODELS:
        grads = ref[name]["grads"]
        norm = sum(g.double().pow(2).sum() for g in grads.values()).sqrt().item()
        scale = min(1.0, CLIP / (norm + 1e-6))
        assert scale < 1.0, f"{name}: the gradient norm {norm} is not clipped at {CLIP}"
        want = {k: sources[critic][k] - LR * (scale * g) / ((scale * g).abs() + EPS) for k, g in grads.items()}
        for rank, per_rank in enumerate(found):
            r, where = per_rank[name], f"{name} rank {rank}"
            assert r["success"], where
            assert abs(r["norm"] - norm) <= 1e-5 * norm, f"{where}: gradient norm {r['norm']} != one process's {norm}"
            moved = max((r["weights"][k] - want[k]).abs().max().item() for k in want)
            # the gradients' difference times lr, plus a few float32 ulps of weights of size up to 1
            assert moved <= LR * GRAD_TOL + 3e-7, f"{where}: updated weights differ by {moved}"
            worst[name] = max(worst.get(name, 0.0), moved, abs(r["norm"] - norm) / norm)
        print(f"{name}: gradient norm {norm:.6g}, clipped by {scale:.4g}")
    print("largest |weight difference| or relative norm difference vs one process:", worst)


# ---------------------------------------------------------------------------- models on part of the job
#: (name, layout, the job's ranks it is placed on, value head): beside the actor on all four ranks
SUBSET_MODELS = [
    ("policy", Parallelism(tp=2), (2, 3), False),  # e.g. an old-policy copy at TP2 on two ranks
    ("reward", Parallelism(), (0, 1), True),  # a reward model (value head) at DP2 on the other two
]


def _refusals(model, batch: dict, critic: bool) -> dict:
    """What each operation on a model that this rank holds no part of raised (its message), or
    ``"ran"``."""
    from mcore_zoo.distributed.optimizer import wrap_for_training

    calls = {
        "packed_forward": lambda: mcore_zoo.packed_forward(model, batch["seqs"]),
        "train_step": lambda: _update(model, batch, critic),
        "wrap_for_training": lambda: wrap_for_training(model, _optimizer_config()),
        "iter_hf_weights": lambda: next(iter(mcore_zoo.iter_hf_weights(model))),
        "module call": lambda: model(None),
    }
    found = {}
    for what, call in calls.items():
        try:
            call()
            found[what] = "ran"
        except mcore_zoo.NotOnThisRankError as exc:
            found[what] = str(exc)
    return found


def _run_on_part_of_the_job(ckpt: str, value_ckpt: str, out_dir: str) -> dict:
    """The actor on every rank, then each of :data:`SUBSET_MODELS` on its ranks: forward and
    gradients where it is held, the refusals where it is not; the actor (moved off its checkpoint)
    copied into the policy copy, and the copy the other way refused."""
    from mcore_zoo.distributed.copy import copy_weights

    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    actor = _build(ckpt, Parallelism(tp=2, pp=2), False)
    models = {name: _build(value_ckpt if critic else ckpt, parallel, critic, ranks=ranks)
              for name, parallel, ranks, critic in SUBSET_MODELS}  # fmt: skip
    rank = mcore_zoo.handle_of(actor).placement.rank
    found: dict = {}
    for name, _, ranks, critic in SUBSET_MODELS:
        model, held = models[name], rank in ranks
        placement = mcore_zoo.handle_of(model).placement
        found[name] = {"held": held, "holds_model": placement.holds_model, "own_groups": placement.own_groups,
                       "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
        if held:
            found[name]["forward"] = _forward(model, batch, critic)
            found[name]["grads"], found[name]["loss"] = _update(model, batch, critic)
        else:
            found[name]["refused"] = _refusals(model, batch, critic)
    _update(actor, batch, False)
    with torch.no_grad():
        for p in actor.parameters():
            p.sub_(0.5 * p.grad)
    policy, policy_ranks = models["policy"], list(SUBSET_MODELS[0][2])
    report = copy_weights(actor, policy, bucket_size="64KB")
    want = {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(actor, ranks=policy_ranks)}
    copy = {"parameters": report.parameters, "bytes_received": report.bytes_received}
    if rank in policy_ranks:
        got = dict(mcore_zoo.iter_hf_weights(policy))
        copy["bitwise"] = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        mcore_zoo.save_hf_checkpoint(policy, Path(out_dir) / "policy")  # written by rank 2, the model's first
        if rank == policy_ranks[0]:
            saved = load_safetensors_dir(Path(out_dir) / "policy")
            copy["saved_bitwise"] = set(saved) == set(want) and all(torch.equal(saved[k], want[k]) for k in want)
        try:
            mcore_zoo.refit(policy, None)
            copy["refit"] = "ran"
        except mcore_zoo.UnsupportedLayoutError as exc:
            copy["refit"] = str(exc)
    try:
        copy_weights(policy, actor)
        copy["reverse"] = "ran"
    except mcore_zoo.NotOnThisRankError as exc:
        copy["reverse"] = str(exc)
    found["copy"] = copy
    return found


@pytest.mark.slow
def test_models_on_part_of_the_job(one_process, four_rank_runs):
    """Beside the actor at TP2 x PP2 on four ranks, a policy copy at TP2 on ranks {2, 3} and a
    reward model (value head) at DP2 on ranks {0, 1}, each built on groups over its own ranks:
    log-probs / values within 1e-5 and gradients within 3e-6 of one process where the model is
    held; elsewhere no parameters, and every operation refused naming the model's ranks. The
    actor's weights copied into the policy copy arrive bit for bit (the ranks outside it take part
    in the actor's gathers and receive nothing), and the policy copy's ranks save them as an HF
    checkpoint (written by its first rank); the copy the other way, and a refit of a model on part
    of the job, are refused by name."""
    ref = one_process
    found = four_rank_runs["part-of-the-job"]
    one_process = {"policy": ref["actor"], "reward": ref["critic"]}
    worst: dict[str, tuple[float, float]] = {}
    for rank, per_rank in enumerate(found):
        for name, _, ranks, _ in SUBSET_MODELS:
            r, where = per_rank[name], f"{name} rank {rank}"
            assert r["held"] == r["holds_model"] == (rank in ranks) and r["own_groups"] == (rank in ranks), (where, r)
            if rank not in ranks:
                assert r["parameters"] == 0, where
                for what, message in r["refused"].items():
                    assert f"placed on ranks {list(ranks)}" in message and f"rank {rank} holds no part" in message, \
                        f"{where}: {what} -> {message}"
                continue
            want = one_process[name]
            forward = _largest(r["forward"], want["forward"])
            assert forward <= FORWARD_TOL, f"{where}: forward differs by {forward}"
            assert set(r["grads"]) == set(want["grads"]), where
            grads = max((r["grads"][k] - want["grads"][k]).abs().max().item() for k in want["grads"])
            assert grads <= GRAD_TOL, f"{where}: gradients differ by {grads}"
            worst[name] = tuple(max(a, b) for a, b in zip(worst.get(name, (0.0, 0.0)), (forward, grads)))
        copy = per_rank["copy"]
        assert "the source is placed on ranks [2, 3]" in copy["reverse"], f"rank {rank}: {copy['reverse']}"
        if rank in (2, 3):
            assert copy["bitwise"] and copy["parameters"] > 0, f"rank {rank}: {copy}"
            assert "refit: the model is placed on ranks [2, 3]" in copy["refit"], copy["refit"]
            assert copy.get("saved_bitwise", rank == 3), f"rank {rank}: the saved checkpoint is not the actor's"
        else:
            assert copy["parameters"] == 0 and copy["bytes_received"] == 0, f"rank {rank}: {copy}"
    print("largest |difference| (forward, gradients) vs one process:", worst)


def test_a_placement_on_other_ranks_holds_no_model_and_says_where_it_is():
    from mcore_zoo.handle import ModelHandle, ModelOnOtherRanks
    from mcore_zoo.model_groups import model_ranks
    from mcore_zoo.placement import Placement

    assert model_ranks([3, 2], 4) == (2, 3)
    for wrong in ([], [1, 1], [4], [-1]):
        with pytest.raises(mcore_zoo.LayoutError, match="distinct ranks of the job"):
            model_ranks(wrong, 4)
    assert Placement.single().holds_model and Placement(rank=2, world_size=2, ranks=(2, 3)).holds_model
    elsewhere = Placement(Parallelism(tp=2), rank=0, world_size=2, ranks=(2, 3))
    assert not elsewhere.holds_model
    handle = ModelHandle(None, SimpleNamespace(architecture="LlamaForCausalLM"), None, None, elsewhere)
    module = ModelOnOtherRanks(handle)
    assert mcore_zoo.handle_of(module) is handle and not list(module.parameters())
    for call in (handle.check_current, lambda: module(None)):
        with pytest.raises(mcore_zoo.NotOnThisRankError, match=r"LlamaForCausalLM is placed on ranks \[2, 3\] .*rank 0"):
            call()
