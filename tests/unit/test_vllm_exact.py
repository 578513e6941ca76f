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
        for neox in (True, False):  # NeoX halves, GPT-J pairs; the whole head and a rotated part of it
            _gradcheck(lambda x, n=neox: vllm_ops.rotary(x, positions, cache.cos_sin_cache, 4, neox=n), rand(5, 3 * 4))
            _gradcheck(lambda x, n=neox: vllm_ops.rotary(x, positions, cache.cos_sin_cache, 6, neox=n), rand(5, 2 * 6))
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
    cache_k, cache_v, table, seqused, cu = _paged(k, k + 1000, lengths=lengths)
    assert cache_k.shape == (1 + 2 + 1, PAGE_SIZE, 2, 4) and table.dtype == torch.int32 and table.shape == (3, 2)
    for i, n in enumerate(lengths.tolist()):
        for j in range(n):
            block = int(table[i, j // PAGE_SIZE])
            assert cache_k[block, j % PAGE_SIZE, 0, 0] == int(cu[i]) + j
            assert cache_v[block, j % PAGE_SIZE, 0, 0] == int(cu[i]) + j + 1000
    assert seqused.tolist() == lengths.tolist() and cu.tolist() == [0, 3, 3 + PAGE_SIZE + 2, 4 + PAGE_SIZE + 2]


def _against_hf_exact(ckpt, seqs, want, loss_fn, **train_kwargs):
    """Build ``ckpt`` as ``vllm-exact`` (torch stand-ins) and as ``hf-exact``: each one's packed
    log-probs within 2e-5 of transformers' (``want``), one ``train_step`` each; returns
    ``({profile: {parameter: gradient}}, the vllm-exact model)``."""
    grads, vllm_model = {}, None
    for numerics in ("vllm-exact", "hf-exact"):
        with use_kernels(ReferenceKernels()):
            profile = VLLM_EXACT if numerics == "vllm-exact" else numerics
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, load=ckpt)
            out = mcore_zoo.packed_forward(model, seqs)
            mcore_zoo.train_step(model, seqs, loss_fn, **train_kwargs)
        grads[numerics] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for got, ref in zip(out.logprobs, want):
            assert (got - ref).abs().max() <= 2e-5, numerics
        if numerics == "vllm-exact":
            vllm_model = model
    return grads, vllm_model


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

    grads, model = _against_hf_exact(ckpt, seqs, want, loss_fn, compute_entropy=True)
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"VLLMRMSNorm", "VLLMResidualRMSNorm", "VLLMColumnParallelLinear", "VLLMRowParallelLinear",
            "VLLMAttention", "VLLMMLP"} <= kinds  # fmt: skip
    assert type(model.decoder.layers[0].input_layernorm).__name__ == "VLLMRMSNorm"
    assert type(model.decoder.layers[1].input_layernorm).__name__ == "VLLMResidualRMSNorm"
    assert set(grads["vllm-exact"]) == {n for n, _ in model.named_parameters()}
    for name, g in grads["hf-exact"].items():
        assert (grads["vllm-exact"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_vllm_exact_refuses_what_it_does_not_reproduce(reference_checkpoint, mpu):
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 2})
    with pytest.raises(ZooError, match="CUDA|VLLM_BATCH_INVARIANT"):  # vLLM's kernels, not stand-ins
        mcore_zoo.build_model(ckpt, backend="portable", numerics=VLLM_EXACT)
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="backend 'local' or 'portable'"):
        mcore_zoo.build_model(ckpt, backend="te", numerics=VLLM_EXACT)
    moe = reference_checkpoint("MixtralForCausalLM", {"num_hidden_layers": 2})  # MoE: Qwen3-MoE's block only
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match="MoE block of Qwen3MoeForCausalLM, DeepseekV3ForCausalLM only"):
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
    with use_kernels(Fused()):  # an engine on its V1 model runner: the fp32 log-softmax's value
        v1, _ = vllm_ops.token_logprobs_and_entropy(logits, targets, runner="v1")
    assert torch.equal(v1, plain)
    with pytest.raises(ValueError, match="runner"):
        vllm_ops.token_logprobs_and_entropy(logits, targets, runner="fused")


