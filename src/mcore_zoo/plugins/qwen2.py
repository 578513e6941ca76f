"""Built-in plugin: ``Qwen2ForCausalLM`` (q/k/v biases, tied embeddings of the small sizes,
optional per-layer sliding window)."""

from __future__ import annotations

from mcore_zoo.entry import ModelEntry
from mcore_zoo.hookspecs import hookimpl

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


def read_qwen_window(reader, num_layers):  # type: ignore[no-untyped-def]
    """Sliding-window fields shared by Qwen2 / Qwen3 (``use_sliding_window``, ``sliding_window``,
    ``max_window_layers``, transformers-5 ``layer_types``) -> (window, per-layer flags)."""
    from mcore_zoo.config.common import read_layer_types

    use = reader.peek("use_sliding_window", False)
    if not use:
        reader.ignore("use_sliding_window", "false: full attention in every layer")
        reader.ignore("sliding_window", "unused: use_sliding_window is false")
        reader.ignore("max_window_layers", "unused: use_sliding_window is false")
        window = None
    else:
        reader.map("use_sliding_window", "sliding-window attention on")
        window = reader.map("sliding_window", "window_size=(sliding_window - 1, 0)")
        if not isinstance(window, int) or window < 1:
            raise reader.unsupported("sliding_window", window, "must be a positive integer")
    if reader.has("layer_types"):
        flags = read_layer_types(reader, num_layers, window)
    elif window is not None:
        first = reader.map("max_window_layers", "window_attn_skip_freq: layers >= max_window_layers slide")
        flags = tuple(i >= first for i in range(num_layers))
        flags = flags if any(flags) else None
    else:
        flags = None
    if window is not None and reader.has("max_window_layers") and reader.has("layer_types"):
        reader.ignore("max_window_layers", "already applied by transformers in layer_types")
    if window is not None and flags is None:
        window = None  # no layer slides
    return window, flags


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.config.common import read_dense_decoder

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
            weight_rules="mcore_zoo.weights.dense:dense_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            description="Qwen2 / Qwen2.5 (q/k/v biases, tied embeddings on small sizes)",
        )
    ]
