"""Gated DeltaNet models (Qwen3-Next, Qwen3.5) into a real in-process ``vllm.LLM``: the zoo's export
loads into vLLM 0.26, and a refit brings back every engine parameter and every prompt log-prob bit
for bit - the checks of ``test_refit_gpu.py`` (its ``check`` runs here, one engine per process),
on models shaped from a published config with 4 layers (3 gated DeltaNet, 1 gated attention), no
MTP layer, and, as the other families' refit tests, a smaller width (:data:`REFIT_SIZES`: the
published head dimensions, fewer heads, a 32000-token vocabulary; a refit moves every tensor the
same way at any width). The full-width export is loaded into vLLM by the ``hybrid-gpu`` phase's
``parity-report --vllm`` runs. vLLM stacks Qwen3.5's split
projections into ``in_proj_qkvz`` / ``in_proj_ba`` and names a vision-language checkpoint's
language model ``language_model.model.`` and its vision tower ``visual.`` (the zoo builds, exports
and refits Qwen3.5's tower, one small block here; at engine TP 1 every tower tensor is whole). token_mult_prob_error of vLLM vs the mcore model is
printed (``-s``) and, with ``MCORE_ZOO_GPU_RESULTS`` set, written there as JSON per architecture.

Needs CUDA and vLLM (bench/gpu/vllm-setup.sh, then ``source bench/gpu/vllm-env.sh``); one GPU:

    python3 -m pytest tests/gpu/test_refit_gated_deltanet_gpu.py -q -s
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
#: vLLM 0.26's gated DeltaNet prefill on its Triton kernels: on an H100 its default picks FlashInfer's
#: SM90 kernel, which raises "SM90 GDN prefill DSL kernel is unavailable" without that kernel built
CASES = [
    ("qwen3-next-80b-a3b.json", "Qwen3NextForCausalLM", {"gdn_prefill_backend": "triton"}),
    ("qwen3.5-9b.json", "Qwen3_5ForConditionalGeneration", {"gdn_prefill_backend": "triton"}),
]
#: the text model's width for the refit (head dimensions as published: 128 for the gated DeltaNet, 256 for attention)
REFIT_SIZES = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256,
               "shared_expert_intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
               "linear_num_key_heads": 4, "linear_num_value_heads": 8, "vocab_size": 32000}  # fmt: skip
#: a vision tower shrunk to one small block
SMALL_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}


def few_layers(config: dict, layers: int = 4, experts: int = 64, sizes: dict = REFIT_SIZES) -> dict:
    """A published config with ``layers`` layers (the last one full attention), at most ``experts``
    routed experts, no MTP layer and the text fields of ``sizes`` it has; a vision-language config
    changed in its ``text_config``, its vision tower shrunk."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text.update({key: value for key, value in sizes.items() if key in text})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # inside the smaller vocabulary
        for where in (config, text):
            if isinstance(where.get(key), int) and where[key] >= text["vocab_size"]:
                where[key] = text["vocab_size"] - 1
    text.update(num_hidden_layers=layers, full_attention_interval=layers)
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = ["linear_attention"] * (layers - 1) + ["full_attention"]
    if text.get("num_experts"):
        text["num_experts"] = min(text["num_experts"], experts)
    text.pop("mtp_num_hidden_layers", None)
    text.pop("num_nextn_predict_layers", None)
    if isinstance(config.get("vision_config"), dict):
        config["vision_config"].update(SMALL_VISION, out_hidden_size=text["hidden_size"])
    return config


@pytest.mark.parametrize("fixture,arch,llm_kwargs", CASES, ids=[c[1] for c in CASES])
def test_refit_gated_deltanet_into_vllm_is_bitwise(tmp_path, fixture, arch, llm_kwargs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from .conftest import refit_checkpoint_into_vllm

    config = few_layers(json.loads((CONFIGS / fixture).read_text()))
    refit_checkpoint_into_vllm(tmp_path, config, fixture, arch, llm_kwargs)
