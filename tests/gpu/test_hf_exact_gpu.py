"""bf16 on CUDA: the ``hf-exact`` profiles (and ``training`` on ``te``) are bit-identical to
transformers, and flipping a single knob back to Megatron-Core's op order breaks that (so the
equality is not vacuous).

CPU counterparts: ``tests/parity/test_dense_parity.py`` (fp32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.gemm import split_k_disabled
from mcore_zoo.parity.reference import load_reference

from .conftest import bf16_checkpoints

pytestmark = pytest.mark.gpu

SIZE = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
EXTRA = {
    "LlamaForCausalLM": dict(head_dim=64),
    "MistralForCausalLM": dict(head_dim=64, sliding_window=256),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(head_dim=128),
}


@pytest.fixture(scope="module")
def mpu():
    from mcore_zoo.parallel import ensure_model_parallel

    return ensure_model_parallel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return bf16_checkpoints(tmp_path_factory, SIZE, EXTRA)


def _ids(vocab):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (4, 512), generator=gen).cuda()


VARIANTS = [("local", "hf-exact", "eager"), ("portable", "hf-exact", "eager"), ("portable", "hf-exact-sdpa", "sdpa")]
if importlib.util.find_spec("transformer_engine") is not None:
    # the training profile: Transformer Engine's GEMMs, HF's op order around them, HF's sdpa calls
    VARIANTS.append(("te", "training", "sdpa"))


def _pair(checkpoints, name, backend, profile, attn):
    ckpt = checkpoints[name]
    hf = load_reference(mcore_zoo.lookup(name), ckpt, dtype=torch.bfloat16, attn_implementation=attn, device="cuda")
    model = mcore_zoo.build_model(ckpt, backend=backend, numerics=profile, params_dtype=torch.bfloat16, load=ckpt).eval()
    return hf, model


@pytest.mark.parametrize("name", list(EXTRA))
@pytest.mark.parametrize("backend,profile,attn", VARIANTS)
def test_hf_exact_bshd_bitwise_bf16(mpu, checkpoints, name, backend, profile, attn):
    hf, model = _pair(checkpoints, name, backend, profile, attn)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids).logits
        bshd = model(ids, torch.arange(512, device="cuda").expand(4, -1), None)
    assert torch.equal(bshd, ref), f"BSHD max |diff| {(bshd - ref).abs().max()}"


@pytest.mark.parametrize("name", list(EXTRA))
@pytest.mark.parametrize("backend,profile,attn", VARIANTS)
def test_hf_exact_thd_bitwise_bf16(mpu, checkpoints, name, backend, profile, attn):
    """A THD pack of mixed lengths vs HF on each sequence alone: the GEMMs see other row counts,
    so this needs cuBLAS split-K off in the process (docs/numerics.md)."""
    if not split_k_disabled():
        pytest.skip("THD vs each sequence alone needs CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0")
    hf, model = _pair(checkpoints, name, backend, profile, attn)
    ids = _ids(hf.config.vocab_size)
    seqs = [ids[0], ids[1, :300], ids[2, :100], ids[3, :37]]
    with torch.no_grad():
        thd = mcore_zoo.packed_forward(model, seqs).logits
        alone = [hf(s[None]).logits[0] for s in seqs]
    for got, want in zip(thd, alone):
        assert torch.equal(got, want), f"THD len {got.shape[0]} max |diff| {(got - want).abs().max()}"


@pytest.mark.parametrize("knob", [{"norm": "mcore"}, {"bias_activation_fusion": True}])
def test_flipping_one_knob_breaks_bitwise(mpu, checkpoints, knob):
    name = "LlamaForCausalLM"
    ckpt = checkpoints[name]
    hf = load_reference(mcore_zoo.lookup(name), ckpt, dtype=torch.bfloat16, device="cuda")
    ids = _ids(hf.config.vocab_size)
    profile = mcore_zoo.get_profile("hf-exact").with_knobs(**knob)
    model = mcore_zoo.build_model(ckpt, backend="local", numerics=profile, params_dtype=torch.bfloat16, load=ckpt).eval()
    with torch.no_grad():
        ours = model(ids, torch.arange(512, device="cuda").expand(4, -1), None)
        assert not torch.equal(ours, hf(ids).logits)


@pytest.mark.parametrize("name", list(EXTRA))
def test_portable_fast_kernel_thd_within_bf16_tolerance(mpu, checkpoints, name, monkeypatch):
    """The ``portable`` backend with its default kernel (``auto``: torch's ``varlen_attn`` on CUDA,
    one call per pack) on a mixed-length THD pack, vs HF sdpa on each sequence alone: within the
    bf16 tolerance of the parity harness, relaxed by HF's own eager-vs-sdpa gap on the same inputs.
    Windowed layers that this torch's ``varlen_attn`` cannot express take the per-sequence SDPA
    path; the others must really have gone through ``varlen_attn``."""
    import functools
    import inspect

    from torch.nn.attention import varlen as varlen_module

    from mcore_zoo.numerics.metrics import Predictions, check_tolerance, default_tolerance, logprob_metrics
    from mcore_zoo.specs.portable import resolve_kernel

    assert resolve_kernel("auto", torch.device("cuda")) == "varlen"
    calls = []
    real = varlen_module.varlen_attn

    @functools.wraps(real)
    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attn", counting)
    ckpt = checkpoints[name]
    arch = mcore_zoo.lookup(name)
    hf = load_reference(arch, ckpt, dtype=torch.bfloat16, attn_implementation="sdpa", device="cuda")
    eager = load_reference(arch, ckpt, dtype=torch.bfloat16, attn_implementation="eager", device="cuda")
    model = mcore_zoo.build_model(ckpt, backend="portable", params_dtype=torch.bfloat16, load=ckpt).eval()
    ids = _ids(hf.config.vocab_size)
    seqs = [ids[0], ids[1, :300], ids[2, :100], ids[3, :37]]
    with torch.no_grad():
        thd = [t.float() for t in mcore_zoo.packed_forward(model, seqs).logits]
        ref = [hf(s[None]).logits[0].float() for s in seqs]
        base = [eager(s[None]).logits[0].float() for s in seqs]
    tokens = [s.cpu() for s in seqs]
    ours = logprob_metrics(Predictions(tokens, logits=ref), Predictions(tokens, logits=thd))
    baseline = logprob_metrics(Predictions(tokens, logits=ref), Predictions(tokens, logits=base))
    failures = check_tolerance(ours, default_tolerance("bfloat16").relaxed_by(baseline))
    assert not failures, (ours["mean_abs_dlogp"], baseline["mean_abs_dlogp"], failures)
    windowed = EXTRA[name].get("sliding_window") is not None
    if not windowed or "window_size" in inspect.signature(real).parameters:
        assert calls, "varlen_attn was never called"
    print(f"{name}: varlen calls {len(calls)}, mean|dlogp| {ours['mean_abs_dlogp']:.4g} "
          f"(HF eager vs sdpa {baseline['mean_abs_dlogp']:.4g}), top1 {ours['top1_agreement']:.4f}")  # fmt: skip
