"""Built-in plugin: ``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6).

Attention with partial rotary (``partial_rotary_factor``, rotate-half on the first part of each
head), optional q/k RMSNorm (``use_qk_norm``) and q/k/v biases (``attention_bias``; no o_proj
bias). MoE after ``first_k_dense_replace`` dense layers: router logits in fp32, sigmoid scores;
experts are chosen by ``scores + e_score_correction_bias`` within the best ``topk_group`` of
``n_group`` groups (a group scores the sum of its best two), weighted by the unbiased scores,
renormalised (``norm_topk_prob``, +1e-20) and scaled by ``routed_scaling_factor``, kept in fp32;
``n_shared_experts`` always-on experts (no gate).

Multi-token prediction (``num_nextn_predict_layers: 1``) is built as Megatron-Core's MTP block,
loaded from ``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``, an MoE
decoder layer - the checkpoint makes every layer from ``first_k_dense_replace`` on MoE -
``shared_head.norm``; ``embed_tokens`` / ``shared_head.head`` copies checked equal to the model's):
the same machinery as DeepSeek-V3 (:mod:`mcore_zoo.families.mtp`). Dropping the MTP layers stays an explicit request
(``ignore_fields={"num_nextn_predict_layers": reason}``).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "attention_bias": True,
    "use_qk_norm": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import (
        read_dense_decoder, read_expert_counts, read_grouped_sigmoid_router, read_mtp, read_shared_experts,
    )  # fmt: skip

    mtp = read_mtp(reader)
    bias = bool(reader.map("attention_bias", "add_qkv_bias (q/k/v biases; o_proj has none)", False))
    qk_norm = bool(reader.map("use_qk_norm", "qk_layernorm (per-head RMSNorm of q and k)", False))
    experts, topk, ffn = read_expert_counts(reader, experts_field="n_routed_experts")
    shared = read_shared_experts(reader, ffn)
    moe = read_grouped_sigmoid_router(reader, experts, topk, ffn, shared_expert_ffn_hidden_size=shared)
    reader.ignore("output_router_logits", "the transformers GLM-4.5 model adds no load-balancing loss; it only returns"
                  " the router logits")  # fmt: skip
    reader.ignore("router_aux_loss_coef", "not read by the transformers GLM-4.5 model (no auxiliary loss)")
    arch = read_dense_decoder(reader, qkv_bias=bias, qk_norm=qk_norm)
    return arch.replace(moe=moe, mtp_num_layers=mtp, mtp_layer_moe=mtp > 0)


def weight_map(arch):  # type: ignore[no-untyped-def]
    """Dense MLPs in the first ``first_k_dense_replace`` layers, then router (+ its
    ``e_score_correction_bias`` -> the router's ``expert_bias`` buffer), routed experts and the
    shared experts (``mlp.shared_experts.*``, no gate): DeepSeek's MoE layout."""
    from mcore_zoo.plugin_api import decoder_weight_map, deepseek_moe_rules

    return decoder_weight_map(arch, deepseek_moe_rules(arch))


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Glm4MoeForCausalLM",
            model_type="glm4_moe",
            converter="mcore_zoo.plugins.glm4_moe:convert",
            weight_rules="mcore_zoo.plugins.glm4_moe:weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="GLM-4.5 (sigmoid router with expert bias, grouped top-k, scaled; shared experts; partial RoPE); MTP built (or dropped on request)",
        )
    ]
