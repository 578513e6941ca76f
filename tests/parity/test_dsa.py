"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) against the real transformers models, CPU fp32: the
example's sequences are longer than ``index_topk``, so selection happens (transformers' logits
change when every key is selected instead); a THD pack's indexer scores each sequence on its own
keys only (the selection of a sequence in a pack equals its selection alone, and differs from a
selection over the whole pack); the ``default`` profile (SDPA with the same selection) within a
measured gap of transformers' eager attention, which ``hf-exact`` reproduces bitwise (the
conformance suite's ``parity`` contract); GLM-5.2's shared indexer layers refused by name."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo

from ..conftest import random_sequences

ARCH = "DeepseekV32ForCausalLM"
#: DeepSeek-V3.2 (rotate-half indexer RoPE) and GLM-5 (interleaved indexer RoPE)
ARCHS = [ARCH, "GlmMoeDsaForCausalLM"]
#: ``default`` (SDPA over the selected keys) vs transformers' eager attention, relative to the
#: largest logit: measured 1.3e-6 and 1.6e-6 on the example config (50 and 37 tokens; the fp32 softmax
#: and products in SDPA's op order)
DEFAULT_REL_GAP = 1e-5


def _indexers(model):
    from mcore_zoo.families.dsa.spec import LightningIndexer

    return [m for c in getattr(model, "chunks", [model]) for m in c.modules() if isinstance(m, LightningIndexer)]


@pytest.mark.parametrize("arch", ARCHS)
def test_selection_happens(mpu, reference_checkpoint, hf_reference, arch):
    """The example's 50-token sequence is longer than index_topk (8): transformers' logits move when
    the indexer may keep every key - the parity contract compares a real selection."""
    ckpt = reference_checkpoint(arch)
    hf = hf_reference(arch, ckpt, "eager")
    seq = random_sequences([50], hf.config.vocab_size)[0]
    with torch.no_grad():
        sparse = hf(seq[None]).logits
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = 4096
        dense = hf(seq[None]).logits
    assert hf.config.index_topk < seq.numel()
    assert (sparse - dense).abs().max().item() > 1e-3


def test_thd_indexer_selects_within_each_sequence(mpu, reference_checkpoint):
    """Each sequence of a pack gets exactly the selection it gets alone - and a selection over the
    whole pack as one sequence (a query choosing another sequence's keys) would differ."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ckpt = reference_checkpoint(ARCH)
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
    indexer = _indexers(model)[0]
    lengths = [30, 20]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), 1, 64, generator=gen)
    q_resid = torch.randn(sum(lengths), 32, generator=gen)
    cu = torch.tensor([0, 30, 50], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=30, max_seqlen_kv=30)
    packed = indexer(x, q_resid, params)
    assert packed.segments == [(0, 30), (30, 20)]
    for (start, length), mask in zip(packed.segments, packed.masks):
        alone = indexer(x[start : start + length], q_resid[start : start + length, None])
        assert torch.equal(mask, alone.masks)
        assert mask.shape == (1, 1, length, length)
        assert int(mask[0, 0, -1].sum()) == indexer.topk  # the last query keeps index_topk keys
    whole = indexer(x, q_resid[:, None]).masks[0, 0]  # the pack as one sequence
    crossing = whole[30:, :30].any().item()
    assert crossing, "a whole-pack selection reaches back into the first sequence: the test would catch it"


@pytest.mark.parametrize("arch", ARCHS)
def test_thd_pack_equals_each_sequence_alone(mpu, reference_checkpoint, hf_reference, arch):
    """A pack of sequences longer than index_topk, each against transformers on it alone (MoE packs
    within the MoE pack tolerance; a key taken from the other sequence would move them by O(0.1))."""
    from mcore_zoo.testing.common import MOE_PACK_REL_TOL, assert_same

    ckpt = reference_checkpoint(arch)
    hf = hf_reference(arch, ckpt, "eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
    seqs = random_sequences([44, 31, 17], hf.config.vocab_size, seed=3)
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs, seq_format="thd").logits
        for seq, logits in zip(seqs, out):
            assert_same(logits, hf(seq[None]).logits[0], f"{seq.numel()} tokens", exact=False, rel_tol=MOE_PACK_REL_TOL)


def test_default_profile_gap(mpu, reference_checkpoint, hf_reference):
    """``default`` takes the same selection and runs SDPA over it (CPU): within DEFAULT_REL_GAP of
    transformers' eager attention; ``hf-exact`` is bitwise (the parity contract)."""
    ckpt = reference_checkpoint(ARCH)
    hf = hf_reference(ARCH, ckpt, "eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="default", load=ckpt).eval()
    seqs = random_sequences([50, 37], hf.config.vocab_size)
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs).logits
        gaps = []
        for seq, logits in zip(seqs, out):
            ref = hf(seq[None]).logits[0]
            gaps.append(((logits - ref).abs().max() / ref.abs().max()).item())
    print("default vs transformers eager, relative max |dlogit|:", gaps)
    assert max(gaps) <= DEFAULT_REL_GAP


def test_glm_shared_indexer_layers_are_refused():
    """GLM-5.2's cross-layer index sharing (``index_topk_freq``: ``shared`` layers reuse the previous
    full layer's selection) is refused by name; GLM-5's all-``full`` schedule converts."""
    from mcore_zoo.errors import ConfigError
    from mcore_zoo.plugins.glm_moe_dsa import EXAMPLE_CONFIG
    from mcore_zoo.registry import lookup

    arch = lookup(EXAMPLE_CONFIG)
    assert arch.config_from_hf(dict(EXAMPLE_CONFIG)).mla.indexer.rope_interleave
    shared = dict(EXAMPLE_CONFIG, index_topk_freq=2, index_skip_topk_offset=1)
    with pytest.raises(ConfigError, match="indexer_types"):
        arch.config_from_hf(shared)


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_types_of_either_transformers_release_convert(arch):
    """``layer_types`` as transformers 5.24 writes it (``indexed_attention``) and as 5.17 writes it
    (``deepseek_sparse_attention``) both convert; any other layer type is refused by name."""
    from mcore_zoo.errors import ConfigError
    from mcore_zoo.registry import get_registry

    architecture = get_registry().get(arch)
    example = architecture.example_config()
    layers = example["num_hidden_layers"]
    for name in ("indexed_attention", "deepseek_sparse_attention"):
        assert architecture.config_from_hf(dict(example, layer_types=[name] * layers)).mla.indexer is not None
    with pytest.raises(ConfigError, match="layer_types"):
        architecture.config_from_hf(dict(example, layer_types=["full_attention"] * layers))