def test_the_head_follows_the_engines_model_runner(monkeypatch, reference_checkpoint):
    """vLLM 0.26 runs dense models and a few MoE architectures on its V2 model runner and other
    MoE models (Qwen3-MoE) on V1, unless VLLM_USE_V2_MODEL_RUNNER says otherwise; a vllm-exact
    model's head follows the runner its engine takes, any other model has none."""
    from mcore_zoo.distributed.forward import uses_vllm_logprob_head

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert vllm_ops.engine_model_runner("LlamaForCausalLM", is_moe=False) == "v2"
    assert vllm_ops.engine_model_runner("Qwen3MoeForCausalLM", is_moe=True) == "v1"
    assert vllm_ops.engine_model_runner("Qwen2MoeForCausalLM", is_moe=True) == "v2"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert vllm_ops.engine_model_runner("Qwen3MoeForCausalLM", is_moe=True) == "v2"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert vllm_ops.engine_model_runner("LlamaForCausalLM", is_moe=False) == "v1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "yes")  # vLLM itself fails on it: refused by name
    with pytest.raises(ZooError, match="VLLM_USE_V2_MODEL_RUNNER"):
        vllm_ops.engine_model_runner("LlamaForCausalLM", is_moe=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    moe = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 1, "head_dim": 128, "mlp_only_layers": []})
    dense = reference_checkpoint("Qwen3ForCausalLM", {"num_hidden_layers": 1, "head_dim": 128})
    with use_kernels(ReferenceKernels()):
        heads = [uses_vllm_logprob_head(mcore_zoo.handle_of(mcore_zoo.build_model(c, backend="portable", numerics=n)))
                 for c, n in ((moe, "vllm-exact"), (dense, "vllm-exact"), (moe, "default"))]  # fmt: skip
    assert heads == ["v1", "v2", None]


# ---------------------------------------------------------------------------- multi-head latent attention
def _deepseek_attention():
    """transformers' ``DeepseekV3Attention`` (query LoRA, YaRN, interleaved RoPE, sdpa) in fp64 with
    random weights, and its rotary embedding."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                              rope_interleave=True, max_position_embeddings=256,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 64, "mscale": 1.0,
                                               "mscale_all_dim": 1.0})  # fmt: skip
    config._attn_implementation = "sdpa"  # in fp64 throughout (eager takes its softmax in fp32)
    torch.manual_seed(5)
    attn = DeepseekV3Attention(config, 0).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return config, attn, DeepseekV3RotaryEmbedding(config)


def test_absorbed_mla_attention_is_transformers_deepseek_v3_attention():
    """The absorbed form (``vllm_ops.mla_absorbed_attention`` on ``W_UK`` / ``W_UV`` cut from
    ``kv_b_proj``, the stand-in kernels) on a pack of two sequences equals transformers'
    ``DeepseekV3Attention`` run on each sequence alone (its up-projected keys and values, sdpa),
    fp64; the query / latent steps before the attention are transformers' own modules."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    config, attn, rotary = _deepseek_attention()
    heads, nope, rope, v = 4, 8, 4, 6
    lengths = [7, 3]
    x = torch.randn(sum(lengths), 64, dtype=torch.float64)
    want, parts, start = [], {"q_nope": [], "q_pe": [], "kv_c": [], "k_pe": []}, 0
    for n in lengths:
        h = x[start : start + n][None]
        position_ids = torch.arange(n)[None]
        cos, sin = (t.double() for t in rotary(h, position_ids))
        mask = torch.full((1, 1, n, n), float("-inf"), dtype=torch.float64).triu(1)
        want.append(attn(h, (cos, sin), mask)[0][0])
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h))).view(1, n, heads, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        kv_c, k_pe = attn.kv_a_proj_with_mqa(h).split([16, rope], dim=-1)
        q_pe, k_pe = apply_rotary_pos_emb_interleave(q_pe, k_pe.view(1, 1, n, rope), cos, sin)
        parts["q_nope"].append(q_nope[0].transpose(0, 1))
        parts["q_pe"].append(q_pe[0].transpose(0, 1))
        parts["kv_c"].append(attn.kv_a_layernorm(kv_c)[0])
        parts["k_pe"].append(k_pe[0, 0])
        start += n
    w_uk_t, w_uv = vllm_ops.mla_absorbed_weights(attn.kv_b_proj.weight, heads, nope, v)
    with use_kernels(ReferenceKernels()):
        out = vllm_ops.mla_absorbed_attention(*(torch.cat(parts[k]) for k in ("q_nope", "q_pe", "kv_c", "k_pe")),
                                              w_uk_t, w_uv, torch.tensor(lengths), scale=attn.scaling)  # fmt: skip
    got = attn.o_proj(out.reshape(out.shape[0], -1))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-12, atol=1e-12)
    with pytest.raises(ZooError, match="is not 4 heads"):
        vllm_ops.mla_absorbed_weights(attn.kv_b_proj.weight, 4, nope, v + 1)


