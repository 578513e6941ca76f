"""Routing replay (RL): a replayed forward equals the recorded one bit for bit, keeps the recorded
experts when the router changes (Qwen3-MoE, GLM-4.5, and the gated DeltaNet models' MoE blocks:
Qwen3-Next, Qwen3.5-MoE), and its backward reaches the router; expert token counts."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo import routing
from mcore_zoo.numerics.profiles import get_profile

from ..conftest import random_sequences

ARCHS = ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"]


def _model(ckpt):
    return mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt, params_dtype=torch.float32,
                                 overrides={"moe_enable_routing_replay": True}).eval()  # fmt: skip


def _chosen(model):
    """``(calls, handles)``: every router call's experts per token (sets, as a bool map) with the
    router's index, as the forwards run (:func:`_per_layer` gathers them per MoE layer)."""
    calls = []
    handles = [r.register_forward_hook(lambda m, i, o, k=k: calls.append((k, o[1].clone())))
               for k, r in enumerate(routing.moe_routers(model))]  # fmt: skip
    return calls, handles


def _per_layer(calls, model):
    """Per MoE layer, the experts each token went to in the recorded forward: its router's calls in
    order (``hf-exact`` routes a THD pack one sequence at a time), concatenated."""
    return [torch.cat([m for k, m in calls if k == j]) for j in range(len(routing.moe_routers(model)))]


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
        calls, handles = _chosen(model)
        free = mcore_zoo.packed_forward(model, seqs).logits
        free_maps = _per_layer(calls, model)
        calls.clear()
        with routing.replay(model, rec.routes):
            pinned = mcore_zoo.packed_forward(model, seqs).logits
        for h in handles:
            h.remove()
        maps = _per_layer(calls, model)
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
    replayed send every real token to its recorded experts and give the recorded forward (bit for
    bit when the padding slots keep their recorded routes too); unpack_routes inverts pack_routes.

    pack_routes sends padding slots to experts ``0..top_k-1``, where the recording's router sent
    them elsewhere: the expert GEMMs then see other row counts, and a CPU GEMM's rounding of a
    row may depend on them (seen at 2 threads on an AVX512 CPU), so the real tokens' logits are
    compared within a bound there."""
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
        with routing.replay(model, rec.routes):  # padding slots as recorded
            again = mcore_zoo.packed_forward(model, seqs, align=8).logits
        calls, handles = _chosen(model)
        with routing.replay(model, packed):
            replayed = mcore_zoo.packed_forward(model, seqs, align=8).logits
        for handle in handles:
            handle.remove()
        maps = _per_layer(calls, model)
    assert all(torch.equal(a, b) for a, b in zip(recorded, again))
    for chosen, want in zip(maps, rec.routes):
        expected = torch.zeros_like(chosen).scatter(1, want, True)
        assert torch.equal(chosen[real], expected[real])
    # fp32 logits of size O(10): a few ulps of the largest, not a changed expert (that moves them by O(1))
    assert all((a - b).abs().max() <= 64 * torch.finfo(torch.float32).eps * b.abs().max() for a, b in zip(recorded, replayed))


def test_the_hf_order_combine_runs_in_the_layer_and_in_backward(mpu, reference_checkpoint, monkeypatch):
    """A ``router="hf"`` MoE layer combines through ``hf_order_unpermute`` (once per MoE layer per
    forward) and the gradient flows through it; a ``router="mcore"`` build uses the stock combine."""
    from mcore_zoo.families.moe import spec as moe_specs

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


def _step_routes(model, seqs, loss, **step):
    """Record one ``train_step``: the routes per MoE layer in the order the step routed the
    sequences, and per sequence of ``seqs`` (``[moe_layers, len, top_k]``)."""
    from mcore_zoo.distributed.forward import partition_by_tokens

    with routing.record(model) as rec:
        mcore_zoo.train_step(model, seqs, loss, **step)
    lengths = [s.numel() for s in seqs]
    order = [i for group in partition_by_tokens(lengths, None, step["num_microbatches"]) for i in group]
    assert order != sorted(order)  # the step routes the sequences in another order than given
    per_sequence = [None] * len(seqs)
    for i, r in zip(order, routing.unpack_routes(rec.routes, [lengths[i] for i in order])):
        per_sequence[i] = r
    return rec.routes, per_sequence


def _step_grads(model, seqs, loss, **step):
    model.zero_grad(set_to_none=True)
    mcore_zoo.train_step(model, seqs, loss, **step)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _nll(tokens):
    return -(tokens.logprobs * tokens.mask).sum(), {}


def test_train_step_replays_per_sequence_routes(mpu, reference_checkpoint):
    """``train_step(replay_routes=)`` with a single-process record split per sequence (in the
    caller's order) gives, over two micro-batches and with perturbed routers, the gradients of
    ``routing.replay`` of the record bit for bit; the perturbed routers on their own differ."""
    model = _model(reference_checkpoint("Qwen3MoeForCausalLM")).train()
    seqs = random_sequences([24, 12, 40, 8, 20, 12], 256, seed=3)
    step = {"num_microbatches": 2}
    assert routing.moe_layer_numbers(model) == [int(r.layer_number) for r in routing.moe_routers(model)]
    routes, per_sequence = _step_routes(model, seqs, _nll, **step)
    for router in routing.moe_routers(model):
        router.weight.data.add_(torch.randn_like(router.weight, generator=torch.Generator().manual_seed(7)) * 0.5)
    with routing.replay(model, routes):
        replayed = _step_grads(model, seqs, _nll, **step)
    given = _step_grads(model, seqs, _nll, replay_routes=per_sequence, **step)
    free = _step_grads(model, seqs, _nll, **step)
    assert all(torch.equal(replayed[k], given[k]) for k in replayed)
    assert max((replayed[k] - free[k]).abs().max().item() for k in free) > 1e-3


def test_replay_refuses_unused_and_missing_routes(mpu, reference_checkpoint):
    """Routes for more tokens than the forwards route (a longer pack, a leftover after the last
    micro-batch, no forward at all) raise when the block ends, naming each layer and how many of
    its tokens were left; too few raise in the forward; an extra layer, or per-sequence routes
    that do not fit the sequences, raise before anything runs. A refused ``train_step`` leaves the
    gradients as they were before it."""
    model = _model(reference_checkpoint("Qwen3MoeForCausalLM")).train()
    seqs = random_sequences([24, 12, 40, 8, 20, 12], 256, seed=3)
    step = {"num_microbatches": 2}
    routes, per_sequence = _step_routes(model, seqs, _nll, **step)
    layers = routing.moe_layer_numbers(model)
    total = routes[0].shape[0]
    longer = [torch.cat([r, r[:5]]) for r in routes]
    with pytest.raises(mcore_zoo.ZooError, match=f"layer {layers[0]}: 5 of its {total + 5} tokens left") as err:
        with routing.replay(model, longer):
            mcore_zoo.train_step(model, seqs, _nll, **step)
    assert all(f"layer {n}: 5 of its" in str(err.value) for n in layers)
    with pytest.raises(mcore_zoo.ZooError, match=f"layer {layers[-1]}: 8 of its {total} tokens left"):
        with routing.replay(model, routes):  # the last sequence (8 tokens, in the second micro-batch) left out
            mcore_zoo.train_step(model, seqs[:3] + seqs[4:], _nll, **step)
    with pytest.raises(mcore_zoo.ZooError, match=f"layer {layers[0]}: {total} of its {total} tokens left"):
        with routing.replay(model, routes):
            pass
    held = _step_grads(model, seqs, _nll, **step)  # gradients a refused step must leave as they are
    with pytest.raises(mcore_zoo.ZooError, match=f"layer {layers[0]}: this forward routes 60 tokens, 57 .*too few routes"):
        with routing.replay(model, [r[:-3] for r in routes]):
            mcore_zoo.train_step(model, seqs, _nll, **step)
    with pytest.raises(mcore_zoo.ZooError, match=f"{len(layers) + 1} route tensors for {len(layers)} MoE layers"):
        with routing.replay(model, routes + routes[:1]):
            pass
    with pytest.raises(mcore_zoo.ZooError, match="expected"):
        with routing.replay(model, [r[:, :1] for r in routes]):  # top-1 routes for a top-2 router
            pass
    shape = rf"expected \[{len(layers)}, 24, top_k\]"
    bad = {
        "extra layer": ([torch.cat([r, r[:1]]) for r in per_sequence], shape),
        "longer sequence": ([torch.cat([r, r[:, :1]], dim=1) for r in per_sequence], shape),
        "one sequence missing": (per_sequence[:-1], "replay_routes for 5 sequences; 6 sequences given"),
    }
    for what, (given, message) in bad.items():
        with pytest.raises(mcore_zoo.ZooError, match=message):
            mcore_zoo.train_step(model, seqs, _nll, replay_routes=given, **step)
    with pytest.raises(mcore_zoo.ZooError, match="do not nest"):
        with routing.record(model):
            mcore_zoo.train_step(model, seqs, _nll, replay_routes=per_sequence, **step)
    now = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert now.keys() == held.keys() and all(torch.equal(now[k], held[k]) for k in held)
    # after every refusal the routers route on their own again, and a good replay still works
    _step_grads(model, seqs, _nll, replay_routes=per_sequence, **step)


def test_stock_router_replay_is_checked_per_forward(mpu, reference_checkpoint):
    """Megatron-Core's stock router (``router="mcore"``) replays its whole target in every forward:
    a forward of another size raises, and so does a block in which no forward ran."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32,
                                  numerics=get_profile("hf-exact").with_knobs(router="mcore"),
                                  overrides={"moe_enable_routing_replay": True}).eval()  # fmt: skip
    seqs = random_sequences([23, 40], 256, seed=4)
    with torch.no_grad():
        with routing.record(model) as rec:
            recorded = mcore_zoo.packed_forward(model, seqs).logits
        with routing.replay(model, rec.routes):
            replayed = mcore_zoo.packed_forward(model, seqs).logits
        assert all(torch.equal(a, b) for a, b in zip(recorded, replayed))
        with pytest.raises(mcore_zoo.ZooError, match="this forward routes 23 tokens.* all 63 rows"):
            with routing.replay(model, rec.routes):
                mcore_zoo.packed_forward(model, seqs[:1])
        with pytest.raises(mcore_zoo.ZooError, match="63 of its 63 tokens left"):
            with routing.replay(model, rec.routes):
                pass


