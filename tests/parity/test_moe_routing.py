"""Routing replay (RL): a replayed forward equals the recorded one bit for bit, keeps the recorded
experts when the router changes, and its backward reaches the router; expert token counts."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo import routing
from mcore_zoo.numerics.profiles import get_profile

from ..conftest import random_sequences

ARCHS = ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"]


def _model(ckpt):
    return mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt, params_dtype=torch.float32,
                                 overrides={"moe_enable_routing_replay": True}).eval()  # fmt: skip


def _chosen(model):
    """Per MoE layer, the experts each token went to in the last forward (sets, as a bool map)."""
    maps = []
    handles = [r.register_forward_hook(lambda m, i, o: maps.append(o[1].clone())) for r in routing.moe_routers(model)]
    return maps, handles


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_is_bitwise_and_keeps_the_experts(mpu, reference_checkpoint, arch):
    ckpt = reference_checkpoint(arch)
    model = _model(ckpt)
    seqs = random_sequences([23, 40, 9], 256, seed=3)
    with torch.no_grad():
        with routing.record(model) as rec:
            recorded = mcore_zoo.packed_forward(model, seqs).logits
        assert len(rec.routes) == len(routing.moe_routers(model))
        assert all(int(c.sum()) == 72 * model.config.moe_router_topk for c in rec.tokens_per_expert)
        with routing.replay(model, rec.routes):
            replayed = mcore_zoo.packed_forward(model, seqs).logits
        assert all(torch.equal(a, b) for a, b in zip(recorded, replayed))

        # perturb every router: without replay the experts change, with replay they do not
        for router in routing.moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight, generator=torch.Generator().manual_seed(7)) * 0.5)
        maps, handles = _chosen(model)
        free = mcore_zoo.packed_forward(model, seqs).logits
        free_maps = list(maps)
        maps.clear()
        with routing.replay(model, rec.routes):
            pinned = mcore_zoo.packed_forward(model, seqs).logits
        for h in handles:
            h.remove()
    want = [torch.zeros_like(m).scatter(1, idx, True) for m, idx in zip(maps, rec.routes)]
    assert any(not torch.equal(f, w) for f, w in zip(free_maps, want)), "the perturbation did not change routing"
    assert all(torch.equal(m, w) for m, w in zip(maps, want)), "replay did not keep the recorded experts"
    assert any(not torch.equal(a, b) for a, b in zip(free, pinned))


def test_replay_backward_reaches_the_router(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = _model(ckpt)
    seqs = random_sequences([23, 40], 256, seed=4)
    with torch.no_grad(), routing.record(model) as rec:
        mcore_zoo.packed_forward(model, seqs)
    with routing.replay(model, rec.routes):
        out = mcore_zoo.packed_forward(model, seqs)
        sum(lp.sum() for lp in out.logprobs).backward()
    for router in routing.moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_needs_the_build_flag(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32)
    with pytest.raises(mcore_zoo.ZooError, match="moe_enable_routing_replay"):
        with routing.record(model):
            pass


def test_aux_loss_and_token_counts_in_training(mpu, reference_checkpoint):
    """output_router_logits=True turns router_aux_loss_coef into Megatron-Core's load-balancing
    loss (attached to the graph in training); its per-layer values and the expert token counts are
    reported (dense layers: 0)."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"output_router_logits": True})
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32).train()
    assert model.config.moe_aux_loss_coeff == 0.001
    seqs = random_sequences([30, 20], 256, seed=5)
    routing.aux_losses()  # start from a clean tracker
    with routing.count_tokens(model) as counts:
        out = mcore_zoo.packed_forward(model, seqs)
    sum(lp.sum() for lp in out.logprobs).backward()
    losses = routing.aux_losses()["load_balancing_loss"]
    pattern = [model.mcore_zoo.arch_config.moe.is_moe_layer(i) for i in range(len(model.decoder.layers))]
    assert [bool(v > 0) for v in losses] == pattern
    assert all(int(c.sum()) == 50 * 2 for c in counts.tokens_per_expert)


