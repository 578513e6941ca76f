"""A THD pack's per-sequence work done once per pack, with the same bits.

* Megatron-Core's unfused THD RoPE over the whole pack (:mod:`mcore_zoo.specs.thd_rope`) against
  Megatron-Core's own function (the installed release's) and against its per-sequence form of
  0.19 (one ``_apply_rotary_pos_emb_bshd`` call per sequence copied into the output): outputs and
  input gradients bitwise equal, fp32 and bf16, packs with 1-token sequences and alignment padding,
  a pass-through tail, ``mscale``, interleaved pairs.
* PortableAttention's ``sdpa`` kernel on contiguous slices of the pack against the per-sequence
  gather-and-scatter it replaced (kept here as the reference): outputs and q / k / v gradients
  equal.
* The pack's bounds read to the host once per ``cu_seqlens`` tensor, and again after it changes.

Run at any thread count (the comparisons are of the same kernels on the same values).
"""

from __future__ import annotations

import types

import pytest
import torch

from mcore_zoo.packing import pack_sequences

pytest.importorskip("megatron.core")

LENGTHS = (5, 1, 12, 1, 7, 3)
CP1 = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _pack(align):
    return pack_sequences([torch.arange(n) for n in LENGTHS], align=align)


def _mcore_thd():
    """Megatron-Core's own ``_apply_rotary_pos_emb_thd`` (under the zoo's wrapper where a model
    built in this process installed it)."""
    from megatron.core.models.common.embeddings import rope_utils

    fn = rope_utils._apply_rotary_pos_emb_thd
    while getattr(fn, "zoo_whole_pack", False):
        fn = fn.__wrapped__
    return fn


def _mla_flag() -> dict:
    """The MLA-interleave keyword of the installed release (0.19 renamed it)."""
    import inspect

    params = inspect.signature(_mcore_thd()).parameters
    return {"mla_rotary_interleaved": False} if "mla_rotary_interleaved" in params else {"multi_latent_attention": False}


def _per_sequence_rope(t, cu_seqlens, freqs, cp_group=None, **kwargs):
    """Megatron-Core 0.19's per-sequence form (cp 1): each slot rotated by ``freqs[0:n]`` in its own
    ``_apply_rotary_pos_emb_bshd`` call, copied into an ``empty_like`` output."""
    from megatron.core.models.common.embeddings import rope_utils

    out = torch.empty_like(t)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        out.narrow(0, a, b - a).copy_(rope_utils._apply_rotary_pos_emb_bshd(t[a:b].unsqueeze(1), freqs[: b - a], **kwargs).squeeze(1))
    return out


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run(fn, x, grad, *args, **kwargs):
    x = x.clone().requires_grad_()
    y = fn(x, *args, **kwargs)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot_dim", [16, 10], ids=["full", "tail"])