def test_gpt_j_rotary_is_transformers_interleaved_deepseek_rope():
    """``vllm_ops.rotary(neox=False)`` (vLLM's GPT-J-style RoPE, the one it applies to DeepSeek's
    ``q_pe`` / ``k_pe``) on transformers' YaRN cos / sin equals transformers'
    ``apply_rotary_pos_emb_interleave`` bit for bit (fp64) once its output is put back in the
    interleaved order (transformers returns the rotated pairs as halves; the attention scores,
    dot products over both, are the same)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    _, _, rotary_embedding = _deepseek_attention()
    n, heads, d = 9, 3, 4
    positions = torch.arange(n)
    cos, sin = (t.double()[0] for t in rotary_embedding(torch.zeros(1, n, 1, dtype=torch.float64), positions[None]))
    cache = torch.cat([cos[:, : d // 2], sin[:, : d // 2]], dim=-1)  # transformers' halves are the frequencies twice
    q = torch.randn(n, heads, d, dtype=torch.float64)
    k = torch.randn(n, 1, d, dtype=torch.float64)
    want_q, want_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    with use_kernels(ReferenceKernels()):
        got_q = vllm_ops.rotary(q.reshape(n, -1), positions, cache, d, neox=False).view(n, heads, d)
        got_k = vllm_ops.rotary(k.reshape(n, -1), positions, cache, d, neox=False).view(n, 1, d)
    assert torch.equal(got_q[..., order], want_q[0].transpose(0, 1))
    assert torch.equal(got_k[..., order], want_k[0].transpose(0, 1))
    assert not torch.equal(got_q, want_q[0].transpose(0, 1))  # the layouts do differ


def test_absorbed_mla_attention_has_a_correct_backward():
    """fp64 gradcheck of every input of the absorbed MLA attention (queries, latents, both up
    projection parts) over a pack of two sequences; the up projection's gradient reaches it through
    ``mla_absorbed_weights``' views."""
    g = torch.Generator().manual_seed(6)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    lengths = torch.tensor([3, 2])
    with use_kernels(ReferenceKernels()):
        _gradcheck(lambda qn, qp, kc, kp, wk, wv: vllm_ops.mla_absorbed_attention(qn, qp, kc, kp, wk, wv, lengths, scale=0.4),
                   rand(5, 2, 3), rand(5, 2, 2), rand(5, 4), rand(5, 2), rand(2, 3, 4), rand(2, 4, 3))  # fmt: skip
        fixed = [rand(*shape).detach() for shape in ((5, 2, 3), (5, 2, 2), (5, 4), (5, 2))]
        _gradcheck(lambda w: vllm_ops.mla_absorbed_attention(*fixed, *vllm_ops.mla_absorbed_weights(w, 2, 3, 3), lengths,
                                                             scale=0.4), rand(2 * (3 + 3), 4))  # fmt: skip


# ---------------------------------------------------------------------------- mixture of experts
def test_every_moe_op_has_a_correct_backward():
    """Router top-k (with and without renormalisation, with replayed routes), the two grouped expert
    GEMMs with the activation and the routing weight, and the sum over k: fp64 gradcheck."""
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    with use_kernels(ReferenceKernels()):
        for renormalize in (True, False):
            _gradcheck(lambda x, r=renormalize: vllm_ops.moe_topk_softmax(x, 2, renormalize=r)[0], rand(5, 6))
        routes = torch.tensor([[0, 1], [5, 2], [3, 4], [1, 0], [2, 5]])
        _gradcheck(lambda x: vllm_ops.moe_topk_softmax(x, 2, renormalize=True, routes=routes)[0], rand(5, 6))
        ids = torch.tensor([[0, 2], [3, 1], [2, 0], [1, 3]], dtype=torch.int32)  # 4 experts, top-2
        _gradcheck(lambda x, w13, w2, s: vllm_ops.fused_experts(x, w13, w2, s, ids),
                   rand(4, 6), rand(4, 2 * 3, 6), rand(4, 6, 3), rand(4, 2))  # fmt: skip
        _gradcheck(vllm_ops.moe_sum, rand(3, 4, 5))


