"""Built-in plugin: ``MixtralForCausalLM`` (Mixtral 8x7B / 8x22B).

Llama attention with a sparse MoE block in every layer: softmax over all experts in fp32, top-k,
always renormalised; the weights stay fp32 and scale each expert's output (cast back to the hidden
dtype afterwards). ``intermediate_size`` is the width of each expert (there is no dense MLP).
``router_jitter_noise`` must be 0 (training-time noise on the MoE input; not reproducible).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": 24,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.02,
    "output_router_logits": False,
    "router_jitter_noise": 0.0,
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import MoESpec, read_aux_loss, read_dense_decoder, read_no_jitter, read_sliding_window

    window = read_sliding_window(reader)
    experts = reader.map_checked("num_local_experts", "num_moe_experts", lambda v: isinstance(v, int) and v > 0,
                                 reason="must be > 0")  # fmt: skip
    topk = reader.map_checked("num_experts_per_tok", "moe_router_topk", lambda v: isinstance(v, int) and 0 < v <= experts,
                              reason=f"must be in [1, num_local_experts={experts}]")  # fmt: skip
    read_no_jitter(reader)
    aux = read_aux_loss(reader)
    arch = read_dense_decoder(reader, sliding_window=window)
    reader.map("intermediate_size", "moe_ffn_hidden_size (every expert's width; Mixtral has no dense MLP)")
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=arch.ffn_hidden_size,
                  router_score_function="softmax", normalize_topk=True, probs_dtype="fp32", aux_loss_coeff=aux)  # fmt: skip
    return arch.replace(moe=moe)


def weight_map(arch):  # type: ignore[no-untyped-def]
    """Every layer MoE: experts ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
    (down), router ``block_sparse_moe.gate``."""
    from mcore_zoo.plugin_api import decoder_weight_map, routed_expert_rules

    experts = routed_expert_rules(arch, hf_moe="block_sparse_moe.", gate="w1", up="w3", down="w2")
    return decoder_weight_map(arch, experts)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="MixtralForCausalLM",
            model_type="mixtral",
            converter="mcore_zoo.plugins.mixtral:convert",
            weight_rules="mcore_zoo.plugins.mixtral:weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Mixtral (softmax top-2 router renormalised, fp32 weights; sliding window)",
        )
    ]
