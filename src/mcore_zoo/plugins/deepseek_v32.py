"""Built-in plugin: ``DeepseekV32ForCausalLM`` (DeepSeek-V3.2-Exp, DeepSeek-V3.2).

DeepSeek-V3 (:mod:`mcore_zoo.plugins.deepseek_v3`: MLA with a q latent, YaRN; the grouped sigmoid
router with expert bias, shared experts, the first ``first_k_dense_replace`` layers dense; MTP
built or dropped by name; FP8 block checkpoints dequantized as read) plus DeepSeek sparse attention
(:mod:`mcore_zoo.families.dsa`): in every layer a lightning indexer of ``index_n_heads`` heads of
``index_head_dim`` scores the keys and each query attends to its ``index_topk`` best causal keys.
The indexer rotates the first ``qk_rope_head_dim`` dims of its queries and key as rotate-half pairs
(the MLA itself: interleaved pairs; transformers reads no ``rope_interleave`` for this model).

``mlp_layer_types`` / ``layer_types`` are checked against what transformers derives. Transformers'
model has no MTP layer (it ignores ``model.layers.61.*``).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
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
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},  # fmt: skip
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_deepseek_dsa

    return read_deepseek_dsa(reader, indexer_rope_interleave=False)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="DeepseekV32ForCausalLM",
            model_type="deepseek_v32",
            converter="mcore_zoo.plugins.deepseek_v32:convert",
            weight_rules="mcore_zoo.plugin_api:dsa_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="DeepSeek-V3.2 (DeepSeek-V3 with DeepSeek sparse attention: a lightning indexer picks"
                        " index_topk keys per query); MTP built (or dropped on request)",  # fmt: skip
        )
    ]
