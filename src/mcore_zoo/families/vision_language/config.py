"""The vision-language fields: a ``vision_config`` -> :class:`~mcore_zoo.config.arch.VisionSpec`.

A vision-language config (``*ForConditionalGeneration``) nests the language model under
``text_config`` (read by the text model's converter through
:func:`mcore_zoo.config.language_model.read_language_model`) and the vision tower under
``vision_config``. A tower reader takes the ``vision_config`` reader and the top-level reader (the
marker-token ids live there) and returns the tower's :class:`VisionSpec`; each tower the family
builds has one (``VisionSpec.kind``): :func:`read_qwen2_5_vision` is Qwen2.5-VL's,
:func:`read_qwen3_vision` Qwen3-VL's (dense and MoE alike), :func:`read_qwen3_5_vision` Qwen3.5's
(Qwen3-VL's tower without deepstack mergers).
"""

from __future__ import annotations

import dataclasses

from ...config.arch import ArchConfig, VisionSpec
from ...config.common import classify_common_fields
from ...config.reader import ConfigReader, positive_int

#: the activations of the tower's gated MLP the zoo computes in transformers' op order
VISION_ACTIVATIONS = ("silu", "gelu")
#: the activations of Qwen3-VL's tower MLP the zoo computes in transformers' op order
QWEN3_VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
#: the only RoPE of Qwen2.5-VL's tower: one base, the same frequencies for rows and columns
AXIAL_ROPE = "axial"


