"""Built-in plugin: ``GptOssForCausalLM`` (gpt-oss-20b, gpt-oss-120b).

Attention with q/k/v/o biases, a learned sink logit per head in the softmax (``self_attn.sinks``)
and sliding-window layers alternating with full ones (``layer_types``, ``sliding_window``); YaRN
RoPE as transformers computes it (``truncate`` honoured). Every layer's MLP is the MoE block: a
router with a bias whose top-k logits are softmaxed (in the logits' dtype), and experts with biases
whose clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``) reads gate and up from alternating
columns, all experts of a layer stacked in one tensor per projection
(:func:`mcore_zoo.plugin_api.gpt_oss_weight_map`). Published checkpoints store the experts as
MXFP4 (``*_blocks`` / ``*_scales``): loading dequantizes them as transformers does.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},  # fmt: skip
    "attention_bias": True,
    "attention_dropout": 0.0,
    "swiglu_limit": 0.1,  # small enough that random weights reach the clamp
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import (
        MoESpec, read_aux_loss, read_clamped_swiglu, read_dense_decoder, read_expert_counts, read_layer_types,
        read_mxfp4_experts,
    )  # fmt: skip

    reader.map_checked("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o, router and expert biases)",
                       True, default=True, reason="the gpt-oss router and experts always carry biases and"
                       " Megatron-Core's add_bias_linear sets the o_proj bias with them")  # fmt: skip
    window = reader.map("sliding_window", "window_size=(sliding_window - 1, 0) on the sliding layers", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise reader.unsupported("sliding_window", window, "must be a positive integer or null")
    flags = read_layer_types(reader, reader.peek("num_hidden_layers"), window)
    experts, topk, ffn = read_expert_counts(reader, experts_field="num_local_experts", ffn_field="intermediate_size")
    swiglu = read_clamped_swiglu(reader)
    aux = read_aux_loss(reader)
    if reader.has("experts_per_token"):  # published configs carry the original implementation's name too
        reader.ignore("experts_per_token", "the original implementation's name of num_experts_per_tok; transformers"
                      " reads num_experts_per_tok")  # fmt: skip
    if reader.has("initial_context_length"):
        reader.ignore("initial_context_length", "the original implementation's name of the YaRN original context"
                      " (rope original_max_position_embeddings); transformers does not read it")  # fmt: skip
    quantization = read_mxfp4_experts(reader)
    arch = read_dense_decoder(reader, qkv_bias=True, attn_output_bias=True, ffn_hidden_size=ffn,
                              sliding_window=window if flags else None, sliding_window_layers=flags)  # fmt: skip
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, router_score_function="softmax",
                  softmax_over_topk=True, probs_dtype="hidden", aux_loss_coeff=aux, clamped_swiglu=swiglu)  # fmt: skip
    return arch.replace(moe=moe, mlp_bias=True, attention_sinks=True, checkpoint_quantization=quantization)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="GptOssForCausalLM",
            model_type="gpt_oss",
            converter="mcore_zoo.plugins.gpt_oss:convert",
            weight_rules="mcore_zoo.plugin_api:gpt_oss_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="gpt-oss (attention sinks, alternating sliding windows, YaRN; top-k-softmax router with"
                        " bias, clamped-SwiGLU experts with biases, stacked; MXFP4 checkpoints dequantized)",
        )
    ]
