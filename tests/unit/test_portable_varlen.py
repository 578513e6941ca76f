"""PortableAttention's ``varlen`` kernel adapts to the signature of the installed torch's
``varlen_attn`` (CUDA-only there; faked here with per-segment SDPA): the call it makes must equal the
per-sequence SDPA kernel, for the old (``is_causal``, equal heads, default scale) and the new
(``window_size``, ``enable_gqa``, ``scale``) forms, and fall back where the old form cannot express
a sliding window."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from mcore_zoo.packing import pack_sequences
from mcore_zoo.specs.portable import PortableAttention


def _segments(query, key, value, cu_q, is_causal, scale=None, window=None):
    out = torch.empty_like(query)
    starts = cu_q.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        mask = None
        if window is not None and window[0] >= 0:
            i = torch.arange(b - a)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window[0] - 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and is_causal, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert key.shape[1] == query.shape[1], "old varlen_attn needs equal head counts"
    return _segments(query, key, value, cu_seq_q, is_causal)


def new_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    if enable_gqa:
        n = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    return _segments(query, key, value, cu_seq_q, window_size[1] == 0, scale, window_size)


def _attention(kernel, window=None):
    config = types.SimpleNamespace(
        tensor_model_parallel_size=1, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        attention_dropout=0.0, window_size=None if window is None else (window - 1, 0), window_attn_skip_freq=None,
    )  # fmt: skip
    return PortableAttention(config, layer_number=1, kernel=kernel).eval()


@pytest.mark.parametrize("fake", [old_varlen_attn, new_varlen_attn], ids=["torch<=2.11", "torch>=2.12"])
@pytest.mark.parametrize("window", [None, 5])
def test_varlen_matches_per_sequence_sdpa(monkeypatch, fake, window):
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", fake)
    batch = pack_sequences([torch.arange(n) for n in (7, 12, 3)])
    params = batch.packed_seq_params()
    gen = torch.Generator().manual_seed(0)
    t = batch.total
    q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (4, 2, 2))
    with torch.no_grad():
        ours = _attention("varlen", window)(q, k, v, None, packed_seq_params=params)
        ref = _attention("sdpa", window)(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
