"""CPU fp32 parity of every built-in family against the real transformers model, beyond what the
conformance suite checks (``test_builtin_conformance.py``: eager THD and ``hf-exact`` BSHD bitwise,
THD packing, TP=2, a RoPE mutation): the SDPA kernel, stock Megatron-Core numerics, and weight-map
mutations that the same comparison must catch.

Random weights with sharp attention (``mcore_zoo.parity.reference``), reference loaded with
``from_pretrained``; tolerances are those of ``mcore_zoo.testing.common`` (``REL_TOL``).
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.handle import handle_of
from mcore_zoo.numerics.profiles import get_profile
from mcore_zoo.testing.common import PARITY_LENGTHS, assert_same, scale_is_power_of_two
from mcore_zoo.weights.rules import Rule, WeightMap

from .mutations import SwapFirstTwoQueryHeads, SwapQueryAndKey
from ..conftest import CASE_IDS, CASES, random_sequences

LENGTHS = list(PARITY_LENGTHS)


def _build(checkpoint, backend, attention="eager", **kw):
    numerics = get_profile("default").with_knobs(attention=attention)
    return mcore_zoo.build_model(checkpoint, backend=backend, numerics=numerics, load=checkpoint, **kw).eval()


@pytest.mark.parametrize("numerics", ["sdpa-kernel", "training"])
@pytest.mark.parametrize("case_id,arch_name,overrides", CASES, ids=CASE_IDS)
def test_portable_thd_sdpa_bitwise_vs_hf_sdpa(mpu, reference_checkpoint, hf_reference, case_id, arch_name, overrides,
                                              numerics):  # fmt: skip
    """Packed THD through the portable backend with the SDPA kernel == HF's sdpa implementation on
    each sequence alone, bit for bit (the conformance suite checks the eager kernel). The same for
    the ``training`` profile (HF's op order around the GEMMs, sdpa attention): on the GPU with
    ``te`` it gives transformers' sdpa logits (tests/gpu/test_hf_exact_gpu.py)."""
    ckpt = reference_checkpoint(arch_name, overrides)
    hf = hf_reference(arch_name, ckpt, "sdpa")
    if numerics == "training":
        model = mcore_zoo.build_model(ckpt, backend="portable", numerics="training", load=ckpt).eval()
    else:
        model = _build(ckpt, "portable", attention="sdpa")
    seqs = random_sequences(LENGTHS, hf.config.vocab_size)
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs, seq_format="thd")
        for seq, logits, logprobs in zip(seqs, out.logits, out.logprobs):
            ref = hf(seq[None]).logits[0]
            assert_same(logits, ref, f"{case_id}/sdpa len {seq.numel()}")
            ref_lp = torch.log_softmax(ref[:-1].float(), -1).gather(-1, seq[1:, None]).squeeze(-1)
            assert logprobs.shape == (seq.numel() - 1,)
            if seq.numel() > 1:
                assert torch.equal(logprobs, ref_lp)


@pytest.mark.parametrize("case_id,arch_name,overrides", CASES, ids=CASE_IDS)
def test_local_default_numerics_vs_hf(mpu, reference_checkpoint, hf_reference, case_id, arch_name, overrides):
    """Stock Megatron-Core (its norms and DotProductAttention, BSHD batch of 3) vs HF eager: bitwise
    where the softmax scale is a power of two, else within REL_TOL. (``hf-exact`` is bitwise
    everywhere: the conformance suite checks it.)"""
    ckpt = reference_checkpoint(arch_name, overrides)
    hf = hf_reference(arch_name, ckpt, "eager")
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="default", load=ckpt).eval()
    ids = torch.stack(random_sequences([40, 40, 40], hf.config.vocab_size, seed=1))
    positions = torch.arange(40).expand(3, -1)
    with torch.no_grad():
        ours = model(ids, positions, None)
        ref = hf(ids).logits
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert_same(ours, ref, case_id, exact=scale_is_power_of_two(head_dim))


def test_local_backend_refuses_thd_clearly(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt).eval()
    with pytest.raises(mcore_zoo.ZooError, match="portable"):
        mcore_zoo.packed_forward(model, random_sequences([5], 256), seq_format="thd")