@pytest.mark.parametrize("align", [1, 4], ids=["unpadded", "padded"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_whole_pack_rope_is_megatron_cores_thd_rope(dtype, rot_dim, align, interleaved):
    from mcore_zoo.specs.thd_rope import whole_pack_rope

    mcore = _mcore_thd()
    calls = []
    ours = whole_pack_rope(lambda *a, **k: calls.append(1) or mcore(*a, **k))
    batch = _pack(align)
    cu = batch.cu_seqlens_padded
    gen = torch.Generator().manual_seed(0)
    freqs = torch.rand(batch.max_seqlen + 3, 1, 1, rot_dim, generator=gen) * 40
    x = torch.randn(batch.total, 3, 16, generator=gen).to(dtype)
    grad = torch.randn(batch.total, 3, 16, generator=gen).to(dtype)
    kwargs = dict(rotary_interleaved=interleaved, mscale=1.25, cp_group=CP1, **_mla_flag())
    got, got_grad = _run(ours, x, grad, cu, freqs, **kwargs)
    assert not calls, "the whole-pack path must not hand the pack to Megatron-Core's function"
    for name, ref_fn in (("mcore", mcore), ("per-sequence", _per_sequence_rope)):
        ref, ref_grad = _run(ref_fn, x, grad, cu, freqs, **kwargs)
        assert torch.equal(_bits(got), _bits(ref)), name
        assert torch.equal(_bits(got_grad), _bits(ref_grad)), name
    # the rotation does something (a wrong position per row would show): not the identity
    assert not torch.equal(got, x)


def test_whole_pack_rope_per_token_freqs_and_what_it_leaves_to_megatron_core():
    """Frequencies of the whole pack (one per row, multimodal RoPE) are used as they are; context
    parallelism, a pack the frequencies do not cover and unknown arguments go to Megatron-Core."""
    from mcore_zoo.specs.thd_rope import whole_pack_rope

    mcore = _mcore_thd()
    calls = []
    ours = whole_pack_rope(lambda *a, **k: calls.append(k) or mcore(*a, **k))
    batch = _pack(2)
    cu = batch.cu_seqlens_padded
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch.total, 2, 8, generator=gen)
    per_token = torch.rand(batch.total, 1, 1, 8, generator=gen) * 40
    kwargs = dict(rotary_interleaved=False, mscale=1.0, **_mla_flag())
    assert torch.equal(ours(x, cu, per_token, cp_group=CP1, **kwargs), mcore(x, cu, per_token, cp_group=CP1, **kwargs))
    assert not calls
    short = per_token[: batch.max_seqlen - 1]  # the longest slot is not covered: Megatron-Core's error
    with pytest.raises(RuntimeError):
        ours(x, cu, short, cp_group=CP1, **kwargs)
    assert len(calls) == 1
    cp2 = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    with pytest.raises(Exception):
        ours(x, cu, per_token, cp_group=cp2, **kwargs)  # handed over (no CP group to run it on here)
    assert len(calls) == 2
    with pytest.raises(TypeError):
        ours(x, cu, per_token, cp_group=CP1, some_new_argument=1, **kwargs)
    assert len(calls) == 3


def _attention(kernel, heads=4, groups=2, head_dim=16, window=None):
    from mcore_zoo.specs.portable import PortableAttention

    config = types.SimpleNamespace(
        tensor_model_parallel_size=1, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
        attention_dropout=0.0, window_size=None if window is None else (window - 1, 0), window_attn_skip_freq=None,
    )  # fmt: skip
    return PortableAttention(config, layer_number=1, kernel=kernel).eval()


def _gather_scatter_sdpa(attn, query, key, value, params):
    """The ``sdpa`` THD path before slices: each sequence's rows gathered with an index tensor,
    one SDPA call, scattered back into a zero tensor."""
    starts = params.cu_seqlens_q_padded.tolist()
    lengths = params.cu_seqlens_q.diff().tolist()
    out = query.new_zeros(query.shape[0], attn.heads, attn.v_dim)
    for s0, length in zip(starts, lengths):
        if not length:
            continue
        rows = torch.arange(s0, s0 + length)
        q = query[rows].view(1, length, *query.shape[1:]).transpose(1, 2)
        k = key[rows].view(1, length, *key.shape[1:]).transpose(1, 2)
        v = value[rows].view(1, length, *value.shape[1:]).transpose(1, 2)
        out[rows] = attn._attend(q, k, v, "sdpa", None).reshape(-1, attn.heads, attn.v_dim)
    return out.reshape(out.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("align", [1, 4], ids=["unpadded", "padded"])
@pytest.mark.parametrize("shape", [(4, 2, 16, None), (4, 4, 16, 3), (1, 1, 2, None)], ids=["gqa", "window", "narrow"])
def test_sdpa_slices_equal_the_gather_scatter_path(dtype, align, shape):
    heads, groups, head_dim, window = shape
    attn = _attention("sdpa", heads, groups, head_dim, window)
    batch = _pack(align)
    params = batch.packed_seq_params()
    gen = torch.Generator().manual_seed(2)
    qkv = [torch.randn(batch.total, h, head_dim, generator=gen).to(dtype) for h in (heads, groups, groups)]
    grad = torch.randn(batch.total, heads * head_dim, generator=gen).to(dtype)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    got = run(lambda q, k, v: attn(q, k, v, None, packed_seq_params=params))
    ref = run(lambda q, k, v: _gather_scatter_sdpa(attn, q, k, v, params))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.equal(a, b), name  # values (a zero's sign may differ: the scatter added +0)
    padding = torch.ones(batch.total, dtype=torch.bool)
    for s0, n in zip(batch.cu_seqlens_padded.tolist(), batch.lengths):
        padding[s0 : s0 + n] = False
    assert padding.any() == (align > 1)
    assert not got[0][padding].any() and not got[1][padding].any()
    assert got[0][~padding].abs().sum() > 0


def test_sdpa_slices_are_one_call_per_sequence(monkeypatch):
    """One SDPA call per sequence, batch 1, each on exactly its own rows."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[0], q.shape[2], q.stride()))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    batch = _pack(4)
    q = torch.randn(batch.total, 4, 16)
    k, v = torch.randn(batch.total, 2, 16), torch.randn(batch.total, 2, 16)
    with torch.no_grad():
        _attention("sdpa")(q, k, v, None, packed_seq_params=batch.packed_seq_params())
    # HF's layout: [1, h, L, d], a transpose of a contiguous [1, L, h, d]
    assert seen == [(1, n, (n * 4 * 16, 16, 4 * 16, 1)) for n in LENGTHS]


def test_host_bounds_are_read_once_per_tensor_and_again_after_a_change():
    from mcore_zoo.specs.pack_rows import host_bounds, pack_positions

    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    first = host_bounds(cu)
    assert first == [0, 3, 3, 7] and host_bounds(cu) is first
    assert pack_positions(cu).tolist() == [0, 1, 2, 0, 1, 2, 3]
    cu[1] = 2  # in place: the version counter moves
    assert host_bounds(cu) == [0, 2, 3, 7]
    assert pack_positions(cu).tolist() == [0, 1, 0, 0, 1, 2, 3]
    other = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert host_bounds(other) == [0, 3, 3, 7] and host_bounds(other) is not first


def test_host_bounds_of_a_dead_tensor_are_dropped():
    import gc

    from mcore_zoo.specs import pack_rows

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    pack_rows.pack_positions(cu)
    key = id(cu)
    assert key in pack_rows._HOST
    del cu
    gc.collect()
    assert key not in pack_rows._HOST


def test_training_profile_model_gives_the_per_sequence_forms_bits(mpu, reference_checkpoint, monkeypatch):
    """A Llama on the ``training`` profile, a padded pack with 1-token sequences, forward +
    backward: logits and every parameter's gradient equal with the whole-pack forms and with both
    switched back to the per-sequence forms (Megatron-Core's own THD RoPE; rows gathered per
    sequence) - and the whole-pack forms are the ones that ran."""
    import mcore_zoo
    from megatron.core.models.common.embeddings import rope_utils

    from mcore_zoo.specs.portable import PortableAttention

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="training", load=ckpt)
    assert getattr(rope_utils._apply_rotary_pos_emb_thd, "zoo_whole_pack", False)
    gen = torch.Generator().manual_seed(3)
    pack = pack_sequences([torch.randint(0, 256, (n,), generator=gen) for n in (9, 1, 17, 4, 1, 30)], align=4)
    params = pack.packed_seq_params()
    taken = []
    slices = PortableAttention._thd_sdpa_slices
    monkeypatch.setattr(PortableAttention, "_thd_sdpa_slices",
                        lambda self, *a: taken.append(1) or slices(self, *a))  # fmt: skip

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(pack.input_ids, pack.position_ids, None, packed_seq_params=params)
        logits.float().sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole = run()
    assert len(taken) == model.config.num_layers
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", _mcore_thd())
    monkeypatch.setattr(PortableAttention, "_thd_sdpa_slices", lambda self, *a: None)
    each = run()
    assert torch.equal(whole[0], each[0])
    assert whole[1].keys() == each[1].keys() and whole[1]
    for name in whole[1]:
        assert torch.equal(whole[1][name], each[1][name]), name
