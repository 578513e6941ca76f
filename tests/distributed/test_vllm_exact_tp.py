"""``vllm-exact`` under tensor parallelism on real gloo process groups (2 ranks, torch stand-ins for
vLLM's kernels): the layers split as vLLM's TP engine splits them, the partial sums all-reduced,
the logits gathered before the log-prob kernel. Log-probs against transformers' eager model and
gradients against the single-process ``vllm-exact`` model (fp32: only the summation order of the
row-parallel layers differs). Qwen3-MoE likewise at TP2 (every expert's intermediate dimension
split, expert-TP 2) and at TP2 with expert parallelism 2 (whole experts split, expert-TP 1): the
layouts of vLLM's TP2 engine without and with ``enable_expert_parallel``; DeepSeek-V3 (MLA, the
grouped router and shared expert) at TP2. Bitwise agreement with a TP2 vLLM engine needs two GPUs:
bench/gpu/vllm_exact_tp.py."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.distributed import launch

from ..conftest import SharedLaunch

#: the TP2 model: Qwen2 (q / k / v biases too), two layers
TP2_OVERRIDES = {"num_hidden_layers": 2}
#: the TP4 model: four key-value heads, one per rank
TP4_OVERRIDES = {"num_hidden_layers": 2, "num_key_value_heads": 4}
CHAIN_SHAPE = (37, 64)
#: the MoE model: Qwen3-MoE's example config (8 experts, top-2, a dense layer among the MoE layers)
MOE_ARCH = "Qwen3MoeForCausalLM"
MOE_OVERRIDES = {"num_hidden_layers": 3}
#: vLLM's TP2 engine without / with enable_expert_parallel, as the trainer's layout: (tp, ep, etp)
MOE_LAYOUTS = {"moe-tp2": (2, 1, 2), "moe-tp2-ep2": (2, 2, 1)}
#: DeepSeek-V3's example config: MLA with a query LoRA, a dense first layer, 8 experts in 4 groups
MLA_ARCH = "DeepseekV3ForCausalLM"
MLA_OVERRIDES = {"num_hidden_layers": 3, "n_group": 4, "topk_group": 2}


def _tp2_seqs() -> list:
    from mcore_zoo.testing.common import random_sequences

    return random_sequences([23, 9, 40], 256, seed=3)


def _moe_seqs() -> list:
    from mcore_zoo.testing.common import random_sequences

    return random_sequences([11, 6, 15], 256, seed=3)


def _tp4_seqs() -> list:
    from mcore_zoo.testing.common import random_sequences

    return random_sequences([23, 9], 256, seed=3)


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint) -> SharedLaunch:
    """One two-rank gloo launch: the TP2 model, the chained all-reduce of two ranks, then the MoE
    model at TP2 and at TP2 x EP2."""
    return SharedLaunch(2, lambda: {
        "tp2": (_run, str(reference_checkpoint("Qwen2ForCausalLM", TP2_OVERRIDES)), 2, _tp2_seqs()),
        "chain": (_chain_reduce_on_ranks, CHAIN_SHAPE),
        **{name: (_run, str(reference_checkpoint(MOE_ARCH, MOE_OVERRIDES)), *layout, _moe_seqs())
           for name, layout in MOE_LAYOUTS.items()},
        "mla-tp2": (_run, str(reference_checkpoint(MLA_ARCH, MLA_OVERRIDES)), 2, _moe_seqs()),
    }, backend="gloo")  # fmt: skip


@pytest.fixture(scope="module")
def four_rank_runs(reference_checkpoint) -> SharedLaunch:
    """One four-rank gloo launch: the chained all-reduce of four ranks, then the TP4 model."""
    return SharedLaunch(4, lambda: {
        "chain": (_chain_reduce_on_ranks, CHAIN_SHAPE),
        "tp4": (_tp4_row_parallel_calls, str(reference_checkpoint("Qwen2ForCausalLM", TP4_OVERRIDES)), _tp4_seqs()),
    }, backend="gloo")  # fmt: skip


def _loss(t):
    return torch.where(t.mask, -t.logprobs, 0.0).sum(), {}


def _run(ckpt: str, tp: int, *rest) -> dict:
    """``_run(ckpt, tp, seqs)`` or ``_run(ckpt, tp, ep, etp, seqs)``: build, forward, one train step;
    the log-probs, the gradients (whole, under HF names) and the module classes. MoE models also
    count the block's all-reduces (``tree_order_all_reduce`` calls) in the forward."""
    import mcore_zoo
    from mcore_zoo.distributed import collectives
    from mcore_zoo.kernels.vllm_ops import ReferenceKernels, use_kernels
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism

    ep, etp, seqs = (1, None, *rest) if len(rest) == 1 else rest
    parallel = Parallelism(tp=tp, ep=ep, etp=etp)
    ensure_model_parallel(parallel)
    profile = mcore_zoo.get_profile("vllm-exact").with_knobs(vllm_decode="prefill")  # head size 16
    moe_model = "Moe" in mcore_zoo.prepare(ckpt).arch_config.architecture
    overrides = {"moe_enable_routing_replay": True} if moe_model else {}
    calls = []
    original = collectives.tree_order_all_reduce
    collectives.tree_order_all_reduce = lambda t, g: calls.append(tuple(t.shape)) or original(t, g)
    try:
        with use_kernels(ReferenceKernels()):
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, parallel=parallel, load=ckpt,
                                          overrides=overrides)  # fmt: skip
            out = mcore_zoo.packed_forward(model, seqs, return_logits=False)
            forward_calls = len(calls)
            mcore_zoo.train_step(model, seqs, _loss)
    finally:
        collectives.tree_order_all_reduce = original
    kinds = {type(m).__name__ for m in model.modules()}
    grads = dict(mcore_zoo.iter_hf_weights(model, grads=True))  # whole tensors under HF names, gathered over TP / EP
    found = {"logprobs": out.logprobs, "grads": grads, "kinds": kinds, "block_reduces": forward_calls}
    if moe_model:
        found.update(_moe_rank_state(model, seqs, out.logprobs, grads))
    return found


