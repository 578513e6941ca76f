"""Built-in plugin: ``DeepseekV3ForCausalLM`` (DeepSeek-V3 / R1, Moonlight-16B-A3B, Kimi-K2).

Multi-head latent attention (:mod:`mcore_zoo.families.mla`): ``q_lora_rank`` (null: a plain ``q_proj``),
``kv_lora_rank``, ``qk_nope_head_dim`` + ``qk_rope_head_dim`` per query / key head,
``v_head_dim``; RoPE (default or YaRN with ``mscale`` / ``mscale_all_dim``) on the rope dims only,
interleaved pairs (``rope_interleave``). Softmax scale ``(nope + rope) ** -0.5``, times
``mscale(factor, mscale_all_dim) ** 2`` under YaRN, as transformers computes it.

MoE as transformers' DeepSeek-V3 computes it (GLM-4.5's router too: the MoE family's grouped
sigmoid router): sigmoid scores in fp32, experts chosen by ``scores + e_score_correction_bias`` within the best
``topk_group`` of ``n_group`` groups (a group scores the sum of its best two), weights = the
unbiased scores renormalised (``norm_topk_prob``, +1e-20) times ``routed_scaling_factor``;
``n_shared_experts`` always-on experts; the first ``first_k_dense_replace`` layers dense.

Published configs name remote code (``auto_map``: ``configuration_deepseek.DeepseekV3Config``) and
some use their own ``model_type`` (Kimi-K2: ``kimi_k2``). The zoo reads them with transformers'
built-in ``DeepseekV3Config``; remote code is never executed. Fields only the remote code reads
(``scoring_func``, ``topk_method``, ``moe_layer_freq``, ``ep_size``, ...) are checked against what
the built-in model computes. The reading is the MLA family's ``read_deepseek``.

Multi-token prediction (``num_nextn_predict_layers: 1``) is built as Megatron-Core's MTP block on
the last pipeline stage (:mod:`mcore_zoo.families.mtp`), loaded from the checkpoint's
``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer,
``shared_head.norm``; its ``embed_tokens`` / ``shared_head.head`` copies are checked equal to the
model's embedding / ``lm_head``). The caller may still drop the MTP layers explicitly
(``ignore_fields={"num_nextn_predict_layers": reason}``: no MTP block, their tensors ignored by
name). Transformers' model has no MTP layer (it
ignores ``model.layers.61.*``).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
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
    from mcore_zoo.plugin_api import read_deepseek

    return read_deepseek(reader, v3=True)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="DeepseekV3ForCausalLM",
            model_type="deepseek_v3",
            converter="mcore_zoo.plugins.deepseek_v3:convert",
            weight_rules="mcore_zoo.plugin_api:deepseek_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="DeepSeek-V3 / R1, Moonlight, Kimi-K2 (MLA, YaRN mscale; sigmoid grouped router with"
                        " expert bias, shared experts); MTP built (or dropped on request)",  # fmt: skip
        )
    ]
