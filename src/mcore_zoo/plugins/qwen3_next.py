"""Built-in plugin: ``Qwen3NextForCausalLM`` (Qwen3-Next-80B-A3B).

Gated DeltaNet linear-attention layers among full-attention layers (``layer_types``); the full
attention has a sigmoid output gate (``q_proj`` twice as wide), q/k RMSNorm and partial RoPE; every
RMSNorm but the DeltaNet's gated one scales by ``1 + weight``. The MLP is Qwen2-MoE's block (softmax
top-k router, ``norm_topk_prob``, a sigmoid-gated shared expert) or, on ``mlp_only_layers`` / with
``num_experts: 0``, a dense MLP. Backends ``local`` and ``portable``; tensor parallelism (whole
key-head groups per rank; the MoE form trains with sequence parallelism), pipeline and expert
parallelism; context parallelism is refused by name; the MTP layer is refused unless dropped on
request (a checkpoint's ``mtp.*`` tensors are ignored by name).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}

#: fields of Qwen's other configs that transformers' Qwen3-Next model never reads
UNREAD = ("use_sliding_window", "sliding_window", "max_window_layers")


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import (
        MoESpec, read_aux_loss, read_dense_decoder, read_expert_counts, read_gated_deltanet, read_gated_deltanet_mtp,
        read_sparse_layers,
    )  # fmt: skip

    layers = reader.peek("num_hidden_layers")
    bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    if bias:
        raise reader.unsupported("attention_bias", bias, "Megatron-Core's add_bias_linear would also add MLP biases")
    for name in UNREAD:
        if reader.has(name):
            reader.ignore(name, "not read by transformers' Qwen3-Next model (no sliding window)")
    linear = read_gated_deltanet(reader, layers)
    read_gated_deltanet_mtp(reader)
    moe = None
    if reader.peek("num_experts") == 0:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                     "output_router_logits"):  # fmt: skip
            reader.ignore(name, "num_experts is 0: every layer has the dense MLP (intermediate_size)")
    else:
        experts, topk, ffn = read_expert_counts(reader, experts_field="num_experts")
        shared = reader.map_checked("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size (+ moe_shared"
                                    "_expert_gate: sigmoid(shared_expert_gate(x)) scales it)", lambda v: isinstance(v, int)
                                    and v > 0, reason="the HF model always has a shared expert: must be > 0")  # fmt: skip
        norm = reader.map("norm_topk_prob", "top-k weights divided by their sum (HF order)", False)
        moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, shared_expert_ffn_hidden_size=shared,
                      shared_expert_gate=True, router_score_function="softmax", normalize_topk=bool(norm),
                      probs_dtype="hidden", layer_pattern=read_sparse_layers(reader, layers), aux_loss_coeff=read_aux_loss(reader))  # fmt: skip
    arch = read_dense_decoder(reader, qk_norm=True)
    return arch.replace(moe=moe, gated_deltanet=linear, attention_output_gate=True, zero_centered_norm=True)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen3NextForCausalLM",
            model_type="qwen3_next",
            converter="mcore_zoo.plugins.qwen3_next:convert",
            weight_rules="mcore_zoo.plugin_api:gated_deltanet_weight_map",
            layer_spec="mcore_zoo.plugin_api:hybrid_layer_specs",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen3-Next (gated DeltaNet among gated attention, partial RoPE, 1 + weight RMSNorm;"
                        " softmax top-k MoE with a sigmoid-gated shared expert)",
        )
    ]