def _moe_rank_state(model, seqs: list, logprobs: list, grads: dict) -> dict:
    """What this rank's first MoE layer holds (its experts' indices and (fc1, fc2) weights), and
    routing replay: the experts recorded in one forward replayed in the next (log-probs) and in a
    train step (``replay_routes``: gradients), each against the run without replay, bit for bit."""
    import mcore_zoo
    from mcore_zoo import routing
    from mcore_zoo.kernels.vllm_ops import ReferenceKernels, use_kernels

    moe = next(m for m in model.modules() if type(m).__name__ == "VLLMMoELayer")
    found = {"experts": list(moe.local_expert_indices),
             "expert_weights": [(e.linear_fc1.weight.detach().clone(), e.linear_fc2.weight.detach().clone())
                                for e in moe.experts.local_experts]}  # fmt: skip
    with use_kernels(ReferenceKernels()):
        with torch.no_grad(), routing.record(model) as rec:
            mcore_zoo.packed_forward(model, seqs, return_logits=False)
        with torch.no_grad(), routing.replay(model, rec.routes):
            replayed = mcore_zoo.packed_forward(model, seqs, return_logits=False)
        per_sequence = routing.unpack_routes(rec.routes, [len(s) for s in seqs])
        model.zero_grad(set_to_none=True)
        mcore_zoo.train_step(model, seqs, _loss, replay_routes=per_sequence)
    replayed_grads = dict(mcore_zoo.iter_hf_weights(model, grads=True))
    found["replay_logprobs_bitwise"] = all(torch.equal(a, b) for a, b in zip(replayed.logprobs, logprobs))
    found["replay_grads_bitwise"] = set(replayed_grads) == set(grads) and all(
        torch.equal(replayed_grads[n], g) for n, g in grads.items())  # fmt: skip
    return found


