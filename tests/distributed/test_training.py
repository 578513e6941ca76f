"""Training under parallel layouts on real gloo process groups: the gradients of the example RL
update (``examples/rl_step.py``: PPO actor loss with entropy and KL terms; clipped value loss for
a critic) after ``train_step`` equal the single-process gradients, under HF names, within 1e-5.

Two launches (2 and 4 ranks) run several layouts each in the same processes. Every layout runs
the actor (LM head) and the critic (value head loaded from a ``score`` checkpoint, whose values
from ``packed_forward`` are compared too and whose export is checked bitwise against that
checkpoint); one layout wraps the model in Megatron-Core's DDP; a
mutation (the CP gradient reduction switched off) shows that the comparison fails when gradients
are wrong.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo.placement import Parallelism
from mcore_zoo.distributed import launch
from mcore_zoo.testing.common import layout_bound, load_safetensors_dir

from ..conftest import ROOT, random_sequences

LENGTHS = [23, 9, 40, 5, 17, 12]
NUMERICS = "hf-exact"
TOL = 1e-5


def _example():
    spec = importlib.util.spec_from_file_location("rl_step_example", ROOT / "examples" / "rl_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(vocab: int, lengths: list[int] = LENGTHS) -> dict:
    """Sequences and the token data of one update (deterministic; the same on every rank)."""
    seqs = random_sequences(lengths, vocab, seed=3)
    gen = torch.Generator().manual_seed(7)
    data = {
        "old_logprobs": [-3.0 * torch.rand(n - 1, generator=gen) - 4.0 for n in lengths],
        "ref_logprobs": [-3.0 * torch.rand(n - 1, generator=gen) - 4.0 for n in lengths],
        "advantages": [torch.randn(n - 1, generator=gen) for n in lengths],
        "loss_mask": [(torch.arange(n - 1) >= n // 3).float() for n in lengths],
        "old_values": [0.1 * torch.randn(n, generator=gen) for n in lengths],
        "returns": [0.5 * torch.randn((), generator=gen) for n in lengths],  # one per sequence
    }
    tokens = float(sum(m.sum() for m in data["loss_mask"]))
    return {"seqs": seqs, "data": data, "tokens": tokens}


def _grads(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(model, grads=True)}


def _update(model, batch: dict, critic: bool, **kw) -> tuple[dict, float]:
    ex = _example()
    for c in model if isinstance(model, list) else [model]:
        if hasattr(c, "zero_grad_buffer"):  # Megatron DDP: gradients live in its buffers
            c.zero_grad_buffer()
        else:
            c.zero_grad(set_to_none=True)
    if critic:
        loss_fn, keys = ex.value_loss(clip=0.05), ("old_values", "returns", "loss_mask")
    else:
        loss_fn, keys = ex.ppo_actor_loss(clip=0.2, entropy_coef=0.01, kl_coef=0.05), (
            "old_logprobs", "ref_logprobs", "advantages", "loss_mask")  # fmt: skip
    result = mcore_zoo.train_step(
        model, batch["seqs"], loss_fn, token_data={k: batch["data"][k] for k in keys},
        loss_normalizer=batch["tokens"], compute_entropy=not critic, temperature=0.9, **kw,
    )  # fmt: skip
    return _grads(model), result.loss.item()


def _megatron_grad_norm(model) -> float:
    """The gradient norm Megatron-Core's optimizer clips by: the gradients of the parameters it
    counts (``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``, which read
    each parameter's tensor-parallel attributes), summed over the model-parallel group
    (``get_main_grads_for_grad_norm`` and ``get_grad_norm_fp32``, whose CUDA buffers keep them off
    the CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    total = torch.zeros((), dtype=torch.float64)
    for chunk in model if isinstance(model, list) else [model]:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad
            if grad is not None and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                total += grad.double().pow(2).sum()
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        dist.all_reduce(total, group=ps.get_model_parallel_group())
    return total.sqrt().item()


def _build(ckpt: str, parallel: Parallelism, critic: bool, ddp: bool = False, **kw):
    kw = {**kw, "head": "value"} if critic else kw
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel, load=ckpt, **kw)
    if not ddp:
        return model
    # as Megatron's training loop sets a DDP-wrapped model up: the schedule reduces the gradients
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    wrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = wrapped.no_sync
    return wrapped


def _run_layouts(ckpt: str, value_ckpt: str, layouts: list, mutate: bool) -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.distributed import train
    from mcore_zoo.parallel import ensure_model_parallel

    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    found: dict = {}
    for name, parallel, kw in layouts:
        ensure_model_parallel(parallel)
        kw = dict(kw)
        ddp = kw.pop("ddp", False)
        r: dict = {}
        actor = _build(ckpt, parallel, critic=False, ddp=ddp)
        r["actor"], r["actor_loss"] = _update(actor, batch, False, **kw)
        r["grad_norm"] = _megatron_grad_norm(actor)
        critic = _build(value_ckpt, parallel, critic=True, ddp=ddp)
        r["critic"], r["critic_loss"] = _update(critic, batch, True, **kw)
        r["critic_export"] = {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(critic)}
        with torch.no_grad():
            r["values"] = mcore_zoo.packed_forward(critic, batch["seqs"]).values
        if mutate and parallel.cp > 1 and not ddp:  # the CP gradient sum left out: the comparison must fail
            saved = train._all_reduce_flat
            train._all_reduce_flat = lambda grads, group: None
            try:
                r["mutated"], _ = _update(actor, batch, False, **kw)
            finally:
                train._all_reduce_flat = saved
        found[name] = r
        ps.destroy_model_parallel()
    return found


def _value_checkpoint(ckpt: Path, out: Path) -> Path:
    """The causal LM's checkpoint as transformers' ``*ForTokenClassification`` (one label) saves a
    critic: no lm_head, a ``score`` layer with weight and bias."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(str(f)))
    hidden = state["model.embed_tokens.weight"].shape[1]
    state.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(11)
    state["score.weight"] = 0.05 * torch.randn(1, hidden, generator=gen)
    state["score.bias"] = torch.tensor([0.25])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    base = config["architectures"][0].removesuffix("ForCausalLM")
    config.update(architectures=[base + "ForTokenClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _reference(ckpt: Path, value_ckpt: Path, layouts: list) -> dict:
    """Single-process gradients of both updates (once per micro-batching the layouts use)."""
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    batch = _batch(vocab)
    actor = _build(str(ckpt), Parallelism(), critic=False)
    critic = _build(str(value_ckpt), Parallelism(), critic=True)
    updated = _update(actor, batch, False)
    return {
        "actor": updated,
        "grad_norm": _megatron_grad_norm(actor),
        "critic": _update(critic, batch, True),
        "critic_export": {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(critic)},
        "values": mcore_zoo.packed_forward(critic, batch["seqs"]).values,
    }


def _max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _check(found: list[dict], ref: dict, value_source: dict, world: int) -> dict[str, float]:
    worst: dict[str, float] = {}
    for name in found[0]:
        for rank in range(world):
            r = found[rank][name]
            where = f"{name} rank {rank}"
            actor = _max_diff(r["actor"], ref["actor"][0])
            critic = _max_diff(r["critic"], ref["critic"][0])
            assert actor <= TOL, f"{where}: actor gradients differ by {actor}"
            assert critic <= TOL, f"{where}: critic gradients differ by {critic}"
            assert abs(r["actor_loss"] - ref["actor"][1]) <= TOL and abs(r["critic_loss"] - ref["critic"][1]) <= TOL, where
            # Megatron's optimizer would clip by this norm: every TP shard counted once (the
            # parameters' tensor-parallel attributes), the tied embedding once
            norm_bound = layout_bound(torch.tensor([ref["grad_norm"]]))
            assert abs(r["grad_norm"] - ref["grad_norm"]) <= norm_bound, \
                f"{where}: Megatron's gradient norm {r['grad_norm']:.6g} != single process {ref['grad_norm']:.6g}"
            values = max((a - b).abs().max().item() for a, b in zip(r["values"], ref["values"]))
            assert values <= TOL, f"{where}: critic values (packed_forward) differ by {values}"
            exported = r["critic_export"]
            assert set(exported) == set(value_source), where
            assert all(torch.equal(exported[k], value_source[k]) for k in value_source), f"{where}: critic export"
            if "mutated" in r:
                mutated = _max_diff(r["mutated"], ref["actor"][0])
                assert mutated > 100 * TOL, f"{where}: a missing CP reduction went unnoticed ({mutated})"
            worst[name] = max(worst.get(name, 0.0), actor, critic)
    scale = max(v.abs().max().item() for part in ("actor", "critic") for v in ref[part][0].values())
    print(f"largest gradient entry (single process): {scale:.3g}")
    return worst


@pytest.fixture(scope="module")
def checkpoints(reference_checkpoint, tmp_path_factory):
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 4, "tie_word_embeddings": True,
                                                     "rope_scaling": None})  # fmt: skip
    untied = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 4})
    base = tmp_path_factory.mktemp("critic")
    return {
        "tied": (ckpt, _value_checkpoint(ckpt, base / "tied")),
        "untied": (untied, _value_checkpoint(untied, base / "untied")),
    }


@pytest.mark.slow
def test_two_ranks_tp2_pp2_cp2(checkpoints, mpu):
    """TP2, PP2 (tied embeddings: the two copies' gradients summed), CP2 (zigzag shares; plus the
    mutation), CP2 with the model wrapped in Megatron-Core's DDP (gradients in ``main_grad``,
    reduced by the wrapper through the schedule's ``finalize_model_grads_func``) - each with
    several micro-batches."""
    ckpt, value_ckpt = checkpoints["tied"]
    layouts = [
        ("tp2", Parallelism(tp=2), {"max_tokens_per_microbatch": 48}),
        ("pp2", Parallelism(pp=2), {"max_tokens_per_microbatch": 40}),
        ("cp2", Parallelism(cp=2), {"num_microbatches": 2}),
        ("cp2-ddp", Parallelism(cp=2), {"num_microbatches": 3, "ddp": True}),  # main_grad, the wrapper reduces
    ]
    ref = _reference(ckpt, value_ckpt, layouts)
    found = launch(_run_layouts, 2, str(ckpt), str(value_ckpt), layouts, True)
    source = load_safetensors_dir(value_ckpt)
    worst = _check(found, ref, source, 2)
    print("max |dgrad| vs the single-process update:", worst)


@pytest.mark.slow
def test_four_ranks_tp2pp2_pp2vpp2(checkpoints, mpu):
    """TP2 x PP2 with sequence parallel and PP2 x VPP2 (two data-parallel replicas, each with the
    whole batch), untied embeddings."""
    ckpt, value_ckpt = checkpoints["untied"]
    layouts = [
        ("tp2pp2sp", Parallelism(tp=2, pp=2, sequence_parallel=True), {"max_tokens_per_microbatch": 40}),
        ("pp2vpp2", Parallelism(pp=2, vpp=2), {"max_tokens_per_microbatch": 40}),
    ]
    ref = _reference(ckpt, value_ckpt, layouts)
    found = launch(_run_layouts, 4, str(ckpt), str(value_ckpt), layouts, False)
    source = load_safetensors_dir(value_ckpt)
    worst = _check(found, ref, source, 4)
    print("max |dgrad| vs the single-process update:", worst)
