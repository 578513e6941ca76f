"""Vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) into a real in-process ``vllm.LLM``:
the zoo's export (language model and vision tower) loads into vLLM 0.26, and a refit brings back
every engine parameter - the tower's included - and every prompt log-prob bit for bit: the checks
of ``test_refit_gpu.py`` (its ``check`` runs here, one engine per process). The models are shaped
from the published configs with 4 decoder layers at a smaller width (:data:`TEXT_SIZES`; 8 routed
experts) and a two-block tower (:data:`VISION_SIZES`; Qwen3-VL's two deepstack levels on the first
two decoder layers); the vocabulary is the published one, so the image-token ids stay inside it.
token_mult_prob_error of vLLM vs the mcore model is printed (``-s``) and, with
``MCORE_ZOO_GPU_RESULTS`` set, written there as JSON per architecture.

The prompts are text only. vLLM builds the model's transformers processor (``AutoProcessor`` from
the checkpoint directory) when the engine starts; the random-weight checkpoint carries the smallest
set of processor files transformers loads (:mod:`mcore_zoo.parity.processor_files`: a tokenizer that
knows only the vision marker tokens, the image processor's settings), and the zoo's export copies
them next to the weights. That tokenizer cannot turn a text prompt with an image into tokens, and
precomputed ``image_embeds`` inputs skip the tower - so image prompts would not read the refitted
tower's weights. The tower's weights are compared parameter by parameter instead, bitwise, and images run
through the zoo against transformers in the ``vl-gpu`` phase's ``parity-report`` runs.

The engine keeps its tower (no ``limit_mm_per_prompt`` of zero, which would drop it), replicated
(``mm_encoder_tp_mode="data"``, as the refit plan places it), without the multimodal memory
profiling (``skip_mm_profiling``: it feeds the tower dummy images made by the processor). The first
GPU run (2026-11-26) stopped at engine start, before the processor files were written: vLLM 0.26
sizes its encoder budget from the processor's image settings. The engine initialises its tokenizer
(``skip_tokenizer_init=False``, unlike the text models' refit engines): the processor takes it, and
without it transformers' Qwen VL processors fail at construction (the second run, 2026-11-27).

Needs CUDA and vLLM (bench/gpu/vllm-setup.sh, then ``source bench/gpu/vllm-env.sh``); one GPU:

    python3 -m pytest tests/gpu/test_refit_vision_language_gpu.py -q -s
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:  # before any checkpoint is written
    pytestmark = pytest.mark.skip(reason="needs vLLM (bench/gpu/vllm-setup.sh, source bench/gpu/vllm-env.sh)")

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
CASES = [
    ("qwen2.5-vl-7b-instruct.json", "Qwen2_5_VLForConditionalGeneration"),
    ("qwen3-vl-8b-instruct.json", "Qwen3VLForConditionalGeneration"),
    ("qwen3-vl-30b-a3b-instruct.json", "Qwen3VLMoeForConditionalGeneration"),
]
#: the text model's width for the refit (head dimension 128 as published)
TEXT_SIZES = {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 128, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
#: ``vllm.LLM`` arguments: the tower replicated, as the refit plan places it; no multimodal profiling;
#: the tokenizer initialised (the processor needs it)
ENGINE = {"mm_encoder_tp_mode": "data", "skip_mm_profiling": True, "skip_tokenizer_init": False}
#: a two-block tower (head dimension 64; Qwen2.5-VL's second block full attention)
VISION_SIZES = {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2}


def small_vision_language(config: dict, layers: int = 4) -> dict:
    """A published vision-language config with ``layers`` decoder layers and the widths of
    :data:`TEXT_SIZES` / :data:`VISION_SIZES` it has (text fields at the top level or in
    ``text_config``), ``tie_word_embeddings: false`` stated in both places (vLLM builds the
    language model from ``text_config``, transformers reads the top level)."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text.update({key: value for key, value in TEXT_SIZES.items() if key in text})
    text["num_hidden_layers"] = layers
    config["tie_word_embeddings"] = text["tie_word_embeddings"] = False
    vision = config["vision_config"]
    vision.update(VISION_SIZES, out_hidden_size=text["hidden_size"])
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [VISION_SIZES["depth"] - 1]
    if "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = list(range(VISION_SIZES["depth"]))
    return config


@pytest.mark.parametrize("fixture,arch", CASES, ids=[c[1] for c in CASES])
def test_refit_vision_language_into_vllm_is_bitwise(tmp_path, fixture, arch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from .conftest import refit_checkpoint_into_vllm

    config = small_vision_language(json.loads((CONFIGS / fixture).read_text()))
    r = refit_checkpoint_into_vllm(tmp_path, config, fixture, arch, ENGINE)
    assert r["skipped_bucket_params_differ"] > 0
