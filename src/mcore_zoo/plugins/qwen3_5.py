"""Built-in plugin: ``Qwen3_5ForCausalLM`` (Qwen3.5 dense) and ``Qwen3_5MoeForCausalLM`` (Qwen3.5-MoE),
the text models.

Qwen3-Next's decoder (gated DeltaNet layers among gated full-attention layers, ``layer_types``;
q/k RMSNorm, partial RoPE, ``1 + weight`` RMSNorm) with the DeltaNet's input projections split
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Its RoPE is Qwen3-VL's text M-RoPE
(``rope_parameters.mrope_section``), which text position ids reduce to plain RoPE. The dense model
has the gated MLP on every layer; the MoE model has on every layer the softmax top-k router (top-k
weights always renormalised) and a sigmoid-gated shared expert. transformers does not read
``attn_output_gate`` (always gated), ``norm_topk_prob``, ``decoder_sparse_step`` or
``mlp_only_layers`` for these models: values that would describe another model are refused by name.
Backends ``local`` and ``portable``; tensor (the MoE model trains with sequence parallelism), pipeline
and expert parallelism; context parallelism is refused by name; the MTP layer is refused unless
dropped on request.

``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration`` (the published
vision-language checkpoints), built whole: ``text_config`` read as the text model's own config
with its M-RoPE kept as interleaved multimodal RoPE over 3-D position ids (Qwen3-VL's), the vision
tower Qwen3-VL's without deepstack mergers (``read_qwen3_5_vision``); the language model under
``model.language_model.*``, the tower under ``model.visual.*``. ``packed_forward`` takes the
pixels per sequence (``vision_inputs``, docs/vision-language.md); without them the model runs
token ids as a text model.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
         "mrope_interleaved": True}  # fmt: skip
_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_parameters": _ROPE,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
}
EXAMPLE_CONFIG = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **_COMMON,
                  "intermediate_size": 128}  # fmt: skip
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
           "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []}  # fmt: skip
#: the marker-token ids inside the tiny vocabulary (those of Qwen3-VL's example)
_MARKERS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 248, "vision_end_token_id": 249}
EXAMPLE_MOE_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    **_COMMON,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}



def _vision_language(architecture: str, model_type: str, text: dict) -> dict:
    """A vision-language example: ``text`` as its ``text_config``, a tiny vision tower."""
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")}
    return {"architectures": [architecture], "model_type": model_type, "text_config": text_config,
            "vision_config": dict(_VISION), **_MARKERS, "tie_word_embeddings": False}  # fmt: skip


EXAMPLE_VL_CONFIG = _vision_language("Qwen3_5ForConditionalGeneration", "qwen3_5", EXAMPLE_CONFIG)
EXAMPLE_MOE_VL_CONFIG = _vision_language("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", EXAMPLE_MOE_CONFIG)

#: fields of Qwen's other configs that transformers' Qwen3.5 models never read
UNREAD = ("use_sliding_window", "sliding_window", "max_window_layers")
EVERY_LAYER = "transformers' Qwen3.5 models give every layer the same MLP block"


def _read_token_mixers(reader):  # type: ignore[no-untyped-def]
    """The fields both models share but the dense decoder reader: the gated DeltaNet (split
    projections), attention bias and gate, MTP, the layer-pattern fields transformers drops."""
    from mcore_zoo.plugin_api import read_attention_output_gate, read_gated_deltanet, read_gated_deltanet_mtp
    from mcore_zoo.plugin_api import refuse_vision_language_config

    refuse_vision_language_config(reader)
    bias = reader.map("attention_bias", "add_qkv_bias and add_bias_linear (q/k/v/o biases)", False)
    if bias:
        raise reader.unsupported("attention_bias", bias, "Megatron-Core's add_bias_linear would also add MLP biases")
    for name in UNREAD:
        reader.ignore(name, "not read by transformers' Qwen3.5 models (no sliding window)")
    if reader.has("mlp_only_layers"):
        reader.map_checked("mlp_only_layers", "none: " + EVERY_LAYER, lambda v: not v,
                           reason="not read by transformers: " + EVERY_LAYER)  # fmt: skip
    if reader.has("decoder_sparse_step"):
        reader.map_checked("decoder_sparse_step", "1: " + EVERY_LAYER, lambda v: v == 1,
                           reason="not read by transformers: " + EVERY_LAYER)  # fmt: skip
    read_attention_output_gate(reader)
    linear = read_gated_deltanet(reader, reader.peek("num_hidden_layers"), projections="split")
    read_gated_deltanet_mtp(reader)
    return linear


def _dense(reader, multimodal: bool):  # type: ignore[no-untyped-def]
    """The dense text model: the gated MLP on every layer (``multimodal``: the RoPE of :func:`_rope`)."""
    from mcore_zoo.plugin_api import read_dense_decoder

    linear = _read_token_mixers(reader)
    arch = _rope(reader, read_dense_decoder(reader, qk_norm=True, **_rope_options(multimodal)), multimodal)
    return arch.replace(gated_deltanet=linear, attention_output_gate=True, zero_centered_norm=True)


def _moe(reader, multimodal: bool):  # type: ignore[no-untyped-def]
    """The MoE text model: the MoE block on every layer (``multimodal``: the RoPE of :func:`_rope`)."""
    from mcore_zoo.plugin_api import MoESpec, read_aux_loss, read_dense_decoder, read_expert_counts

    linear = _read_token_mixers(reader)
    experts, topk, ffn = read_expert_counts(reader, experts_field="num_experts")
    shared = reader.map_checked("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size (+ moe_shared"
                                "_expert_gate: sigmoid(shared_expert_gate(x)) scales it)", lambda v: isinstance(v, int)
                                and v > 0, reason="the HF model always has a shared expert: must be > 0")  # fmt: skip
    if reader.has("norm_topk_prob"):
        reader.map_checked("norm_topk_prob", "top-k weights divided by their sum (HF order)", lambda v: v is True,
                           reason="not read by transformers: its Qwen3.5-MoE router always renormalises")  # fmt: skip
    reader.ignore("intermediate_size", "no dense MLP in transformers' Qwen3.5-MoE model (every layer MoE)")
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn, shared_expert_ffn_hidden_size=shared,
                  shared_expert_gate=True, router_score_function="softmax", normalize_topk=True, probs_dtype="hidden",
                  layer_pattern=None, aux_loss_coeff=read_aux_loss(reader))  # fmt: skip
    arch = read_dense_decoder(reader, qk_norm=True, ffn_hidden_size=ffn, **_rope_options(multimodal))
    arch = _rope(reader, arch, multimodal)
    return arch.replace(moe=moe, gated_deltanet=linear, attention_output_gate=True, zero_centered_norm=True)


def _rope_options(multimodal: bool) -> dict:
    """The text model's M-RoPE over identical text position ids (plain RoPE), or the
    vision-language model's interleaved multimodal RoPE over 3-D position ids."""
    return dict(multimodal_rope=True, interleaved_mrope=True) if multimodal else dict(text_mrope=True)