def test_microbatch_routes_lay_out_each_pack():
    """Per-sequence routes over several packs: each pack's members at their padded slots, padding
    segments and alignment padding on experts ``0..top_k-1``, each rank's CP share and
    sequence-parallel slice per pack (not of all packs at once), the chosen layers."""
    from mcore_zoo.packing import pack_sequences

    gen = torch.Generator().manual_seed(0)
    lengths, k = [6, 16, 3, 12], 2
    per_sequence = [torch.randint(0, 8, (3, n, k), generator=gen) for n in lengths]
    groups = [[1, 2], [0, 3]]
    packs = [pack_sequences([torch.zeros(lengths[i]) for i in g] + [torch.zeros(8)], align=4) for g in groups]
    micro = [(g, p.cu_seqlens_padded) for g, p in zip(groups, packs)] + [([], torch.tensor([0, 4]))]
    for cp_size, size in [(1, 1), (1, 2), (2, 1), (2, 2)]:
        for cp_rank in range(cp_size):
            for rank in range(size):
                got = routing.microbatch_routes(per_sequence, micro, layers=[2, 0], rank=rank, size=size,
                                                cp_rank=cp_rank, cp_size=cp_size)  # fmt: skip
                want = []
                for g, p in zip(groups, packs):
                    full = torch.arange(k).expand(2, p.total, k).clone()
                    for start, i in zip(p.cu_seqlens_padded.tolist(), g):
                        full[:, start : start + lengths[i]] = per_sequence[i][[2, 0]]
                    share = full[:, p.context_parallel_index(cp_rank, cp_size)] if cp_size > 1 else full
                    n = share.shape[1] // size
                    want.append(share[:, rank * n : (rank + 1) * n])
                want.append(torch.arange(k).expand(2, 4 // (cp_size * size), k))  # the padding micro-batch
                want = torch.cat(want, dim=1)
                assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want)), (cp_size, cp_rank, size, rank)
    # a TP rank's slice of all the packs' sequences packed at once is not its slices of each pack
    whole = routing.pack_routes([per_sequence[i] for g in groups for i in g], align=4, rank=1, size=2)
    bounds = [pack_sequences([torch.zeros(lengths[i]) for i in g], align=4).cu_seqlens_padded for g in groups]
    split = routing.microbatch_routes(per_sequence, list(zip(groups, bounds)), rank=1, size=2)
    assert whole[0].shape == split[0].shape and not torch.equal(whole[0], split[0])
    with pytest.raises(mcore_zoo.ZooError, match="cover 16 tokens; its packed slot holds 8"):
        routing.microbatch_routes(per_sequence, [([1], torch.tensor([0, 8]))])


