"""Built-in plugin: ``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder MoE).

Qwen3 attention (q/k RMSNorm, head_dim independent of hidden/heads) with a sparse MoE block:
softmax router over all experts in fp32, top-k, renormalised when ``norm_topk_prob``; the weights
are cast to the hidden dtype and scale each expert's output. ``decoder_sparse_step`` /
``mlp_only_layers`` put dense MLPs (``intermediate_size``) among the MoE layers.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import (
        MoESpec, read_aux_loss, read_dense_decoder, read_expert_counts, read_sliding_window, read_sparse_layers,
    )  # fmt: skip

    bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    if bias:
        raise reader.unsupported("attention_bias", bias, "Qwen3-MoE has an o_proj bias but no expert bias;"
                                 " Megatron-Core's add_bias_linear sets both")  # fmt: skip
    window = read_sliding_window(reader)
    experts, topk, ffn = read_expert_counts(reader, experts_field="num_local_experts" if reader.has("num_local_experts") else "num_experts")
    norm = reader.map("norm_topk_prob", "top-k weights divided by their sum (HF order)", False)
    layers = reader.peek("num_hidden_layers")
    pattern = read_sparse_layers(reader, layers)
    aux = read_aux_loss(reader)
    arch = read_dense_decoder(reader, qk_norm=True, sliding_window=window)
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, router_score_function="softmax",
                  normalize_topk=bool(norm), probs_dtype="hidden", aux_loss_coeff=aux, layer_pattern=pattern)  # fmt: skip
    return arch.replace(moe=moe)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen3MoeForCausalLM",
            model_type="qwen3_moe",
            converter="mcore_zoo.plugins.qwen3_moe:convert",
            weight_rules="mcore_zoo.plugin_api:moe_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen3-MoE (softmax top-k router, norm_topk_prob, dense mlp_only_layers; q/k RMSNorm)",
        )
    ]
