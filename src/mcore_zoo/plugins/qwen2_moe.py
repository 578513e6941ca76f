"""Built-in plugin: ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Qwen2 attention (q/k/v biases, no o_proj bias) with a sparse MoE block: softmax router over all
experts in fp32, top-k, renormalised when ``norm_topk_prob``, weights cast to the hidden dtype;
plus an always-on shared expert (``shared_expert_intermediate_size``) whose output is scaled by
``sigmoid(shared_expert_gate(x))`` - Megatron-Core's ``moe_shared_expert_gate``.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}


def read_expert_interval(reader):  # type: ignore[no-untyped-def]
    """``expert_interval``: a field of Qwen's pre-release code that Qwen1.5-MoE's published config
    carries (and transformers 5.17 writes when it saves any Qwen2-MoE config); no transformers
    model reads it - ``decoder_sparse_step`` places the MoE layers. Ignored when it agrees with
    ``decoder_sparse_step`` (or is 1, the published value); any other value is refused, since the
    config would then say two things about which layers are MoE."""
    if not reader.has("expert_interval"):
        return
    value = reader.peek("expert_interval")
    step = reader.peek("decoder_sparse_step") if reader.has("decoder_sparse_step") else 1
    if value not in (1, step) or isinstance(value, bool):
        raise reader.unsupported("expert_interval", value, f"transformers ignores it and places the MoE layers by"
                                 f" decoder_sparse_step={step!r}; the two disagree")  # fmt: skip
    reader.ignore("expert_interval", "not read by transformers (legacy field); agrees with decoder_sparse_step")


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import (
        MoESpec, read_aux_loss, read_dense_decoder, read_expert_counts, read_qwen_window, read_sparse_layers,
    )  # fmt: skip

    layers = reader.peek("num_hidden_layers")
    bias = reader.map("qkv_bias", "add_qkv_bias (q/k/v biases; o_proj has none)", True)
    window, flags = read_qwen_window(reader, layers)
    experts, topk, ffn = read_expert_counts(reader, experts_field="num_experts")
    shared = reader.map_checked("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"
                                " (+ moe_shared_expert_gate: sigmoid(shared_expert_gate(x)) scales it)",
                                lambda v: isinstance(v, int) and v > 0, reason="the HF model always has a shared expert: must be > 0")  # fmt: skip
    norm = reader.map("norm_topk_prob", "top-k weights divided by their sum (HF order)", False)
    read_expert_interval(reader)
    pattern = read_sparse_layers(reader, layers)
    aux = read_aux_loss(reader)
    arch = read_dense_decoder(reader, qkv_bias=bool(bias), sliding_window=window, sliding_window_layers=flags)
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, shared_expert_ffn_hidden_size=shared,
                  shared_expert_gate=True, router_score_function="softmax", normalize_topk=bool(norm),
                  probs_dtype="hidden", aux_loss_coeff=aux, layer_pattern=pattern)  # fmt: skip
    return arch.replace(moe=moe)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen2MoeForCausalLM",
            model_type="qwen2_moe",
            converter="mcore_zoo.plugins.qwen2_moe:convert",
            weight_rules="mcore_zoo.plugin_api:moe_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen2-MoE / Qwen1.5-MoE (softmax top-k router, sigmoid-gated shared expert; qkv bias)",
        )
    ]