def _logprobs_match_transformers(hf, seqs: list, rank0: dict, rank1: dict) -> None:
    """Both ranks' log-probs equal, and within 2e-5 of transformers' eager model's."""
    with torch.no_grad():
        for s, a, b in zip(seqs, rank0["logprobs"], rank1["logprobs"]):
            want = torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1)
            assert torch.equal(a, b)  # every TP rank returns the same log-probs
            assert (a - want).abs().max() <= 2e-5


def _grads_match_tp1(rank0: dict, rank1: dict, single: dict, *, nonzero: bool = False) -> None:
    """The same gradients (whole, under HF names) on both ranks, each within 1e-5 of the largest of
    the single-process model's; ``nonzero``: none of them all zero."""
    assert set(rank0["grads"]) == set(single["grads"])
    for name, g in single["grads"].items():
        assert rank0["grads"][name].shape == g.shape, (name, rank0["grads"][name].shape, g.shape)
        assert torch.equal(rank0["grads"][name], rank1["grads"][name]), name
        if nonzero:
            assert g.abs().max() > 0, name
        assert (rank0["grads"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_vllm_exact_tp2_matches_transformers_and_its_tp1_gradients(reference_checkpoint, hf_reference, two_rank_runs):
    ckpt = reference_checkpoint("Qwen2ForCausalLM", TP2_OVERRIDES)
    seqs = _tp2_seqs()
    rank0, rank1 = two_rank_runs["tp2"]
    (single,) = launch(_run, 1, str(ckpt), 1, seqs)
    assert {"VLLMColumnParallelLinear", "VLLMRowParallelLinear", "VLLMAttention"} <= rank0["kinds"]
    _logprobs_match_transformers(hf_reference("Qwen2ForCausalLM", ckpt), seqs, rank0, rank1)
    _grads_match_tp1(rank0, rank1, single)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_vllm_exact_qwen3_moe_at_tp2_and_ep2_matches_transformers_and_its_tp1_gradients(
        layout, reference_checkpoint, hf_reference, two_rank_runs):  # fmt: skip
    """Qwen3-MoE (two MoE layers around a dense one) at TP2 with expert-TP 2 (every expert's
    ``[gate; up]`` rows and ``down`` columns split as vLLM's ``w13`` / ``w2`` shards) and at TP2 x EP2
    with expert-TP 1 (four whole experts per rank, the others' slots 0 as vLLM's ``expert_map``):
    every rank's log-probs the same and within the TP1 bound (2e-5) of transformers' eager model,
    each MoE layer's partial outputs summed once per forward by the block's all-reduce, and the
    gradients - router, every expert, everything else - those of the single-process ``vllm-exact``
    model (fp32: only the summation order differs). Each rank holds vLLM's rank's shard or experts
    (against the checkpoint's tensors), and routing replay of recorded experts gives the same
    log-probs and gradients bit for bit, at TP1 and at both layouts."""
    ckpt = reference_checkpoint(MOE_ARCH, MOE_OVERRIDES)
    seqs = _moe_seqs()
    rank0, rank1 = two_rank_runs[layout]
    (single,) = launch(_run, 1, str(ckpt), 1, seqs)
    assert {"VLLMMoELayer", "VLLMRouter", "VLLMRowParallelLinear"} <= rank0["kinds"]
    assert single["block_reduces"] == 0 and rank0["block_reduces"] == rank1["block_reduces"] == 2  # layers 1 and 3
    _logprobs_match_transformers(hf_reference(MOE_ARCH, ckpt), seqs, rank0, rank1)
    # each rank holds what vLLM's rank holds: at TP2 rows [r * I/2, (r + 1) * I/2) of every expert's gate
    # and up (w13 = [gate shard; up shard]) and those columns of down; at EP2 experts [4r, 4r + 4) whole
    from safetensors.torch import load_file

    hf_tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        hf_tensors.update(load_file(f))
    tp, ep, _ = MOE_LAYOUTS[layout]
    for r, rank in enumerate((rank0, rank1)):
        assert rank["experts"] == (list(range(4 * r, 4 * r + 4)) if ep == 2 else list(range(8)))
        for e, (fc1, fc2) in zip(rank["experts"], rank["expert_weights"]):
            gate, up, down = (hf_tensors[f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            rows = slice(None) if ep == 2 else slice(r * gate.shape[0] // 2, (r + 1) * gate.shape[0] // 2)
            assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]).to(fc1.dtype)), (layout, r, e)
            assert torch.equal(fc2, down[:, rows].to(fc2.dtype)), (layout, r, e)
    # routing replay: the recorded experts replayed give the same log-probs and gradients bit for bit
    assert all(rank["replay_logprobs_bitwise"] and rank["replay_grads_bitwise"] for rank in (rank0, rank1, single))
    assert any(".mlp.experts." in n for n in single["grads"]) and any(".mlp.gate." in n for n in single["grads"])
    _grads_match_tp1(rank0, rank1, single, nonzero=True)


def test_vllm_exact_deepseek_v3_at_tp2_matches_transformers_and_its_tp1_gradients(reference_checkpoint, hf_reference,
                                                                                 two_rank_runs):  # fmt: skip
    """DeepSeek-V3 at TP2 as vLLM's TP2 engine splits it: the MLA down projections' outputs whole on
    both ranks, the query up projection and the absorbed key / value weights by heads, ``o_proj``'s
    partial sums all-reduced; the MoE blocks' routed experts at expert-TP 2 with the shared expert's
    shards, routed scale and shared expert added to the partial before the block's all-reduce.
    Both ranks' log-probs the same and within 2e-5 of transformers' eager model; every gradient
    (the down projections' and the latent norms' included) that of the single-process model."""
    ckpt = reference_checkpoint(MLA_ARCH, MLA_OVERRIDES)
    seqs = _moe_seqs()
    rank0, rank1 = two_rank_runs["mla-tp2"]
    (single,) = launch(_run, 1, str(ckpt), 1, seqs)
    assert {"VLLMMLASelfAttention", "VLLMMoELayer", "VLLMRouter", "VLLMRowParallelLinear"} <= rank0["kinds"]
    assert single["block_reduces"] == 0 and rank0["block_reduces"] == rank1["block_reduces"] == 2  # layers 1 and 2
    _logprobs_match_transformers(hf_reference(MLA_ARCH, ckpt), seqs, rank0, rank1)
    assert any("kv_a_proj_with_mqa" in n for n in single["grads"]) and any("shared_experts" in n for n in single["grads"])
    _grads_match_tp1(rank0, rank1, single)


# --- TP4: the row-parallel partial sums added in NCCL's tree order (vLLM's batch-invariant mode) ---


def _chain_reduce_on_ranks(shape: tuple) -> dict:
    import torch.distributed as dist

    from mcore_zoo.distributed import collectives
    from mcore_zoo.distributed.collectives import chain_all_reduce

    rank, size = dist.get_rank(), dist.get_world_size()
    mine = _partials(shape, size)[rank].requires_grad_(True)
    out = chain_all_reduce(mine, None if size == 1 else dist.group.WORLD)
    out.backward(torch.full_like(out, 3.0))
    plain = mine.detach().float().clone()  # a plain all-reduce of the same partials, rounded once
    dist.all_reduce(plain)
    # the MoE block's reduction: Megatron-Core's all-reduce at two ranks (fp32 here: gloo), the chain from three on
    exact = mine.detach().float() if size == 2 else mine.detach().clone()
    tree = collectives.tree_order_all_reduce(exact, None if size == 1 else dist.group.WORLD)
    return {"out": out.detach(), "grad": mine.grad, "plain": plain.to(torch.bfloat16), "tree": tree}


def _partials(shape: tuple, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return (torch.randn((size, *shape), generator=g) * torch.logspace(-3, 1, shape[-1])).to(torch.bfloat16)


def _ordered(partials: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Reference: the sum as NCCL's tree adds it on a chain, written out term by term."""
    total = partials[order[-1]]
    for r in reversed(order[:-1]):
        total = partials[r] + total
    return total


def test_chain_sum_is_the_tree_order_and_no_other():
    from mcore_zoo.distributed.collectives import chain_sum

    one, tiny = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(2.0**-8, dtype=torch.bfloat16)
    p = torch.stack([one, tiny, tiny, tiny])
    assert chain_sum(p).item() == 1.015625  # 1 + (2^-8 + (2^-8 + 2^-8)) = 1 + 1.5 ulp, ties to even
    assert ((p[0] + p[1]) + (p[2] + p[3])).item() == 1.0078125  # the pairwise order
    assert (((p[0] + p[1]) + p[2]) + p[3]).item() == 1.0  # left to right
    assert torch.equal(chain_sum(p[:2]), p[0] + p[1]) and torch.equal(chain_sum(p[:2]), p[1] + p[0])


def test_chain_all_reduce_at_four_ranks_is_the_tree_order_bit_for_bit(two_rank_runs, four_rank_runs):
    shape = CHAIN_SHAPE
    ranks = four_rank_runs["chain"]
    partials = _partials(shape, 4)
    want = _ordered(partials, [0, 1, 2, 3])
    for r in ranks:
        assert torch.equal(r["out"], want)  # every rank, the same bits
        assert torch.equal(r["grad"], torch.full(shape, 3.0, dtype=torch.bfloat16))  # backward: unchanged
    # where the order matters it shows: other associations and a single rounding of the exact sum
    assert not torch.equal(want, (partials[0] + partials[1]) + (partials[2] + partials[3]))
    assert not torch.equal(want, ((partials[0] + partials[1]) + partials[2]) + partials[3])
    assert not torch.equal(want, ranks[0]["plain"])
    # two ranks: the one sum there is
    two = two_rank_runs["chain"]
    assert torch.equal(two[0]["out"], _partials(shape, 2)[0] + _partials(shape, 2)[1])
    # the MoE block's reduction (tree_order_all_reduce): the chain at four ranks, the plain sum at two
    assert all(torch.equal(r["tree"], want) for r in ranks)
    fp32 = _partials(shape, 2).float()
    assert all(torch.equal(r["tree"], fp32[0] + fp32[1]) for r in two)


def _tp4_row_parallel_calls(ckpt: str, seqs: list) -> dict:
    import mcore_zoo
    from mcore_zoo.distributed import collectives
    from mcore_zoo.kernels.vllm_ops import ReferenceKernels, use_kernels
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism

    calls = []
    original = collectives.ChainAllReduce.apply
    collectives.ChainAllReduce.apply = lambda t, g: calls.append(tuple(t.shape)) or original(t, g)
    try:
        ensure_model_parallel(Parallelism(tp=4))
        profile = mcore_zoo.get_profile("vllm-exact").with_knobs(vllm_decode="prefill")
        with use_kernels(ReferenceKernels()):
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, parallel=Parallelism(tp=4), load=ckpt)
            out = mcore_zoo.packed_forward(model, seqs, return_logits=False)
    finally:
        collectives.ChainAllReduce.apply = original
    return {"logprobs": out.logprobs, "calls": len(calls)}


def test_vllm_exact_tp4_adds_row_parallel_partials_in_tree_order(reference_checkpoint, hf_reference, four_rank_runs):
    ckpt = reference_checkpoint("Qwen2ForCausalLM", TP4_OVERRIDES)
    seqs = _tp4_seqs()
    ranks = four_rank_runs["tp4"]
    assert ranks[0]["calls"] == 2 * 2  # o_proj and down_proj of both layers
    hf = hf_reference("Qwen2ForCausalLM", ckpt)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            want = torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1)
            assert all(torch.equal(r["logprobs"][i], ranks[0]["logprobs"][i]) for r in ranks)
            assert (ranks[0]["logprobs"][i] - want).abs().max() <= 2e-5
