"""Built-in plugin: ``Qwen2ForCausalLM`` (q/k/v biases, tied embeddings of the small sizes,
optional per-layer sliding window)."""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 2,
    "hidden_act": "silu",
}


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_dense_decoder, read_qwen_window

    reader.expect("use_mrope", False, reason="multimodal RoPE (Qwen2-VL) is not supported by Qwen2ForCausalLM", default=False)
    window, flags = read_qwen_window(reader, reader.peek("num_hidden_layers"))
    return read_dense_decoder(reader, qkv_bias=True, attn_output_bias=False, sliding_window=window, sliding_window_layers=flags)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen2ForCausalLM",
            model_type="qwen2",
            converter="mcore_zoo.plugins.qwen2:convert",
            weight_rules="mcore_zoo.plugin_api:dense_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            description="Qwen2 / Qwen2.5 (q/k/v biases, tied embeddings on small sizes)",
        )
    ]
