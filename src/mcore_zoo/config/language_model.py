"""The language model of a vision-language checkpoint (``*ForConditionalGeneration``): its
``text_config`` read as the text model's own config, the vision tower's fields classified as its.

A vision-language config nests the language model's fields under ``text_config`` and the vision
tower's under ``vision_config``; the top level holds the ids of the image / video marker tokens and
whether the output layer is tied to the embedding. :func:`read_language_model` converts
``text_config`` with the text model's converter (its records and errors name the fields
``text_config.<field>``), records every ``vision_config`` field as belonging to the vision tower,
which is not built, and classifies the top-level fields. The model built from the result is the
language model alone: it reads token ids, never pixels (the weight side:
:func:`mcore_zoo.weights.language_model.language_model_weight_map`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .arch import ArchConfig
from .common import classify_common_fields
from .reader import ConfigReader

TEXT, VISION = "text_config", "vision_config"
#: why each ``vision_config`` field is ignored
VISION_TOWER = ("belongs to the vision tower, which is not built: the language model alone is, and the"
                " checkpoint's vision-tower tensors are reported as not loaded")  # fmt: skip
#: the top-level fields of Qwen-VL configs that mark image and video positions in a token sequence
MARKER_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
MARKER_REASON = ("id of an image / video marker token, which the vision tower's features replace; the language"
                 " model alone embeds it as an ordinary token")  # fmt: skip
TIED_BY_TOP_LEVEL = "the top-level tie_word_embeddings decides (transformers ties the vision-language model by it)"


def text_hf_config(hf_config: Any) -> Any:
    """The language model's HF config: ``text_config`` of a vision-language config, else the config."""
    text = hf_config.get(TEXT) if hasattr(hf_config, "get") else None
    return text if isinstance(text, dict) else hf_config


def read_language_model(reader: ConfigReader, convert_text: Callable[[ConfigReader], ArchConfig],
                        read_vision: Optional[Callable[[ConfigReader, ConfigReader], Any]] = None) -> ArchConfig:
    """A vision-language config -> the :class:`ArchConfig` of its language model (module docstring).

    ``convert_text``: the converter of the text model (it reads ``text_config`` as that model's own
    config). The output layer is tied as the top-level ``tie_word_embeddings`` says.
    ``read_vision``: ``(vision_config reader, top-level reader) -> VisionSpec`` of a model whose
    vision tower is built: it classifies every ``vision_config`` field and the marker-token ids
    (``ArchConfig.vision``); without it the tower's fields are recorded as not built."""
    for name in (TEXT, VISION):
        if not isinstance(reader.peek(name), dict):
            raise reader.unsupported(name, reader.peek(name), "a vision-language config nests it as an object")
    text = reader.nested(TEXT)
    arch = convert_text(text)
    if text.has("tie_word_embeddings"):
        text.ignore("tie_word_embeddings", TIED_BY_TOP_LEVEL)
    reader.adopt(TEXT, text, "the language model: its fields are the text_config.* records")
    vision = reader.nested(VISION)
    tower = None
    if read_vision is not None:
        tower = read_vision(vision, reader)
        reader.adopt(VISION, vision, "the vision tower: its fields are the vision_config.* records")
    else:
        for name in vision.config:
            if name not in vision.records:
                vision.ignore(name, VISION_TOWER)
        reader.adopt(VISION, vision, "the vision tower, not built: " + VISION_TOWER)
        for name in MARKER_TOKENS:
            reader.ignore(name, MARKER_REASON)
    tied = reader.map("tie_word_embeddings", "share_embeddings_and_output_weights (the output layer is the"
                      " language model's embedding)", False)  # fmt: skip
    classify_common_fields(reader)
    return arch.replace(architecture=reader.architecture, model_type=reader.peek("model_type", arch.model_type),
                        tie_word_embeddings=bool(tied), vision=tower)  # fmt: skip
