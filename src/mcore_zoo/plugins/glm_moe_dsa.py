"""Built-in plugin: ``GlmMoeDsaForCausalLM`` (GLM-5).

DeepSeek-V3.2's model (:mod:`mcore_zoo.plugins.deepseek_v32`: MLA with a q latent, the grouped sigmoid
router with expert bias - GLM-5 publishes one group - shared experts, dense lead-in layers, MTP,
DeepSeek sparse attention) with GLM-5's indexer: its RoPE rotates interleaved pairs of the first
``qk_rope_head_dim`` dims (``indexer_rope_interleave``). ``indexer_types`` must run the indexer in
every layer: GLM-5.2's ``shared`` layers (``index_topk_freq``), which reuse the previous full layer's
selection, are refused by name. Transformers' model has no MTP layer (it ignores
``model.layers.78.*``).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
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
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_deepseek_dsa, read_glm_indexer_fields

    read_glm_indexer_fields(reader, reader.peek("num_hidden_layers"))
    return read_deepseek_dsa(reader, indexer_rope_interleave=True)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="GlmMoeDsaForCausalLM",
            model_type="glm_moe_dsa",
            converter="mcore_zoo.plugins.glm_moe_dsa:convert",
            weight_rules="mcore_zoo.plugin_api:dsa_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="GLM-5 (MLA + DeepSeek sparse attention with an interleaved-RoPE indexer, sigmoid router"
                        " with expert bias, shared experts); MTP built (or dropped on request); GLM-5.2's shared"
                        " indexer layers refused",  # fmt: skip
        )
    ]
