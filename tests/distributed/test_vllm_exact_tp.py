"""``vllm-exact`` under tensor parallelism on real gloo process groups (2 ranks, torch stand-ins for
vLLM's kernels): the layers split as vLLM's TP engine splits them, the partial sums all-reduced,
the logits gathered before the log-prob kernel. Log-probs against transformers' eager model and
gradients against the single-process ``vllm-exact`` model (fp32: only the summation order of the
row-parallel layers differs). Bitwise agreement with a TP2 vLLM engine needs two GPUs:
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


def _tp2_seqs() -> list:
    from mcore_zoo.testing.common import random_sequences

    return random_sequences([23, 9, 40], 256, seed=3)


def _tp4_seqs() -> list:
    from mcore_zoo.testing.common import random_sequences

    return random_sequences([23, 9], 256, seed=3)


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint) -> SharedLaunch:
    """One two-rank gloo launch: the TP2 model, then the chained all-reduce of two ranks."""
    return SharedLaunch(2, lambda: {
        "tp2": (_run, str(reference_checkpoint("Qwen2ForCausalLM", TP2_OVERRIDES)), 2, _tp2_seqs()),
        "chain": (_chain_reduce_on_ranks, CHAIN_SHAPE),
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


def _run(ckpt: str, tp: int, seqs: list) -> dict:
    import mcore_zoo
    from mcore_zoo.kernels.vllm_ops import ReferenceKernels, use_kernels
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism

    ensure_model_parallel(Parallelism(tp=tp))
    profile = mcore_zoo.get_profile("vllm-exact").with_knobs(vllm_decode="prefill")  # head size 16
    with use_kernels(ReferenceKernels()):
        model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, parallel=Parallelism(tp=tp), load=ckpt)
        out = mcore_zoo.packed_forward(model, seqs, return_logits=False)
        mcore_zoo.train_step(model, seqs, _loss)
    kinds = {type(m).__name__ for m in model.modules()}
    grads = dict(mcore_zoo.iter_hf_weights(model, grads=True))  # whole tensors under HF names, gathered over TP
    return {"logprobs": out.logprobs, "grads": grads, "kinds": kinds}


def test_vllm_exact_tp2_matches_transformers_and_its_tp1_gradients(reference_checkpoint, hf_reference, two_rank_runs):
    ckpt = reference_checkpoint("Qwen2ForCausalLM", TP2_OVERRIDES)
    seqs = _tp2_seqs()
    rank0, rank1 = two_rank_runs["tp2"]
    (single,) = launch(_run, 1, str(ckpt), 1, seqs)
    assert {"VLLMColumnParallelLinear", "VLLMRowParallelLinear", "VLLMAttention"} <= rank0["kinds"]
    hf = hf_reference("Qwen2ForCausalLM", ckpt)
    with torch.no_grad():
        for s, a, b in zip(seqs, rank0["logprobs"], rank1["logprobs"]):
            want = torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1)
            assert torch.equal(a, b)  # every TP rank returns the same log-probs
            assert (a - want).abs().max() <= 2e-5
    assert set(rank0["grads"]) == set(single["grads"])
    for name, g in single["grads"].items():
        assert rank0["grads"][name].shape == g.shape, (name, rank0["grads"][name].shape, g.shape)
        assert torch.equal(rank0["grads"][name], rank1["grads"][name]), name
        assert (rank0["grads"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name


# --- TP4: the row-parallel partial sums added in NCCL's tree order (vLLM's batch-invariant mode) ---


def _chain_reduce_on_ranks(shape: tuple) -> dict:
    import torch.distributed as dist

    from mcore_zoo.distributed.collectives import chain_all_reduce

    rank, size = dist.get_rank(), dist.get_world_size()
    mine = _partials(shape, size)[rank].requires_grad_(True)
    out = chain_all_reduce(mine, None if size == 1 else dist.group.WORLD)
    out.backward(torch.full_like(out, 3.0))
    plain = mine.detach().float().clone()  # a plain all-reduce of the same partials, rounded once
    dist.all_reduce(plain)
    return {"out": out.detach(), "grad": mine.grad, "plain": plain.to(torch.bfloat16)}


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