def _read_axial_rope(vision: ConfigReader) -> float:
    """``rope_parameters`` of the tower (``{"rope_type": "axial", "rope_theta": base}``) -> the base."""
    params = vision.peek("rope_parameters") or {}
    if not isinstance(params, dict):
        raise vision.unsupported("rope_parameters", params, "expected an object")
    rope_type = params.get("rope_type", AXIAL_ROPE)
    if rope_type != AXIAL_ROPE:
        raise vision.unsupported("rope_parameters.rope_type", rope_type, "the tower's 2-D rotary is axial only")
    unknown = sorted(set(params) - {"rope_type", "rope_theta"})
    if unknown:
        raise vision.unsupported(f"rope_parameters.{unknown[0]}", params[unknown[0]], "not read by the axial rotary")
    theta = params.get("rope_theta", 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise vision.unsupported("rope_parameters.rope_theta", theta, "RoPE base must be a positive number")
    vision.map("rope_parameters", f"2-D rotary of the patches (row, column), axial, base {theta}")
    return float(theta)


def _read_tower_sizes(vision: ConfigReader) -> dict:
    """The fields both Qwen towers read alike: widths, heads, patch geometry."""
    check = dict(reason="must be > 0")
    depth = vision.map_checked("depth", "vision blocks", positive_int, **check)
    hidden = vision.map_checked("hidden_size", "vision width", positive_int, **check)
    heads = vision.map_checked("num_heads", "vision attention heads", positive_int, **check)
    if hidden % heads or (hidden // heads) % 4:
        raise vision.unsupported("num_heads", heads, f"hidden_size={hidden} / num_heads must be a multiple of 4"
                                 " (the 2-D rotary splits each head into rows and columns)")  # fmt: skip
    return dict(
        depth=depth, hidden_size=hidden, num_heads=heads,
        intermediate_size=vision.map_checked("intermediate_size", "vision MLP width", positive_int, **check),
        out_hidden_size=vision.map_checked("out_hidden_size", "patch merger output (the language model's width)",
                                           positive_int, **check),
        in_channels=vision.map_checked("in_channels", "Conv3d input channels", positive_int, **check),
        patch_size=vision.map_checked("patch_size", "Conv3d kernel height and width", positive_int, **check),
        temporal_patch_size=vision.map_checked("temporal_patch_size", "Conv3d kernel depth (frames per patch)",
                                               positive_int, **check),
        spatial_merge_size=vision.map_checked("spatial_merge_size", "patches merged per side into one token",
                                              positive_int, **check),
    )  # fmt: skip


def _marker_tokens(top: ConfigReader) -> dict:
    """The top-level marker-token ids both Qwen towers read alike."""
    return dict(
        image_token_id=top.map("image_token_id", "token replaced by merged image features; image position ids"),
        video_token_id=top.map("video_token_id", "token replaced by merged video features; video position ids"),
        vision_start_token_id=top.ignore("vision_start_token_id", "an ordinary text token to the model: the"
                                         " position ids follow the image tokens themselves"),  # fmt: skip
        vision_end_token_id=top.ignore("vision_end_token_id", "an ordinary text token to the model"),
    )


def read_qwen2_5_vision(vision: ConfigReader, top: ConfigReader) -> VisionSpec:
    """Qwen2.5-VL's ``vision_config`` (and the top-level marker-token ids) -> its :class:`VisionSpec`."""
    classify_common_fields(vision)
    check = dict(reason="must be > 0")
    spec = VisionSpec(
        kind="qwen2_5_vl",
        **_read_tower_sizes(vision),
        window_size=vision.map_checked("window_size", "window attention span in pixels", positive_int, **check),
        fullatt_block_indexes=tuple(vision.map_checked(
            "fullatt_block_indexes", "blocks with attention over the whole frame (the others: windows)",
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(i, int) and 0 <= i for i in v),
            reason="block indexes must be non-negative integers")),  # fmt: skip
        hidden_act=vision.map_checked("hidden_act", "vision MLP activation: act(gate) * up",
                                      lambda v: v in VISION_ACTIVATIONS,
                                      reason=f"supported: {', '.join(VISION_ACTIVATIONS)}"),  # fmt: skip
        tokens_per_second=vision.map_checked("tokens_per_second", "temporal position step of video frames",
                                             lambda v: isinstance(v, (int, float)) and v > 0, reason="must be > 0"),
        rope_theta=_read_axial_rope(vision),
        **_marker_tokens(top),
    )
    if spec.window_size % (spec.spatial_merge_size * spec.patch_size):
        raise vision.unsupported("window_size", spec.window_size,
                                 "must be a multiple of spatial_merge_size * patch_size")  # fmt: skip
    vision.ignore("initializer_range", "random initialisation only; loaded weights do not depend on it")
    # published configs carry two fields transformers' Qwen2.5-VL does not read: values that would
    # describe another tower than the one transformers builds are refused by name
    if vision.has("in_chans"):
        vision.expect("in_chans", spec.in_channels, reason="not read by transformers, whose Conv3d takes in_channels")
    if vision.has("spatial_patch_size"):
        vision.expect("spatial_patch_size", spec.patch_size, reason="not read by transformers, whose patches are"
                      " patch_size wide")  # fmt: skip
    top.ignore("vision_token_id", "not read by transformers' Qwen2.5-VL (an ordinary text token to the model)")
    return spec


def _deepstack_indexes(vision: ConfigReader, depth: int) -> tuple:
    def valid(v: object) -> bool:
        return (isinstance(v, (list, tuple)) and len(set(v)) == len(v)
                and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in v))  # fmt: skip

    return tuple(vision.map_checked(
        "deepstack_visual_indexes", "blocks whose outputs feed the deepstack mergers; merger k's features are"
        " added to decoder layer k's output at the image / video tokens", valid,
        reason=f"distinct block indexes in [0, depth={depth})"))  # fmt: skip


def read_qwen3_vision(vision: ConfigReader, top: ConfigReader) -> VisionSpec:
    """Qwen3-VL's ``vision_config`` (and the top-level marker-token ids) -> its :class:`VisionSpec`
    (``kind="qwen3_vl"``: learned position grid, LayerNorm blocks without windows, deepstack)."""
    return _read_qwen3_tower(vision, top, deepstack=True)


def read_qwen3_5_vision(vision: ConfigReader, top: ConfigReader) -> VisionSpec:
    """Qwen3.5's ``vision_config`` (dense and MoE alike) -> its :class:`VisionSpec`: Qwen3-VL's tower
    (``kind="qwen3_vl"``) without deepstack mergers. transformers' Qwen3.5 tower does not read
    ``deepstack_visual_indexes`` (its published configs carry ``[]``): any other value describes
    another tower and is refused by name."""
    return _read_qwen3_tower(vision, top, deepstack=False)