def test_the_router_keeps_the_kernels_weights_where_replayed_routes_agree():
    logits = torch.randn(6, 8, dtype=torch.bfloat16)
    with use_kernels(ReferenceKernels()):
        weights, ids = vllm_ops.moe_topk_softmax(logits, 2, renormalize=True)
        routes = ids.clone()
        routes[1] = torch.tensor([7, 3]) if ids[1].tolist() != [7, 3] else torch.tensor([0, 1])
        replayed, replayed_ids = vllm_ops.moe_topk_softmax(logits, 2, renormalize=True, routes=routes.long())
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(replayed_ids, routes.to(torch.int32))
    keep = torch.arange(6) != 1
    assert torch.equal(replayed[keep], weights[keep])
    want = torch.softmax(logits[1].float(), -1)[routes[1].long()]
    assert torch.allclose(replayed[1], want / want.sum())
    assert torch.all(weights[:, 0] >= weights[:, 1])  # the kernel's slot order: descending weight


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_grouped_sigmoid_router_chooses_and_weighs_as_transformers_deepseek_v3(renormalize):
    """The stand-in of vLLM's ``grouped_topk`` (sigmoid scores, score-correction bias for the choice,
    expert groups) against transformers' ``DeepseekV3TopkRouter`` on the same fp32 logits: the same
    experts, weights within 1e-6 (the kernel's sigmoid is ``0.5 tanh(x / 2) + 0.5``: its error is a few
    fp32 ulps of 0.5, absolute, where ``1 / (1 + exp(-x))`` keeps small scores to their own ulps), the
    routed scale left to the block's output, slots in descending biased score."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=3,
                              norm_topk_prob=renormalize, routed_scaling_factor=2.5)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.3)
    x = torch.randn(64, 32, generator=g)
    logits, hf_weights, hf_ids = router(x)
    with use_kernels(ReferenceKernels()):
        weights, ids = vllm_ops.moe_grouped_topk(logits, 4, num_groups=8, topk_group=3, renormalize=renormalize,
                                                 bias=router.e_score_correction_bias)  # fmt: skip
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    order, hf_order = ids.long().sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    ours = weights.gather(1, order.indices) * 2.5
    theirs = hf_weights.gather(1, hf_order.indices)
    assert (ours - theirs).abs().max() < 1e-6
    biased = torch.sigmoid(logits) + router.e_score_correction_bias
    chosen = biased.gather(1, ids.long())
    assert torch.all(chosen[:, :-1] >= chosen[:, 1:])
    groups = ids.long() // 4  # 32 experts in 8 groups
    assert all(len(set(row.tolist())) <= 3 for row in groups)


def test_the_grouped_router_has_a_correct_backward_and_replays_routes():
    """fp64 gradcheck of the grouped router's weights (with and without renormalisation, with
    replayed routes); replayed routes that are the kernel's choice keep its weights bit for bit,
    others get the renormalised unbiased scores; bad groupings are refused naming the numbers."""
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(12, generator=g) * 0.2

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    with use_kernels(ReferenceKernels()):
        for renormalize in (True, False):
            _gradcheck(lambda x, r=renormalize: vllm_ops.moe_grouped_topk(x, 3, num_groups=4, topk_group=2, renormalize=r,
                                                                          bias=bias)[0], rand(5, 12))  # fmt: skip
        routes = torch.tensor([[0, 1, 2], [11, 5, 3], [3, 4, 5], [1, 0, 9], [2, 7, 6]])
        _gradcheck(lambda x: vllm_ops.moe_grouped_topk(x, 3, num_groups=4, topk_group=2, renormalize=True, bias=bias,
                                                       routes=routes)[0], rand(5, 12))  # fmt: skip
        logits = torch.randn(6, 12, dtype=torch.bfloat16, generator=g)
        weights, ids = vllm_ops.moe_grouped_topk(logits, 3, num_groups=4, topk_group=2, renormalize=True, bias=bias)
        replay = ids.clone().long()
        replay[2] = torch.tensor([11, 0, 5]) if ids[2].tolist() != [11, 0, 5] else torch.tensor([1, 2, 3])
        replayed, replayed_ids = vllm_ops.moe_grouped_topk(logits, 3, num_groups=4, topk_group=2, renormalize=True,
                                                           bias=bias, routes=replay)  # fmt: skip
        assert torch.equal(replayed_ids, replay.to(torch.int32))
        keep = torch.arange(6) != 2
        assert torch.equal(replayed[keep], weights[keep])
        want = torch.sigmoid(logits[2].float())[replay[2]]
        assert torch.allclose(replayed[2], want / want.sum(), rtol=1e-6)
        with pytest.raises(ZooError, match="12 experts in 5 groups"):
            vllm_ops.moe_grouped_topk(logits, 3, num_groups=5, topk_group=2, renormalize=True, bias=bias)
        with pytest.raises(ZooError, match="top-7 of the 6 experts"):
            vllm_ops.moe_grouped_topk(logits, 7, num_groups=4, topk_group=2, renormalize=True, bias=bias)


def test_qwen3_moe_matches_hf_exact_and_every_expert_gets_a_gradient(reference_checkpoint, hf_reference, mpu):
    """fp32 with the torch stand-ins: the vllm-exact Qwen3-MoE (vLLM's router and fused experts on
    mcore's router and sequential experts' parameters, a dense MLP layer among the MoE layers) gives
    HF eager's log-probs and hf-exact's gradients up to fp32 rounding (both compute the same
    softmax top-k and expert sums in another op order: a few fp32 ulps of the activations; the
    bounds are the dense decoders' above, 2e-5 on log-probs and 1e-5 of the largest gradient;
    measured: 1e-6 and 2e-6); every expert's fc1 / fc2 and the router weight get a gradient."""
    grads, model = _moe_against_transformers(reference_checkpoint, hf_reference, "Qwen3MoeForCausalLM", {"num_hidden_layers": 3})
    layers = model.decoder.layers
    assert type(layers[0].mlp).__name__ == "VLLMMoELayer" and type(layers[0].mlp.router).__name__ == "VLLMRouter"
    assert type(layers[1].mlp).__name__ == "VLLMMLP"  # mlp_only_layers: [1]
    assert type(layers[0].input_layernorm).__name__ == "VLLMRMSNorm"
    expert_params = [n for n, _ in model.named_parameters() if ".experts." in n or ".router." in n]
    assert expert_params and all(n in grads and grads[n].abs().sum() > 0 for n in expert_params)


