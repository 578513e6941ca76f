"""Built-in plugin: ``LlamaForCausalLM`` (Llama 2, Llama 3 / 3.1 / 3.2, incl. tied embeddings).

Registered through the ``mcore_zoo`` entry-point group like any third-party plugin. Module import
stays light (no torch / megatron): the converter imports what it needs when called.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}


def convert(reader):  # type: ignore[no-untyped-def]
    """HF ``LlamaConfig`` -> ArchConfig. Biases: ``attention_bias`` (q, k, v, o) and ``mlp_bias``."""
    from mcore_zoo.plugin_api import read_dense_decoder

    attention_bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    mlp_bias = reader.map_checked(
        "mlp_bias",
        "add_bias_linear (MLP biases)",
        attention_bias,
        reason=f"must equal attention_bias={attention_bias}: Megatron-Core's add_bias_linear"
        " switches the attention output and MLP biases together",
        default=False,
    )
    arch = read_dense_decoder(reader, qkv_bias=attention_bias, attn_output_bias=attention_bias)
    return arch.replace(mlp_bias=bool(mlp_bias))


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="LlamaForCausalLM",
            model_type="llama",
            converter="mcore_zoo.plugins.llama:convert",
            weight_rules="mcore_zoo.plugin_api:dense_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            description="Llama 2 / 3 / 3.1 / 3.2 (GQA, llama3 RoPE scaling, tied embeddings)",
        )
    ]