def _read_qwen3_tower(vision: ConfigReader, top: ConfigReader, deepstack: bool) -> VisionSpec:
    classify_common_fields(vision)
    sizes = _read_tower_sizes(vision)
    positions = vision.map_checked("num_position_embeddings", "learned position grid (a square), interpolated"
                                   " bilinearly to each image's patch grid", positive_int, reason="must be > 0")  # fmt: skip
    if int(positions**0.5) ** 2 != positions:
        raise vision.unsupported("num_position_embeddings", positions, "the learned position grid must be square")
    if deepstack:
        levels = _deepstack_indexes(vision, sizes["depth"])
    else:
        levels = ()
        if vision.has("deepstack_visual_indexes"):
            vision.map_checked("deepstack_visual_indexes", "none: the tower has no deepstack mergers",
                               lambda v: isinstance(v, (list, tuple)) and not v,
                               reason="not read by transformers' Qwen3.5, whose tower has no deepstack mergers")  # fmt: skip
    spec = VisionSpec(
        kind="qwen3_vl",
        **sizes,
        hidden_act=vision.map_checked("hidden_act", "vision MLP activation: linear_fc2(act(linear_fc1(x)))",
                                      lambda v: v in QWEN3_VISION_ACTIVATIONS,
                                      reason=f"supported: {', '.join(QWEN3_VISION_ACTIVATIONS)}"),  # fmt: skip
        rope_theta=_read_axial_rope(vision),
        num_position_embeddings=positions,
        deepstack_visual_indexes=levels,
        frames_per_video_run=True,
        **_marker_tokens(top),
    )
    vision.ignore("initializer_range", "random initialisation only; loaded weights do not depend on it")
    return spec


def check_tower_fits_decoder(reader: ConfigReader, arch: ArchConfig) -> ArchConfig:
    """Refuse a tower whose merged features are not the language model's width, or with more
    deepstack levels than the decoder has layers; ``arch`` unchanged."""
    vision = arch.vision
    levels = len(vision.deepstack_visual_indexes)
    if levels > arch.num_layers:
        raise reader.unsupported("vision_config.deepstack_visual_indexes", list(vision.deepstack_visual_indexes),
                                 f"more deepstack levels than decoder layers ({arch.num_layers})")  # fmt: skip
    if vision.out_hidden_size != arch.hidden_size:
        raise reader.unsupported("vision_config.out_hidden_size", vision.out_hidden_size,
                                 f"must equal the language model's hidden_size ({arch.hidden_size})")  # fmt: skip
    return arch


def check_mrope_sections(reader: ConfigReader, arch: ArchConfig) -> ArchConfig:
    """Refuse ``mrope_section`` that does not add up to half the rotary width (the three position
    rows share the rotary frequencies between them); ``arch`` unchanged."""
    half = int(arch.head_dim * arch.rope.partial_rotary_factor) // 2
    if sum(arch.rope.mrope_section) != half:
        raise reader.unsupported(f"{_rope_source(reader)}.mrope_section", list(arch.rope.mrope_section),
                                 f"the sections must add up to half the rotary width ({half})")  # fmt: skip
    return arch


def always_interleaved_mrope(reader: ConfigReader, arch: ArchConfig) -> ArchConfig:
    """Qwen3-VL's and Qwen3.5's language models: transformers interleaves the multimodal RoPE
    sections whether ``mrope_interleaved`` is given or not; an explicit ``false`` describes another
    model and is refused by name. Returns ``arch`` with the interleaved layout."""
    source = _rope_source(reader)
    given = (reader.peek(source) or {}).get("mrope_interleaved")
    if given is False:
        raise reader.unsupported(f"{source}.mrope_interleaved", given, f"transformers' {reader.architecture}"
                                 " always interleaves the multimodal RoPE sections")  # fmt: skip
    return arch.replace(rope=dataclasses.replace(arch.rope, mrope_interleaved=True))


def _rope_source(reader: ConfigReader) -> str:
    return "rope_parameters" if isinstance(reader.peek("rope_parameters"), dict) else "rope_scaling"