def _moe_against_transformers(reference_checkpoint, hf_reference, arch: str, overrides: dict) -> tuple:
    """An MoE checkpoint of ``arch`` as ``vllm-exact`` and ``hf-exact`` (torch stand-ins, fp32) on a
    pack of 11, 6 and 15 tokens: both within 2e-5 of transformers' eager log-probs, the same
    parameters with gradients, ``vllm-exact``'s within 1e-5 of ``hf-exact``'s largest. Returns
    ``(vllm-exact's gradients, the vllm-exact model)``."""
    ckpt = reference_checkpoint(arch, overrides)
    hf = hf_reference(arch, ckpt)
    seqs = random_sequences([11, 6, 15], hf.config.vocab_size)
    with torch.no_grad():
        want = [torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1) for s in seqs]

    def loss_fn(t):
        return torch.where(t.mask, -t.logprobs, 0.0).sum(), {}

    grads, model = _against_hf_exact(ckpt, seqs, want, loss_fn)
    assert set(grads["vllm-exact"]) == set(grads["hf-exact"])
    for name, g in grads["hf-exact"].items():
        assert (grads["vllm-exact"][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name
    return grads["vllm-exact"], model


def test_deepseek_v3_matches_transformers_and_hf_exact_gradients(reference_checkpoint, hf_reference, mpu):
    """fp32 with the torch stand-ins: the vllm-exact DeepSeek-V3 (vLLM's MLA layer - fused q / kv
    down GEMM, latent norms, GPT-J RoPE on a YaRN cache, absorbed attention - its grouped sigmoid
    router with the score-correction bias, routed scale on the output and the shared expert added,
    a dense first layer) gives transformers' eager log-probs and hf-exact's gradients up to fp32
    rounding (the dense decoders' bounds: 2e-5 on log-probs, 1e-5 of the largest gradient). SBHD
    (a batch of equal lengths) gives the THD pack's values. Every parameter gets a gradient (the
    score-correction bias is a buffer: it only chooses)."""
    grads, model = _moe_against_transformers(reference_checkpoint, hf_reference, "DeepseekV3ForCausalLM",
                                             {"num_hidden_layers": 3, "n_group": 4, "topk_group": 2})  # fmt: skip
    vocab = model.vocab_size
    layers = model.decoder.layers
    assert type(layers[0].self_attention).__name__ == "VLLMMLASelfAttention"
    assert type(layers[0].mlp).__name__ == "VLLMMLP" and type(layers[1].mlp).__name__ == "VLLMMoELayer"  # first_k_dense_replace
    assert layers[1].mlp.router.groups == (4, 2) and layers[1].mlp.shared_experts is not None
    assert set(grads) == {n for n, _ in model.named_parameters()}
    with use_kernels(ReferenceKernels()), torch.no_grad():  # SBHD: positions 0 .. s - 1 of each row
        batch = torch.stack(random_sequences([9, 9], vocab, seed=3))
        sbhd = model(batch, torch.arange(9)[None].expand(2, -1), None)
        thd = mcore_zoo.packed_forward(model, list(batch), return_logits=True, return_logprobs=False).logits
    for row, logits in zip(sbhd, thd):
        assert torch.allclose(row, logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch, reason", [
    ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM only"),
    ("GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLM only"),
    ("GptOssForCausalLM", "gpt-oss"),
    ("Qwen2MoeForCausalLM", "shared-expert"),
    ("MixtralForCausalLM", "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM only"),
])  # fmt: skip
def test_vllm_exact_refuses_moe_it_does_not_reproduce_by_name(arch, reason, reference_checkpoint, mpu):
    ckpt = reference_checkpoint(arch, {"num_hidden_layers": 2})
    with use_kernels(ReferenceKernels()), pytest.raises(ZooError, match=reason):
        mcore_zoo.build_model(ckpt, backend="portable", numerics=VLLM_EXACT)


def test_vllm_exact_moe_takes_the_engines_layouts_and_refuses_others(reference_checkpoint, mpu):
    """Accepted: vLLM's engine layouts at data parallel 1 - TP N with expert-TP N (also left to
    follow TP) and TP N with EP N at expert-TP 1. Refused naming the three sizes: any other
    split of the experts, and sequence parallelism; grouped experts are refused too."""
    from types import SimpleNamespace

    from mcore_zoo.build import prepare
    from mcore_zoo.specs.vllm_exact import check_moe_supported

    arch = prepare(str(reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2}))).arch_config

    def layout(tp, ep=1, etp=None, **more):
        return SimpleNamespace(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp, **more)  # fmt: skip

    for tp, ep, etp in [(1, 1, 1), (2, 1, None), (2, 1, 2), (2, 2, 1), (4, 4, 1), (4, 1, 4)]:
        check_moe_supported(arch, layout(tp, ep, etp), VLLM_EXACT)
    check_moe_supported(arch, SimpleNamespace(), VLLM_EXACT)  # no sizes at all: TP1
    for tp, ep, etp in [(1, 2, 1), (1, 1, 2), (2, 1, 1), (2, 2, 2), (4, 2, 1), (2, 4, 1)]:
        with pytest.raises(ZooError, match=f"got tensor_model_parallel_size={tp}, expert_model_parallel_size={ep},"
                                           f" expert_tensor_parallel_size={etp}"):  # fmt: skip
            check_moe_supported(arch, layout(tp, ep, etp), VLLM_EXACT)
    with pytest.raises(ZooError, match="sequence parallelism"):
        check_moe_supported(arch, layout(2, sequence_parallel=True), VLLM_EXACT)
    with pytest.raises(ZooError, match="grouped_experts=False"):
        check_moe_supported(arch, SimpleNamespace(), VLLM_EXACT.with_knobs(grouped_experts=True))


