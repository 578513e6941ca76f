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
the same machinery as DeepSeek-V3 (:mod:`mcore_zoo.config.mtp`, :mod:`mcore_zoo.weights.mtp`,
:mod:`mcore_zoo.specs.mtp`). Dropping the MTP layers stays an explicit request
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
    from mcore_zoo.config.arch import MoESpec
    from mcore_zoo.plugin_api import read_dense_decoder
    from mcore_zoo.config.moe import read_expert_counts, read_sparse_layers
    from mcore_zoo.config.mtp import read_mtp

    mtp = read_mtp(reader)
    bias = bool(reader.map("attention_bias", "add_qkv_bias (q/k/v biases; o_proj has none)", False))
    qk_norm = bool(reader.map("use_qk_norm", "qk_layernorm (per-head RMSNorm of q and k)", False))
    experts, topk, ffn = read_expert_counts(reader, experts_field="n_routed_experts")
    shared = reader.map_checked("n_shared_experts", "moe_shared_expert_intermediate_size = n * moe_intermediate_size",
                                lambda v: v is None or (isinstance(v, int) and v >= 0), reason="must be >= 0", default=None)  # fmt: skip
    groups = reader.map_checked("n_group", "expert groups (moe_router_num_groups)",
                                lambda v: isinstance(v, int) and v > 0 and experts % v == 0,
                                reason=f"must divide n_routed_experts={experts}", default=1)  # fmt: skip
    group_topk = reader.map_checked("topk_group", "groups chosen per token (moe_router_group_topk)",
                                    lambda v: isinstance(v, int) and 0 < v <= groups, reason=f"must be in [1, n_group={groups}]",
                                    default=1)  # fmt: skip
    if (experts // groups) < 2:
        raise reader.unsupported("n_group", groups, "a group scores the sum of its best two experts: needs >= 2 per group")
    norm = reader.map("norm_topk_prob", "top-k weights divided by their sum + 1e-20 (HF order)", True)
    scale = reader.map("routed_scaling_factor", "moe_router_topk_scaling_factor", 1.0)
    layers = reader.peek("num_hidden_layers")
    pattern = read_sparse_layers(reader, layers, step_field=None, dense_field=None, first_dense_field="first_k_dense_replace")
    reader.ignore("output_router_logits", "the transformers GLM-4.5 model adds no load-balancing loss; it only returns"
                  " the router logits")  # fmt: skip
    reader.ignore("router_aux_loss_coef", "not read by the transformers GLM-4.5 model (no auxiliary loss)")
    arch = read_dense_decoder(reader, qkv_bias=bias, qk_norm=qk_norm)
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn,
                  shared_expert_ffn_hidden_size=(shared * ffn) if shared else None, router_score_function="sigmoid",
                  router_logits_fp32=True, router_expert_bias=True, num_groups=groups, group_topk=group_topk,
                  group_score_topk=2, normalize_topk=bool(norm), normalize_eps=1e-20 if norm else 0.0,
                  topk_scaling_factor=float(scale), probs_dtype="fp32", layer_pattern=pattern)  # fmt: skip
    return arch.replace(moe=moe, mtp_num_layers=mtp, mtp_layer_moe=mtp > 0)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Glm4MoeForCausalLM",
            model_type="glm4_moe",
            converter="mcore_zoo.plugins.glm4_moe:convert",
            weight_rules="mcore_zoo.weights.moe:glm4_moe_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="GLM-4.5 (sigmoid router with expert bias, grouped top-k, scaled; shared experts; partial RoPE); MTP built (or dropped on request)",
        )
    ]