RECOMPUTE = {
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "moe": {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_activation_recomputation_routes_like_the_forward(mpu, reference_checkpoint, monkeypatch, recompute):
    """With activation recomputation a forward rerun in the backward routes like the forward it
    recomputes: a record of a two-micro-batch step holds each token once (the record without
    recomputation, same token counts), and per-sequence routes replayed with perturbed routers
    give the gradients of the same replay without recomputation."""
    import contextlib

    from megatron.core.tensor_parallel import random as mcore_random

    # Megatron-Core's checkpointing saves and restores CUDA RNG states; on CPU there are none (and
    # these models draw no random numbers)
    monkeypatch.setattr(mcore_random, "_get_all_rng_states", lambda: ())
    monkeypatch.setattr(mcore_random, "_set_all_rng_states", lambda *states: None)
    monkeypatch.setattr(mcore_random, "_fork_rng", contextlib.nullcontext)
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    plain = _model(ckpt).train()
    recomputing = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt,
                                        params_dtype=torch.float32,
                                        overrides={"moe_enable_routing_replay": True, **RECOMPUTE[recompute]}).train()  # fmt: skip
    seqs = random_sequences([24, 12, 40, 8, 20, 12], 256, seed=3)
    step = {"num_microbatches": 2}
    with routing.record(plain) as want:
        mcore_zoo.train_step(plain, seqs, _nll, **step)
    routes, per_sequence = _step_routes(plain, seqs, _nll, **step)
    with routing.record(recomputing) as got:
        mcore_zoo.train_step(recomputing, seqs, _nll, **step)
    assert all(torch.equal(a, b) for a, b in zip(got.routes, routes))
    assert all(torch.equal(a, b) for a, b in zip(got.tokens_per_expert, want.tokens_per_expert))
    for model in (plain, recomputing):
        for router in routing.moe_routers(model):
            noise = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(router.layer_number))
            router.weight.data.add_(0.5 * noise)
    replayed = _step_grads(plain, seqs, _nll, replay_routes=per_sequence, **step)
    again = _step_grads(recomputing, seqs, _nll, replay_routes=per_sequence, **step)
    assert max((replayed[k] - again[k]).abs().max().item() for k in replayed) <= 1e-6
    free = _step_grads(recomputing, seqs, _nll, **step)
    assert max((replayed[k] - free[k]).abs().max().item() for k in replayed) > 1e-3
