"""The Phi-3 weight table: the Llama table with Phi-3's two fused HF tensors.

HF ``qkv_proj.weight`` is ``[q; k; v]`` stacked by rows (``heads * head_dim``, then ``kv_heads *
head_dim`` twice); ``gate_up_proj.weight`` is ``[gate; up]``. Each becomes several *sources* that
select a row range of the one HF tensor (:func:`mcore_zoo.split_rows`). The transforms are the usual
ones (per-group QKV interleave, gate/up concatenation), tensor-parallel chunks are taken inside each
range, and export writes the fused tensors back whole.
"""

from __future__ import annotations


def weight_map(arch):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import GATE_UP, HF_LAYER, LAYER, QKV, ROTARY_BUFFER_IGNORED, Rule, WeightMap, embedding_rules, rule, split_rows

    q_rows = arch.num_attention_heads * arch.head_dim
    kv_rows = arch.num_query_groups * arch.head_dim
    ffn = arch.ffn_hidden_size
    rules = embedding_rules(arch) + [
        rule(LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight"),
        Rule(
            LAYER + "self_attention.linear_qkv.weight",
            split_rows(HF_LAYER + "self_attn.qkv_proj.weight", [q_rows, kv_rows, kv_rows], tp_axis=0),
            QKV,
            note="HF qkv_proj rows: q, k, v",
        ),
        rule(LAYER + "self_attention.linear_proj.weight", HF_LAYER + "self_attn.o_proj.weight", tp_axis=1),
        rule(LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight"),
        Rule(
            LAYER + "mlp.linear_fc1.weight",
            split_rows(HF_LAYER + "mlp.gate_up_proj.weight", [ffn, ffn], tp_axis=0),
            GATE_UP,
            note="HF gate_up_proj rows: gate, up",
        ),
        rule(LAYER + "mlp.linear_fc2.weight", HF_LAYER + "mlp.down_proj.weight", tp_axis=1),
    ]
    ignored = [ROTARY_BUFFER_IGNORED]
    if arch.tie_word_embeddings:
        ignored.append(("lm_head.weight", "tie_word_embeddings: the output layer is model.embed_tokens.weight"))
    return WeightMap(arch, rules, ignored)