@pytest.mark.parametrize("config_file", ["deepseek-v3.json", "kimi-k2-instruct.json"])
def test_vllm_exact_refuses_the_widths_where_vllm_switches_kernels_by_token_count(config_file):
    """At DeepSeek-V3's and Kimi-K2's published widths vLLM 0.26 runs the fused q / kv down GEMM
    (2112 x 7168) and the router GEMM with kernels chosen by the step's token count: refused, naming
    both. The same configs at hidden 1024 (the GPU test's width) have neither and are accepted at TP8."""
    import json
    from types import SimpleNamespace

    from mcore_zoo.specs.vllm_exact import check_supported, token_count_kernels

    from ..conftest import CONFIGS

    raw = json.loads((CONFIGS / config_file).read_text())
    arch = mcore_zoo.lookup(raw).config_from_hf(raw)
    found = token_count_kernels(arch)
    assert len(found) == 2 and "2112 x 7168" in found[0] and "x 7168: dsv3_router_gemm" in found[1]
    with pytest.raises(ZooError, match="dsv3_fused_a_gemm or cuBLAS.*dsv3_router_gemm"):
        check_supported(arch, SimpleNamespace(), VLLM_EXACT)
    narrow = mcore_zoo.lookup(raw).config_from_hf(dict(raw, hidden_size=1024))
    assert token_count_kernels(narrow) == []
    check_supported(narrow, SimpleNamespace(tensor_model_parallel_size=8, gated_linear_unit=True,
                                            activation_func=torch.nn.functional.silu), VLLM_EXACT)  # vLLM TP8


