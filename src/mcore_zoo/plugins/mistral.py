"""Built-in plugin: ``MistralForCausalLM`` (sliding-window attention honoured exactly)."""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 24,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def convert(reader):  # type: ignore[no-untyped-def]
    """HF ``MistralConfig`` -> ArchConfig. ``sliding_window`` applies to every layer (HF: a query
    sees the last ``sliding_window`` keys, itself included)."""
    from mcore_zoo.plugin_api import read_dense_decoder

    window = reader.map(
        "sliding_window",
        "window_size=(sliding_window - 1, 0) on every layer",
        None,
    )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise reader.unsupported("sliding_window", window, "must be a positive integer or null")
    return read_dense_decoder(reader, sliding_window=window)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="MistralForCausalLM",
            model_type="mistral",
            converter="mcore_zoo.plugins.mistral:convert",
            weight_rules="mcore_zoo.plugin_api:dense_decoder_weight_map",
            example_config=EXAMPLE_CONFIG,
            description="Mistral (sliding-window attention, GQA)",
        )
    ]
