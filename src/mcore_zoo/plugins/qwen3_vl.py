"""Built-in plugin: ``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``
(Qwen3-VL dense and MoE), vision tower and language model.

The language model is Qwen3's decoder (q/k RMSNorm, no biases; the MoE one Qwen3-MoE's: softmax
top-k router, the top-k weights always renormalised, dense ``mlp_only_layers``) with interleaved
multimodal RoPE over 3-D position ids; the vision tower (Conv3d patches with a learned,
interpolated position grid, LayerNorm blocks with 2-D rotary attending within each frame, the
patch merger and the deepstack mergers) runs on the first stage: its merged features replace the
image / video tokens' embeddings and its deepstack features are added to the first decoder
layers' outputs at those tokens. ``packed_forward`` takes the pixels per sequence
(``vision_inputs``, docs/vision-language.md). Backends ``local`` and ``portable``; one
model-parallel rank (tensor, pipeline and context parallelism refused by name).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

_TEXT = {"model_type": "qwen3_vl_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "attention_bias": False, "hidden_act": "silu",
         "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 3, 3],
                             "mrope_interleaved": True},
         "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
_MOE_TEXT = {**_TEXT, "model_type": "qwen3_vl_moe_text", "intermediate_size": 96, "moe_intermediate_size": 24,
             "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
             "router_aux_loss_coef": 0.001}  # fmt: skip
_VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
           "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip
_TOP = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 248, "vision_end_token_id": 249,
        "tie_word_embeddings": False}  # fmt: skip
#: token ids inside the tiny vocabulary
EXAMPLE_CONFIG = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                  "text_config": _TEXT, "vision_config": _VISION, **_TOP}  # fmt: skip
MOE_EXAMPLE_CONFIG = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                      "text_config": _MOE_TEXT, "vision_config": _VISION, **_TOP}  # fmt: skip


def _attention(reader):  # type: ignore[no-untyped-def]
    """The fields of Qwen3-VL's attention besides the decoder's: no biases, no sliding windows."""
    bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    if bias:
        raise reader.unsupported("attention_bias", bias, "q/k/v/o biases of Qwen3-VL are not built")
    for name in ("use_sliding_window", "sliding_window", "max_window_layers"):
        if reader.has(name):
            reader.ignore(name, "not read by transformers' Qwen3-VL: every layer attends to the whole sequence")


def _multimodal(reader, arch):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import always_interleaved_mrope, check_mrope_sections

    return check_mrope_sections(reader, always_interleaved_mrope(reader, arch))


def convert_text(reader):  # type: ignore[no-untyped-def]
    """``text_config``: Qwen3's decoder with interleaved multimodal RoPE."""
    from mcore_zoo.plugin_api import read_dense_decoder

    _attention(reader)
    arch = read_dense_decoder(reader, qk_norm=True, multimodal_rope=True, interleaved_mrope=True)
    return _multimodal(reader, arch)


def convert_moe_text(reader):  # type: ignore[no-untyped-def]
    """``text_config``: Qwen3-MoE's decoder with interleaved multimodal RoPE."""
    from mcore_zoo.plugin_api import MoESpec, read_aux_loss, read_dense_decoder, read_expert_counts, read_sparse_layers

    _attention(reader)
    field = "num_local_experts" if reader.has("num_local_experts") else "num_experts"  # as transformers writes it
    experts, topk, ffn = read_expert_counts(reader, experts_field=field)
    if reader.has("norm_topk_prob"):
        reader.expect("norm_topk_prob", True, reason="transformers' Qwen3-VL-MoE router always renormalises the"
                      " top-k weights")  # fmt: skip
    pattern = read_sparse_layers(reader, reader.peek("num_hidden_layers"))
    aux = read_aux_loss(reader)
    arch = read_dense_decoder(reader, qk_norm=True, multimodal_rope=True, interleaved_mrope=True)
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, router_score_function="softmax",
                  normalize_topk=True, probs_dtype="hidden", aux_loss_coeff=aux, layer_pattern=pattern)  # fmt: skip
    return _multimodal(reader, arch.replace(moe=moe))


def _convert(reader, convert_text_model):  # type: ignore[no-untyped-def]
    from mcore_zoo.plugin_api import check_tower_fits_decoder, read_language_model, read_qwen3_vision

    return check_tower_fits_decoder(reader, read_language_model(reader, convert_text_model, read_vision=read_qwen3_vision))


def convert(reader):  # type: ignore[no-untyped-def]
    return _convert(reader, convert_text)


def convert_moe(reader):  # type: ignore[no-untyped-def]
    return _convert(reader, convert_moe_text)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="Qwen3VLForConditionalGeneration",
            model_type="qwen3_vl",
            converter="mcore_zoo.plugins.qwen3_vl:convert",
            weight_rules="mcore_zoo.plugin_api:qwen3_vl_weight_map",
            forward="mcore_zoo.plugin_api:vision_language_forward",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen3-VL: the vision tower (learned position grid, 2-D rotary, patch merger, deepstack"
                        " mergers) before Qwen3's decoder with interleaved multimodal RoPE; images per sequence",
        ),
        ModelEntry(
            architecture="Qwen3VLMoeForConditionalGeneration",
            model_type="qwen3_vl_moe",
            converter="mcore_zoo.plugins.qwen3_vl:convert_moe",
            weight_rules="mcore_zoo.plugin_api:qwen3_vl_moe_weight_map",
            forward="mcore_zoo.plugin_api:vision_language_forward",
            example_config=MOE_EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="Qwen3-VL-MoE: Qwen3-VL's vision tower before Qwen3-MoE's decoder (stacked experts in the"
                        " checkpoint) with interleaved multimodal RoPE; images per sequence",
        ),
    ]
