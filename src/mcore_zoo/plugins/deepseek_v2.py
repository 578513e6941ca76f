"""Built-in plugin: ``DeepseekV2ForCausalLM`` (DeepSeek-V2, DeepSeek-V2-Lite).

Multi-head latent attention as in DeepSeek-V3 (:mod:`mcore_zoo.families.mla`; V2-Lite has no
``q_lora_rank``). RoPE: transformers' DeepSeek-V2 rotates the interleaved rope pairs as complex
numbers (fp32) and keeps them interleaved; Megatron-Core's MLA RoPE computes the same rotation with
real arithmetic and leaves the pairs de-interleaved, which sums the scores in another order
(float32-close, not bitwise). The zoo's MLA layer applies HF's complex rotation instead
(:func:`mcore_zoo.families.mla.spec.complex_rope`): bitwise.

MoE: softmax scores in fp32; ``topk_method`` ``greedy`` (top-k of all experts) or
``group_limited_greedy`` (within the best ``topk_group`` of ``n_group`` groups, a group scoring its
best expert); the chosen scores times ``routed_scaling_factor``, never renormalised;
``n_shared_experts`` always-on experts; the first ``first_k_dense_replace`` layers dense.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},  # fmt: skip
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_deepseek

    return read_deepseek(reader, v3=False)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="DeepseekV2ForCausalLM",
            model_type="deepseek_v2",
            converter="mcore_zoo.plugins.deepseek_v2:convert",
            weight_rules="mcore_zoo.plugin_api:deepseek_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("local", "portable"),
            description="DeepSeek-V2 / V2-Lite (MLA, YaRN mscale; softmax router, greedy or group-limited;"
                        " shared experts; HF's complex RoPE)",  # fmt: skip
        )
    ]