# ---------------------------------------------------------------------------- mutations
def _max_diff_vs_hf(model, hf, seqs):
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs).logits
        return max((o - hf(s[None]).logits[0]).abs().max().item() for o, s in zip(out, seqs))


@pytest.mark.parametrize("transform", [SwapFirstTwoQueryHeads(), SwapQueryAndKey()], ids=["swap-q-heads", "swap-q-k"])
def test_mutation_broken_weight_map_is_caught(mpu, reference_checkpoint, hf_reference, transform):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    hf = hf_reference("LlamaForCausalLM", ckpt)
    numerics = get_profile("default").with_knobs(attention="eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=numerics).eval()
    info = handle_of(model)
    good = info.weight_map
    broken = [
        Rule(r.mcore, r.sources, transform, r.export, r.layer_kind, r.note) if r.mcore.endswith("linear_qkv.weight") else r
        for r in good.rules
    ]
    info._weight_map = WeightMap(good.arch, broken, good.ignored)
    mcore_zoo.load_hf_weights(model, ckpt)
    seqs = random_sequences([40, 25], hf.config.vocab_size)
    assert _max_diff_vs_hf(model, hf, seqs) > 1e-2


@pytest.mark.parametrize("arch_name,overrides", [("Qwen2ForCausalLM", {}), ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True})])
@pytest.mark.parametrize("numerics", ["default", "hf-exact", "training"])
def test_gradients_match_transformers(mpu, reference_checkpoint, hf_reference, arch_name, overrides, numerics):
    """Training parity: the same loss (sum of next-token log-probs over a pack) gives the same
    gradients for every HF tensor as transformers' autograd (fp32; models with biases exercise
    the fused-bias linears)."""
    ckpt = reference_checkpoint(arch_name, overrides)
    hf = hf_reference(arch_name, ckpt)
    profile = mcore_zoo.get_profile(numerics).with_knobs(attention="eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=profile, load=ckpt)
    seqs = random_sequences([23, 9, 31], hf.config.vocab_size, seed=5)
    out = mcore_zoo.packed_forward(model, seqs, return_logits=False)
    torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
    ref_loss = 0
    for seq in seqs:
        logits = hf(seq[None]).logits[0]
        ref_loss = ref_loss + torch.log_softmax(logits[:-1].float(), -1).gather(-1, seq[1:, None]).sum()
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    if hf.config.tie_word_embeddings:
        ref_grads.setdefault("lm_head.weight", None)
    grads = dict(mcore_zoo.iter_hf_weights(model, grads=True))
    assert set(grads) == {n for n in ref_grads if ref_grads[n] is not None}
    for name, grad in grads.items():
        ref = ref_grads[name]
        scale = max(1.0, ref.abs().max().item())
        assert (grad - ref).abs().max().item() <= 1e-5 * scale, name


def test_hf_exact_profile_is_wired(mpu, reference_checkpoint):
    """hf-exact puts HF-order norms (input, pre-MLP, q/k, final), the HF-eager attention kernel and
    bias-in-GEMM linears into the model; the default profile keeps Megatron-Core's modules."""
    from mcore_zoo.specs.linears import FusedBiasColumnParallelLinear, FusedBiasRowParallelLinear
    from mcore_zoo.specs.norms import HFRMSNorm
    from mcore_zoo.specs.portable import PortableAttention

    ckpt = reference_checkpoint("Qwen3ForCausalLM")
    exact = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact")
    layer = exact.decoder.layers[0]
    for module in (layer.input_layernorm, layer.pre_mlp_layernorm, layer.self_attention.q_layernorm,
                   layer.self_attention.k_layernorm, exact.decoder.final_layernorm):  # fmt: skip
        assert isinstance(module, HFRMSNorm)
    assert isinstance(layer.self_attention.core_attention, PortableAttention)
    assert layer.self_attention.core_attention.kernel == "eager"
    assert isinstance(layer.self_attention.linear_qkv, FusedBiasColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, FusedBiasRowParallelLinear)
    default = mcore_zoo.build_model(ckpt, backend="local")
    layer = default.decoder.layers[0]
    assert not isinstance(layer.input_layernorm, HFRMSNorm)
    assert type(layer.self_attention.core_attention).__name__ == "DotProductAttention"
    assert type(layer.self_attention.linear_qkv).__name__ == "ColumnParallelLinear"
