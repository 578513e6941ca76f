"""The plugin module named by the ``mcore_zoo`` entry point: one :class:`~mcore_zoo.ModelEntry`.

Importing it is cheap (no torch, Megatron-Core or transformers): the entry names its callables as
``"module:attr"`` strings that mcore-zoo resolves when the architecture is used.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

#: A tiny Phi-3 (random weights make sense at this size): 2 layers, GQA 4/2, head_dim 16, and a
#: sliding window shorter than the test sequences so that the window is exercised.
EXAMPLE_CONFIG = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "original_max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "sliding_window": 24,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Phi3ForCausalLM",
            model_type="phi3",
            converter="mcore_zoo_phi3.convert:convert",
            weight_rules="mcore_zoo_phi3.weights:weight_map",
            example_config=EXAMPLE_CONFIG,
            hf_model_class="transformers:Phi3ForCausalLM",
            description="Phi-3 / Phi-3.5 / Phi-4-mini with default RoPE (fused qkv_proj and gate_up_proj,"
            " sliding window, partial rotary); longrope is refused",
        )
    ]
