"""Built-in plugin: ``Qwen3ForCausalLM`` (q/k RMSNorm, head_dim independent of hidden/heads)."""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "max_window_layers": 2,
    "hidden_act": "silu",
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_dense_decoder, read_qwen_window

    bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    if bias:
        raise reader.unsupported(
            "attention_bias",
            bias,
            "Qwen3 has an o_proj bias but no MLP bias; Megatron-Core's add_bias_linear sets both",
        )
    window, flags = read_qwen_window(reader, reader.peek("num_hidden_layers"))
    return read_dense_decoder(reader, qk_norm=True, sliding_window=window, sliding_window_layers=flags)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen3ForCausalLM",
            model_type="qwen3",
            converter="mcore_zoo.plugins.qwen3:convert",
            weight_rules="mcore_zoo.plugin_api:dense_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            description="Qwen3 dense (q/k RMSNorm, head_dim != hidden/heads)",
        )
    ]
