"""Built-in plugin: ``Qwen2_5_VLForConditionalGeneration`` (Qwen2.5-VL), vision tower and language model.

The language model is Qwen2's decoder (q/k/v biases) with multimodal RoPE over 3-D position ids
(``text_config.rope_parameters.mrope_section``); the vision tower (Conv3d patches over frame
pairs, window and full attention blocks with 2-D rotary, the patch merger) runs on the first stage
and its merged features replace the image / video tokens' embeddings. ``packed_forward`` takes the
pixels per sequence (``vision_inputs``, docs/vision-language.md). Backends ``local`` and
``portable``; one model-parallel rank (tensor, pipeline and context parallelism refused by name).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

_TEXT = {
    "model_type": "qwen2_5_vl_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
    "use_sliding_window": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 16,
           "fullatt_block_indexes": [1], "in_channels": 3, "tokens_per_second": 2, "hidden_act": "silu"}  # fmt: skip
#: token ids inside the tiny vocabulary
EXAMPLE_CONFIG = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                  "text_config": _TEXT, "vision_config": _VISION, "image_token_id": 250, "video_token_id": 251,
                  "vision_start_token_id": 248, "vision_end_token_id": 249, "tie_word_embeddings": False}  # fmt: skip


def convert_text(reader):  # type: ignore[no-untyped-def]
    """``text_config``: Qwen2's decoder with multimodal RoPE."""
    from mcore_zoo.plugin_api import check_mrope_sections, read_dense_decoder, read_qwen_window

    window, _ = read_qwen_window(reader, reader.peek("num_hidden_layers"))
    if window is not None:
        raise reader.unsupported("use_sliding_window", True, "sliding windows of Qwen2.5-VL are not built yet")
    arch = read_dense_decoder(reader, qkv_bias=True, attn_output_bias=False, multimodal_rope=True)
    return check_mrope_sections(reader, arch)


def convert(reader):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import read_language_model, read_qwen2_5_vision

    return read_language_model(reader, convert_text, read_vision=read_qwen2_5_vision)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen2_5_VLForConditionalGeneration",
            model_type="qwen2_5_vl",
            converter="mcore_zoo.plugins.qwen2_5_vl:convert",
            weight_rules="mcore_zoo.plugin_api:qwen2_5_vl_weight_map",
            forward="mcore_zoo.plugin_api:vision_language_forward",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen2.5-VL: the vision tower (window / full attention, 2-D rotary, patch merger) before"
                        " Qwen2's decoder with multimodal RoPE; images per sequence in THD packs",
        )
    ]