def _rope(reader, arch, multimodal: bool):  # type: ignore[no-untyped-def]
    """transformers' Qwen3.5 text rotary interleaves the sections whatever ``mrope_interleaved``
    says (an explicit ``false`` refused); the sections add up to half the rotary width."""
    from mcore_zoo.plugin_api import always_interleaved_mrope, check_mrope_sections

    return check_mrope_sections(reader, always_interleaved_mrope(reader, arch)) if multimodal else arch


def convert(reader):  # type: ignore[no-untyped-def]
    """``Qwen3_5ForCausalLM``: the gated MLP (``intermediate_size``) on every layer."""
    return _dense(reader, multimodal=False)


def convert_moe(reader):  # type: ignore[no-untyped-def]
    """``Qwen3_5MoeForCausalLM``: the MoE block on every layer."""
    return _moe(reader, multimodal=False)


def _vision_language_model(reader, text_model):  # type: ignore[no-untyped-def]
    """``text_config`` read by ``text_model`` with multimodal RoPE, ``vision_config`` as Qwen3.5's tower."""
    from mcore_zoo.plugin_api import check_tower_fits_decoder, read_language_model, read_qwen3_5_vision

    arch = read_language_model(reader, lambda text: text_model(text, multimodal=True), read_vision=read_qwen3_5_vision)
    return check_tower_fits_decoder(reader, arch)


def convert_vl(reader):  # type: ignore[no-untyped-def]
    """``Qwen3_5ForConditionalGeneration``: the dense language model on ``text_config`` with its tower."""
    return _vision_language_model(reader, _dense)


def convert_moe_vl(reader):  # type: ignore[no-untyped-def]
    """``Qwen3_5MoeForConditionalGeneration``: the MoE language model on ``text_config`` with its tower."""
    return _vision_language_model(reader, _moe)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    common = dict(weight_rules="mcore_zoo.plugin_api:gated_deltanet_weight_map",
                  layer_spec="mcore_zoo.plugin_api:hybrid_layer_specs", backends=("te", "local", "portable"))  # fmt: skip
    vision_language = dict(common, weight_rules="mcore_zoo.plugin_api:gated_deltanet_vision_language_weight_map",
                           forward="mcore_zoo.plugin_api:vision_language_forward")  # fmt: skip
    return [
        ModelEntry(
            architecture="Qwen3_5ForCausalLM",
            model_type="qwen3_5_text",
            converter="mcore_zoo.plugins.qwen3_5:convert",
            example_config=EXAMPLE_CONFIG,
            description="Qwen3.5 dense, text (gated DeltaNet with split projections among gated attention,"
                        " text M-RoPE = partial RoPE, 1 + weight RMSNorm)",
            **common,
        ),
        ModelEntry(
            architecture="Qwen3_5MoeForCausalLM",
            model_type="qwen3_5_moe_text",
            converter="mcore_zoo.plugins.qwen3_5:convert_moe",
            example_config=EXAMPLE_MOE_CONFIG,
            description="Qwen3.5-MoE, text (Qwen3.5's token mixers; softmax top-k MoE, renormalised, with a"
                        " sigmoid-gated shared expert on every layer)",
            **common,
        ),
        ModelEntry(
            architecture="Qwen3_5ForConditionalGeneration",
            model_type="qwen3_5",
            converter="mcore_zoo.plugins.qwen3_5:convert_vl",
            example_config=EXAMPLE_VL_CONFIG,
            description="Qwen3.5 dense, vision-language: Qwen3-VL's vision tower without deepstack mergers before"
                        " Qwen3.5's decoder with interleaved multimodal RoPE; images per sequence",
            **vision_language,
        ),
        ModelEntry(
            architecture="Qwen3_5MoeForConditionalGeneration",
            model_type="qwen3_5_moe",
            converter="mcore_zoo.plugins.qwen3_5:convert_moe_vl",
            example_config=EXAMPLE_MOE_VL_CONFIG,
            description="Qwen3.5-MoE, vision-language: Qwen3-VL's vision tower without deepstack mergers before"
                        " Qwen3.5-MoE's decoder with interleaved multimodal RoPE; images per sequence",
            **vision_language,
        ),
    ]
