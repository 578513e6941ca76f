"""The ``vllm-exact`` profile on the CPU, with torch stand-ins for vLLM's kernels
(:class:`~mcore_zoo.kernels.vllm_ops.ReferenceKernels`): every op's backward against autograd of the
same math (fp64 gradcheck), and the whole model's wiring - next-token log-probs against
transformers' eager model, ``train_step`` gradients against the ``hf-exact`` model's. Bitwise
agreement with vLLM's own kernels needs vLLM and a GPU: tests/gpu/test_vllm_exact_gpu.py."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError
from mcore_zoo.kernels import vllm_ops
from mcore_zoo.kernels.vllm_ops import ReferenceKernels, use_kernels
from mcore_zoo.numerics.profiles import get_profile

from ..conftest import random_sequences

#: the tiny test models have head size 16, where vLLM's decode steps tile attention differently from
#: its prefill (vllm_ops.decode_equals_prefill): the profile refuses it unless told to compute every
#: token as a prefill - which is what these CPU tests check anyway
VLLM_EXACT = get_profile("vllm-exact").with_knobs(vllm_decode="prefill")


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_every_op_has_a_correct_backward():
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    with use_kernels(ReferenceKernels()):
        _gradcheck(lambda x, w: vllm_ops.linear(x, w), rand(2, 3, 8), rand(5, 8))
        _gradcheck(lambda x, w, b: vllm_ops.linear(x, w, b), rand(4, 8), rand(5, 8), rand(5))
        for residual in (False, True):
            _gradcheck(lambda x, w: vllm_ops.rms_norm(x, w, 1e-6, residual=residual), rand(3, 2, 8), rand(8))
        cache = vllm_ops.VLLMRope.reference(torch.tensor([1.0, 0.1], dtype=torch.float64), 16, 4, torch.float64, torch.device("cpu"))
        positions = torch.tensor([0, 5, 1, 15, 7])
        _gradcheck(lambda x: vllm_ops.rotary(x, positions, cache.cos_sin_cache, 4), rand(5, 3 * 4))
        _gradcheck(vllm_ops.silu_and_mul, rand(3, 2, 10))
        targets = torch.tensor([1, -1, 6, 0])

        def head(logits):
            lp, ent = vllm_ops.token_logprobs_and_entropy(logits, targets, temperature=0.7)
            return lp.sum() + 0.3 * ent.sum()

        _gradcheck(head, rand(4, 7))
        lengths = torch.tensor([3, 5])
        for window in (None, 2):
            _gradcheck(lambda q, k, v: vllm_ops.attention(q, k, v, lengths, scale=0.4, window=window),
                       rand(8, 4, 3), rand(8, 2, 3), rand(8, 2, 3))  # fmt: skip


def test_the_log_prob_head_is_log_softmax_of_fp32_logits_at_the_targets():
    logits = torch.randn(6, 11, dtype=torch.bfloat16)
    targets = torch.tensor([3, 0, 10, -1, 7, 2])
    with use_kernels(ReferenceKernels()):
        lp, ent = vllm_ops.token_logprobs_and_entropy(logits, targets, temperature=2.0)
    want = torch.log_softmax(logits.float() / 2.0, -1)
    assert torch.equal(lp[targets >= 0], want[targets >= 0].gather(-1, targets[targets >= 0, None]).squeeze(-1))
    assert lp[3] == 0
    assert torch.allclose(ent, -(want.exp() * want).sum(-1))


def test_paged_layout_puts_every_token_in_its_sequences_blocks():
    from mcore_zoo.kernels.vllm_ops import PAGE_SIZE, _paged

    lengths = torch.tensor([3, PAGE_SIZE + 2, 1])
    k = torch.arange(int(lengths.sum()), dtype=torch.float32)[:, None, None].expand(-1, 2, 4).contiguous()
    cache_k, cache_v, table, seqused, cu = _paged(k, k + 1000, lengths)
    assert cache_k.shape == (1 + 2 + 1, PAGE_SIZE, 2, 4) and table.dtype == torch.int32 and table.shape == (3, 2)
    for i, n in enumerate(lengths.tolist()):
        for j in range(n):
            block = int(table[i, j // PAGE_SIZE])
            assert cache_k[block, j % PAGE_SIZE, 0, 0] == int(cu[i]) + j
            assert cache_v[block, j % PAGE_SIZE, 0, 0] == int(cu[i]) + j + 1000
    assert seqused.tolist() == lengths.tolist() and cu.tolist() == [0, 3, 3 + PAGE_SIZE + 2, 4 + PAGE_SIZE + 2]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_the_model_wiring_matches_transformers_and_hf_exact_gradients(arch, reference_checkpoint, hf_reference, mpu):
    """fp32 with the torch stand-ins: every op of the vllm-exact layer is at its place (first-layer
    Triton norm, fused norms, q / k norm, RoPE hook, paged attention, SwiGLU, output GEMM,
    log-softmax head), so the log-probs equal HF eager's and the gradients hf-exact's."""
    ckpt = reference_checkpoint(arch, {"num_hidden_layers": 2})
    hf = hf_reference(arch, ckpt)
    vocab = hf.config.vocab_size
    seqs = random_sequences([9, 4, 13], vocab)
    with torch.no_grad():
        want = [torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1) for s in seqs]

    def loss_fn(t):
        return torch.where(t.mask, -t.logprobs - 0.1 * t.entropy, 0.0).sum(), {}

    grads = {}
    for numerics in ("vllm-exact", "hf-exact"):
        with use_kernels(ReferenceKernels()):
            profile = VLLM_EXACT if numerics == "vllm-exact" else numerics
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, load=ckpt)
            out = mcore_zoo.packed_forward(model, seqs)
            mcore_zoo.train_step(model, seqs, loss_fn, compute_entropy=True)
        grads[numerics] = {n: p.grad.clone() for n, p in model.named_parameters()}
        for got, ref in zip(out.logprobs, want):
            assert (got - ref).abs().max() <= 2e-5, numerics
        if numerics == "vllm-exact":
            kinds = {type(m).__name__ for m in model.modules()}
            assert {"VLLMRMSNorm", "VLLMResidualRMSNorm", "VLLMColumnParallelLinear", "VLLMRowParallelLinear",
                    "VLLMAttention", "VLLMMLP"} <= kinds  # fmt: skip
            assert type(model.decoder.layers[0].input_layernorm).__name__ == "VLLMRMSNorm"
            assert type(model.decoder.layers[1].input_layernorm).__name__ == "VLLMResidualRMSNorm"
    for name, g in grads["hf-exact"].items():
        assert (grads["vllm-exact"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_vllm_exact_refuses_what_it_does_not_reproduce(reference_checkpoint, mpu):
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 2})
    with pytest.raises(ZooError, match="CUDA|VLLM_BATCH_INVARIANT"):  # vLLM's kernels, not stand-ins
        mcore_zoo.build_model(ckpt, backend="portable", numerics=VLLM_EXACT)
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="backend 'local' or 'portable'"):
        mcore_zoo.build_model(ckpt, backend="te", numerics=VLLM_EXACT)
    moe = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2})
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="dense decoders"):
        mcore_zoo.build_model(moe, backend="portable", numerics=VLLM_EXACT)
    # head size 16: vLLM's decode steps are not its prefill there; refused unless accepted by the knob
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="head size 16.*vllm_decode='prefill'"):
        mcore_zoo.build_model(ckpt, backend="portable", numerics="vllm-exact")
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="make_vocab_size_divisible_by"):
        mcore_zoo.build_model(ckpt, backend="portable", numerics=VLLM_EXACT, make_vocab_size_divisible_by=96)
    wide = reference_checkpoint("Qwen3ForCausalLM", {"num_hidden_layers": 1, "head_dim": 128})
    with use_kernels(ReferenceKernels()):  # head size 128: decode steps are prefill's, accepted as it is
        mcore_zoo.build_model(wide, backend="portable", numerics="vllm-exact")
    assert not vllm_ops.decode_equals_prefill(64) and vllm_ops.decode_equals_prefill(80)


def test_the_engines_fused_log_prob_kernel_gives_the_value_and_log_softmax_the_gradient():
    """With a kernel table that has vLLM's fused token log-prob kernel, the head returns that
    kernel's bits and keeps the log-softmax's gradient."""

    class Fused(ReferenceKernels):
        def token_logprobs(self, logits, targets):
            return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0] + 0.25  # distinguishable

    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([1, 4, -1, 0, 8])
    with use_kernels(ReferenceKernels()):
        plain, _ = vllm_ops.token_logprobs_and_entropy(logits, targets)
        (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    with use_kernels(Fused()):
        fused, _ = vllm_ops.token_logprobs_and_entropy(logits, targets)
        (g_fused,) = torch.autograd.grad(fused.sum(), logits)
    valid = targets >= 0
    want = Fused().token_logprobs(logits.detach(), targets.clamp(min=0)).to(fused.dtype)
    assert torch.equal(fused[valid], want[valid])  # the kernel's bits, not the log-softmax's
    assert not torch.allclose(fused[valid], plain[valid])
    assert fused[~valid].abs().sum() == 0
    assert torch.equal(g_fused, g_plain)
