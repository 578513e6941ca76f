"""``vllm-exact`` under tensor parallelism on real gloo process groups (2 ranks, torch stand-ins for
vLLM's kernels): the layers split as vLLM's TP engine splits them, the partial sums all-reduced,
the logits gathered before the log-prob kernel. Log-probs against transformers' eager model and
gradients against the single-process ``vllm-exact`` model (fp32: only the summation order of the
row-parallel layers differs). Bitwise agreement with a TP2 vLLM engine needs two GPUs:
bench/gpu/vllm_exact_tp.py."""

from __future__ import annotations

import torch

from mcore_zoo.distributed import launch


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


def test_vllm_exact_tp2_matches_transformers_and_its_tp1_gradients(reference_checkpoint, hf_reference):
    from mcore_zoo.testing.common import random_sequences

    ckpt = reference_checkpoint("Qwen2ForCausalLM", {"num_hidden_layers": 2})  # q / k / v biases too
    seqs = random_sequences([23, 9, 40], 256, seed=3)
    rank0, rank1 = launch(_run, 2, str(ckpt), 2, seqs)
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