def test_aux_losses_forget_what_they_returned(mpu, reference_checkpoint):
    """``routing.aux_losses()`` empties Megatron-Core's tracker (0.19 keeps it in a tracker object
    whose legacy dict accessor returns a copy, so clearing that copy cleared nothing and the values
    added up over forwards); ``clear=False`` keeps them; a model of another depth gets its own
    layer count."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"output_router_logits": True})
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32).train()
    seqs = random_sequences([30, 20], 256, seed=5)
    routing.aux_losses()
    mcore_zoo.packed_forward(model, seqs)
    first = routing.aux_losses(clear=False)["load_balancing_loss"]
    assert (first > 0).any()
    assert torch.equal(routing.aux_losses()["load_balancing_loss"], first)
    assert routing.aux_losses() == {}
    mcore_zoo.packed_forward(model, seqs)
    assert torch.equal(routing.aux_losses()["load_balancing_loss"], first)  # this forward's, not two
    deeper = reference_checkpoint("Qwen3MoeForCausalLM", {"output_router_logits": True, "num_hidden_layers": 4})
    model = mcore_zoo.build_model(deeper, backend="portable", load=deeper, params_dtype=torch.float32).train()
    mcore_zoo.packed_forward(model, seqs)
    assert routing.aux_losses()["load_balancing_loss"].shape == (4,) != first.shape


def test_routes_from_a_rollout_engine_are_packed_like_the_tokens(mpu, reference_checkpoint):
    """Per-sequence routes (as a rollout engine reports them) packed with alignment padding and
    replayed give the recorded forward bit for bit; unpack_routes inverts pack_routes."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = _model(ckpt)
    seqs = random_sequences([23, 40, 9], 256, seed=6)
    with torch.no_grad():
        with routing.record(model) as rec:
            recorded = mcore_zoo.packed_forward(model, seqs, align=8).logits
        per_sequence = routing.unpack_routes(rec.routes, [s.numel() for s in seqs], align=8)
        assert [r.shape[1] for r in per_sequence] == [23, 40, 9]
        packed = routing.pack_routes(per_sequence, align=8)
        for got, want, in zip(packed, rec.routes):
            real = torch.cat([torch.arange(o, o + n) for o, n in zip([0, 24, 64], [23, 40, 9])])
            assert torch.equal(got[real], want[real])
        with routing.replay(model, packed):
            replayed = mcore_zoo.packed_forward(model, seqs, align=8).logits
    assert all(torch.equal(a, b) for a, b in zip(recorded, replayed))


def test_the_hf_order_combine_runs_in_the_layer_and_in_backward(mpu, reference_checkpoint, monkeypatch):
    """A ``router="hf"`` MoE layer combines through ``hf_order_unpermute`` (once per MoE layer per
    forward) and the gradient flows through it; a ``router="mcore"`` build uses the stock combine."""
    from mcore_zoo.specs import moe as moe_specs

    calls = []
    original = moe_specs.hf_order_unpermute

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(moe_specs, "hf_order_unpermute", counted)
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32).train()
    moe_layers = sum(model.mcore_zoo.arch_config.moe.is_moe_layer(i) for i in range(len(model.decoder.layers)))
    out = mcore_zoo.packed_forward(model, random_sequences([30, 20], 256, seed=5))
    assert len(calls) == moe_layers > 0
    sum(lp.sum() for lp in out.logprobs).backward()
    expert = next(p for n, p in model.named_parameters() if "local_experts.0.linear_fc1" in n)
    assert expert.grad is not None and expert.grad.abs().sum() > 0
    calls.clear()
    stock = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32,
                                  numerics=get_profile("default").with_knobs(router="mcore"))  # fmt: skip
    with torch.no_grad():
        mcore_zoo.packed_forward(stock, random_sequences([30, 20], 256, seed=5))
    assert calls == []


def test_train_step_after_a_backward_outside_the_schedule(mpu, reference_checkpoint):
    """A plain ``packed_forward`` + ``backward`` with the aux loss on leaves Megatron-Core's aux-loss
    scale as a 0-d tensor, into which the schedule's ``[1]`` scale cannot be copied; ``train_step``
    clears it first (every schedule run does)."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"output_router_logits": True})
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32).train()
    seqs = random_sequences([30, 20], 256, seed=5)
    sum(lp.sum() for lp in mcore_zoo.packed_forward(model, seqs).logprobs).backward()
    result = mcore_zoo.train_step(model, seqs, lambda t: (-(t.logprobs * t.mask).sum(), {}), loss_normalizer=48)
    assert torch.isfinite(torch.as_tensor(result.loss)).all()


def test_routes_in_context_parallel_order():
    """Routes in pack order -> each CP rank's zigzag order and back; pack_routes with cp_rank /
    cp_size gives the same rows as taking the pack to the rank's order (padding included)."""
    from mcore_zoo.packing import pack_sequences

    lengths, align, k = [6, 16, 3], 8, 2
    gen = torch.Generator().manual_seed(0)
    per_sequence = [torch.randint(0, 8, (3, n, k), generator=gen) for n in lengths]
    packed = routing.pack_routes(per_sequence, align=align)
    pack = pack_sequences([torch.arange(n) for n in lengths], align=align)
    parts = []
    for rank in range(2):
        mine = routing.context_parallel_routes(packed, lengths, align=align, cp_rank=rank, cp_size=2)
        index = pack.context_parallel_index(rank, 2)
        assert all(torch.equal(m, p[index]) for m, p in zip(mine, packed))
        assert all(torch.equal(a, b) for a, b in zip(mine, routing.pack_routes(per_sequence, align=align, cp_rank=rank, cp_size=2)))
        parts.append(mine)
    assert not torch.equal(parts[0][0], packed[0][: packed[0].shape[0] // 2])
    merged = routing.merge_context_parallel_routes(parts, lengths, align=align)
    assert all(torch.equal(a, b) for a, b in zip(merged, packed))
    back = routing.unpack_routes(merged, lengths, align=align)
    assert all(torch.equal(a, b) for a, b in zip(back, per_sequence))
    with pytest.raises(mcore_zoo.ZooError, match="cannot be split"):
        routing.context_parallel_routes(routing.pack_routes(per_sequence, align=2), lengths, align=2, cp_rank=0, cp_size=2)