def _moe_block_inputs(dtype, n=37, hidden=32, inter=24, experts=8, k=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.3).to(dtype)
    logits = torch.randn(n, experts, generator=g).to(dtype)
    return x, w13, w2, logits


def test_moe_block_partials_are_the_engines_at_tp2_and_ep2():
    """bf16, torch stand-ins: the block's partial outputs at the layouts of vLLM's TP2 engine, added
    as its all-reduce adds two partials (one bf16 rounding).

    EP2: rank r holds experts ``[4r, 4r + 4)`` (vLLM's ``linear`` placement) and computes the k
    slots of every token with the others' slots 0 (``expert_map`` -1); its ``moe_sum`` is the sum of
    its own slots, so the block output is ``moe_sum(y of rank 0's slots) + moe_sum(y of rank 1's)``
    with ``y`` the TP1 per-slot outputs bit for bit. TP2: rank r holds rows ``[rI/2, (r+1)I/2)`` of
    gate and up (``w13`` = ``[gate shard; up shard]``) and those columns of down. Both differ from
    the TP1 block in the last bits (the order is observable) and agree with it to bf16 rounding."""
    from mcore_zoo.kernels.vllm_ops import MOE_BATCH_INVARIANT_CONFIG

    x, w13, w2, logits = _moe_block_inputs(torch.bfloat16)
    table = ReferenceKernels()
    with use_kernels(table):
        weights, ids = vllm_ops.moe_topk_softmax(logits, 3, renormalize=True)
        whole = vllm_ops.fused_experts(x, w13, w2, weights, ids)
        n, k = ids.shape
        h = table.moe_gemm(x, w13, ids, None, False, MOE_BATCH_INVARIANT_CONFIG)
        y = table.moe_gemm(table.silu_and_mul(h.reshape(n * k, -1)), w2, ids, weights, True, MOE_BATCH_INVARIANT_CONFIG)
        assert torch.equal(table.moe_sum(y), whole)
        ep = []
        for r in range(2):
            expert_map = torch.full((8,), -1, dtype=torch.int32)
            expert_map[4 * r : 4 * r + 4] = torch.arange(4, dtype=torch.int32)
            ep.append(vllm_ops.fused_experts(x, w13[4 * r : 4 * r + 4], w2[4 * r : 4 * r + 4], weights, ids, expert_map))
            mine = (ids.long() // 4 == r)[..., None]
            assert torch.equal(ep[r], table.moe_sum(torch.where(mine, y, torch.zeros_like(y))))
        inter = w2.shape[-1]
        tp = []
        for r in range(2):
            rows = slice(r * inter // 2, (r + 1) * inter // 2)
            w13_r = torch.cat([w13[:, :inter][:, rows], w13[:, inter:][:, rows]], dim=1)
            tp.append(vllm_ops.fused_experts(x, w13_r, w2[:, :, rows].contiguous(), weights, ids))
    for partials in (ep, tp):
        out = partials[0] + partials[1]
        assert not torch.equal(out, whole)
        assert torch.allclose(out.float(), whole.float(), rtol=2e-2, atol=2e-2)
    for bad in (torch.arange(8, dtype=torch.int32), torch.tensor([0, 1, 2, 3, -1, -1, -1, -1])):  # indices / dtype
        with pytest.raises(ZooError, match="expert_map"):
            vllm_ops.fused_experts(x, w13[:4], w2[:4], weights, ids, bad)


def test_the_expert_parallel_moe_ops_have_a_correct_backward():
    """fp64 gradcheck of the fused experts with an ``expert_map`` (this rank's two experts of four):
    the slots of the other rank's experts get no gradient, and the two ranks' gradients add up to
    the whole block's."""
    g = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    ids = torch.tensor([[0, 2], [3, 1], [2, 0], [1, 3]], dtype=torch.int32)
    maps = [torch.tensor([0, 1, -1, -1], dtype=torch.int32), torch.tensor([-1, -1, 0, 1], dtype=torch.int32)]
    x, w13, w2, s = rand(4, 6), rand(4, 2 * 3, 6), rand(4, 6, 3), rand(4, 2)
    with use_kernels(ReferenceKernels()):
        _gradcheck(lambda x, w13, w2, s: vllm_ops.fused_experts(x, w13, w2, s, ids, maps[1]), x, w13[2:], w2[2:], s)
        whole = torch.autograd.grad(vllm_ops.fused_experts(x, w13, w2, s, ids).sum(), (x, w13, w2, s))
        parts = [torch.autograd.grad(vllm_ops.fused_experts(x, w13[2 * r : 2 * r + 2], w2[2 * r : 2 * r + 2], s, ids, maps[r]).sum(),
                                     (x, w13, w2, s)) for r in range(2)]  # fmt: skip
    for i, name in enumerate(("x", "w13", "w2", "weights")):
        assert torch.allclose(parts[0][i] + parts[1][i], whole[i], rtol=1e-12, atol=1e-12), name
    assert parts[0][1][2:].abs().sum() == 0 and parts[1][1][:2].abs().sum() == 0


def test_routes_from_vllm_request_outputs_replay_the_engines_experts(reference_checkpoint, mpu):
    """vLLM's returned routes (``enable_return_routed_experts``: per completion ``routed_experts``,
    numpy ``[prompt + generated - 1, num_hidden_layers, top_k]``, uint8, dense layers' rows zero)
    -> the zoo's per-sequence routes -> replay: the vllm-exact router takes the engine's experts
    (here: made-up outputs holding the experts a recorded forward chose, so the replayed forward's
    log-probs are the recorded ones bit for bit)."""
    from types import SimpleNamespace

    import numpy as np

    from mcore_zoo import routing

    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 3})  # layer 2 (index 1) dense
    with use_kernels(ReferenceKernels()):
        model = mcore_zoo.build_model(ckpt, backend="portable", numerics=VLLM_EXACT, load=ckpt,
                                      overrides={"moe_enable_routing_replay": True})  # fmt: skip
        vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
        seqs = random_sequences([9, 14], vocab)
        with torch.no_grad(), routing.record(model) as rec:
            recorded = mcore_zoo.packed_forward(model, seqs)
        moe_layers = routing.moe_layer_numbers(model)
        assert moe_layers == [1, 3]
        per_sequence = routing.unpack_routes(rec.routes, [len(s) for s in seqs])
        prompt = 5
        outputs = []
        for s, routes in zip(seqs, per_sequence):
            engine = np.zeros((len(s) - 1, 3, 2), dtype=np.uint8)  # the last token: never forwarded
            for i, layer in enumerate(moe_layers):
                engine[:, layer - 1] = routes[i, : len(s) - 1].numpy()
            completion = SimpleNamespace(token_ids=s[prompt:].tolist(), routed_experts=engine)
            outputs.append(SimpleNamespace(prompt_token_ids=s[:prompt].tolist(), outputs=[completion]))
        got = routing.routes_from_vllm(outputs, moe_layers)
        assert [tuple(r.shape) for r in got] == [(2, 9, 2), (2, 14, 2)] and got[0].dtype == torch.int64
        for mine, want in zip(got, per_sequence):
            assert torch.equal(mine[:, :-1], want[:, :-1]) and mine[:, -1].tolist() == [[0, 1], [0, 1]]
        with torch.no_grad(), routing.replay(model, routing.pack_routes(got)):
            replayed = mcore_zoo.packed_forward(model, seqs)
    # every token but each sequence's last has its recorded experts; the last one's other experts
    # change the row count of two experts' GEMMs, which on the CPU (the stand-ins' per-expert
    # matmul) rounds the other rows of those experts differently - vLLM's fused-MoE kernel computes
    # each row alone: fp32 rounding here, nothing more
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(replayed.logprobs, recorded.logprobs))
    outputs[0].outputs[0].routed_experts = None
    with pytest.raises(ZooError, match="enable_return_routed_experts=True"):
        routing.routes_from_vllm(outputs, moe_layers)


def test_vllm_router_takes_the_arguments_megatron_core_passes_routers(monkeypatch):
    """megatron-core 0.19's MoELayer builds its router with ``is_mtp_layer=...`` (0.16 does not): the
    vLLM router hands what it does not use to Megatron-Core's ``TopKRouter``."""
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_zoo.specs.vllm_exact import VLLMRouter

    seen = {}

    def init(self, config, pg_collection=None, is_mtp_layer=False):  # 0.19's signature
        torch.nn.Module.__init__(self)
        seen.update(config=config, is_mtp_layer=is_mtp_layer)

    monkeypatch.setattr(TopKRouter, "__init__", init)
    router = VLLMRouter(config="config", pg_collection=None, renormalize=True, is_mtp_layer=True)
    assert seen == {"config": "config", "is_mtp_layer": True} and router.renormalize
