"""bf16 on CUDA: the ``hf-exact`` profile is bit-identical to transformers, and flipping a single
knob back to Megatron-Core's op order breaks that (so the equality is not vacuous).

CPU counterparts: ``tests/parity/test_dense_parity.py`` (fp32)."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.gemm import split_k_disabled
from mcore_zoo.parity.reference import load_reference, write_reference_checkpoint

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
    out = {}
    for name, extra in EXTRA.items():
        arch = mcore_zoo.lookup(name)
        config = arch.example_config()
        config.update(SIZE, **extra)
        path = tmp_path_factory.mktemp(name)
        write_reference_checkpoint(arch, config, path, dtype=torch.bfloat16)
        out[name] = path
    return out


def _ids(vocab):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (4, 512), generator=gen).cuda()


VARIANTS = [("local", "hf-exact", "eager"), ("portable", "hf-exact", "eager"), ("portable", "hf-exact-sdpa", "sdpa")]


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
