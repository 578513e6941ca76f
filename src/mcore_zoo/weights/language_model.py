"""The weight table of a vision-language checkpoint's language model (``*ForConditionalGeneration``).

transformers' Qwen-VL models hold the text model under ``model.language_model.`` (``model.layers``
-> ``model.language_model.layers``, ``model.embed_tokens``, ``model.norm``), the output layer as
``lm_head.weight`` and the vision tower under ``model.visual.``. :func:`language_model_weight_map`
moves a text model's table under that prefix and ignores the vision tower's tensors by name, so a
load reports each of them as not loaded (``LoadReport.ignored``), and an export writes the language
model's tensors under the checkpoint's own names.
"""

from __future__ import annotations

import dataclasses
import re

from .rules import WeightMap

TEXT_MODEL, LANGUAGE_MODEL = "model.", "model.language_model."
VISION_TOWER = r"model\.visual\..*"
VISION_TOWER_REASON = "vision tower, not built: the language model alone is loaded"


def _moved(name: str) -> str:
    return LANGUAGE_MODEL + name[len(TEXT_MODEL):] if name.startswith(TEXT_MODEL) else name


def _moved_pattern(pattern: str) -> str:
    text = re.escape(TEXT_MODEL)
    return re.escape(LANGUAGE_MODEL) + pattern[len(text):] if pattern.startswith(text) else pattern


def language_model_weight_map(text: WeightMap) -> WeightMap:
    """``text`` (a text model's table) with every HF name under ``model.`` moved under
    ``model.language_model.`` (rules, ignore patterns, copies), and the vision tower ignored."""
    rules = [dataclasses.replace(r, sources=tuple(dataclasses.replace(s, hf=_moved(s.hf)) for s in r.sources))
             for r in text.rules]  # fmt: skip
    ignored = [(_moved_pattern(p), reason) for p, reason in text.ignored] + [(VISION_TOWER, VISION_TOWER_REASON)]
    copies = [(_moved(c), _moved(s)) for c, s in text.copies]
    return WeightMap(text.arch, rules, ignored, copies)
