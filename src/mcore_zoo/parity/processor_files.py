"""The transformers processor files of a random-weight vision-language checkpoint.

An inference engine builds a vision-language model's transformers processor (``AutoProcessor``:
a tokenizer, an image processor, a video processor) from the checkpoint directory when it starts:
vLLM sizes its multimodal budget with it even when it never tokenizes. A released checkpoint ships
those files (the zoo's exports carry them over: :data:`mcore_zoo.hf_assets.ASSET_PATTERNS`); a
checkpoint built from a config with random weights (:func:`mcore_zoo.parity.reference.write_reference_checkpoint`)
has none, so :func:`write_processor_files` writes the smallest set transformers loads:

* ``tokenizer.json`` / ``tokenizer_config.json``: a word-level tokenizer that knows the model's
  vision marker tokens at the config's ids (``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>``, ``<|video_pad|>``), which is what the processor looks up; it is not a text
  tokenizer (every other word is unknown), and the parity runs feed token ids, never text;
* ``preprocessor_config.json``: the Qwen2-VL image processor with the tower's patch, temporal patch
  and merge sizes, and the released Qwen-VL normalisation (OpenAI CLIP's mean and std) and pixel
  bounds; the video processor reads the same file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

#: the marker tokens the Qwen-VL processors look up, by config field
MARKER_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}  # fmt: skip
#: the released Qwen2.5-VL / Qwen3-VL image processors' normalisation (OpenAI CLIP's)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
#: pixel bounds of the released Qwen2.5-VL processor (4 to 16384 patches of 28 x 28 pixels)
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
UNKNOWN = "<unk>"


def write_processor_files(out_dir: Union[str, os.PathLike], config: dict[str, Any]) -> list[str]:
    """Write the processor files of the module docstring into ``out_dir`` for the HF ``config`` (a
    dict with ``vision_config``; the marker ids at its top level); returns the names written."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vision = config["vision_config"]
    vocab = {UNKNOWN: 0}
    for field, token in MARKER_TOKENS.items():
        if field in config:
            vocab[token] = int(config[field])
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"marker token ids collide with each other or with {UNKNOWN} (id 0): {vocab}")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = Path(out_dir)
    tokenizer.save(str(out / "tokenizer.json"))
    _write(out / "tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer", "unk_token": UNKNOWN,
                                           "model_max_length": 32768})  # fmt: skip
    _write(out / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": int(vision["patch_size"]),
        "temporal_patch_size": int(vision.get("temporal_patch_size", 2)),
        "merge_size": int(vision.get("spatial_merge_size", 2)), "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD)})  # fmt: skip
    return ["tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"]


def _write(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


__all__ = ["MARKER_TOKENS", "write_processor_files"]
