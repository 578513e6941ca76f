"""Refit of the vision-language models into vLLM 0.26's names and fusions (CPU).

The reference re-implements what vLLM's ``load_weights`` makes of the HF checkpoint, from its
tables copied below as data: the ``hf_to_vllm_mapper.orig_to_new_prefix`` of ``qwen2_5_vl.py``
(checkpoints with the language model under ``model.`` and the tower under ``visual.``) and of
``qwen3_vl.py`` (``model.language_model.`` / ``model.visual.``; ``qwen3_vl_moe.py`` inherits it),
the towers' ``orig_to_new_stacked`` (Qwen2.5-VL's ``mlp.gate_proj`` / ``up_proj`` into
``gate_up_proj``; the fused ``attn.qkv`` loaded whole) with the tower replicated on every rank
(``mm_encoder_tp_mode="data"``: ``disable_tp``), the language model as
:func:`~tests.unit.test_refit.vllm_engine_tensors` lays out a text model, and Qwen3-VL-MoE's
stacked experts (``experts.gate_up_proj [E, H, 2I]``, gate and up in contiguous halves, and
``experts.down_proj [E, I, H]``) as ``RoutedExperts``' fused mapping loads them into ``w13_weight
[E, 2I / tp, H]`` (``[gate_r; up_r]``) and ``w2_weight [E, H, I / tp]``. A refit of the zoo-built
model must reproduce those engine tensors bit for bit, at engine TP 1 and 2 (Qwen3-VL-MoE: at
engine TP 1; above it the contiguous gate / up halves are refused by name, before any transfer).
"""

from __future__ import annotations

import json

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError
from mcore_zoo.rollout import DictAdapter

from .test_refit import _setup, assert_same, vllm_engine_tensors

#: ``orig_to_new_prefix`` of vLLM 0.26's model classes, in their order (the first match applies)
VLLM_PREFIXES = {
    "Qwen2_5_VLForConditionalGeneration": {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                                           "lm_head.": "language_model.lm_head.", "model.": "language_model.model."},
    "Qwen3VLForConditionalGeneration": {"model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
                                        "model.language_model.": "language_model.model."},
}
VLLM_PREFIXES["Qwen3VLMoeForConditionalGeneration"] = VLLM_PREFIXES["Qwen3VLForConditionalGeneration"]
#: the towers' ``orig_to_new_stacked`` (Qwen2.5-VL's MLP; both fused ``attn.qkv`` load whole)
VISION_STACKED = {".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)}


def _vllm_name(arch: str, name: str) -> str:
    for old, new in VLLM_PREFIXES[arch].items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _stacked_experts(params: dict, name: str, w: torch.Tensor, rank: int, tp: int) -> bool:
    """``RoutedExperts``' fused mapping of a stacked-experts tensor, if ``name`` is one."""
    stem, _, leaf = name.rpartition(".")
    if not stem.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
        return False
    if leaf == "gate_up_proj":  # [E, H, 2I]: w1 = columns :I, w3 = columns I:, each split over tp
        inter = w.shape[2] // 2
        per = inter // tp
        gate, up = (w[:, :, half * inter + rank * per: half * inter + (rank + 1) * per] for half in (0, 1))
        params[stem + ".routed_experts.w13_weight"] = torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()
    else:  # [E, I, H]: rows split over tp, transposed
        per = w.shape[1] // tp
        params[stem + ".routed_experts.w2_weight"] = w[:, rank * per:(rank + 1) * per].transpose(1, 2).contiguous()
    return True


def vllm_vision_language_tensors(arch: str, hf: dict[str, torch.Tensor], config: dict, tp: int) -> list[dict[str, torch.Tensor]]:
    """What vLLM's ``load_weights`` leaves in a vision-language model's parameters per TP rank."""
    text_config = {**config, **config.get("text_config", {})}
    mapped = {_vllm_name(arch, name): w for name, w in hf.items()}
    language = {name[len("language_model."):]: w for name, w in mapped.items() if name.startswith("language_model.")}
    dense = {name: w for name, w in language.items() if not _stacked_experts({}, name, w, 0, 1)}
    out = vllm_engine_tensors(dense, text_config, tp)
    for rank, params in enumerate(out):
        for name in list(params):
            params["language_model." + name] = params.pop(name)
        for name, w in language.items():
            _stacked_experts(params, "language_model." + name, w, rank, tp)
        for name, w in mapped.items():
            if not name.startswith("visual."):
                continue
            hit = next(((k, v) for k, v in VISION_STACKED.items() if k in name), None)
            if hit is None:
                params[name] = w.clone()  # replicated tower (disable_tp)
                continue
            (_, (_, shard)), target = hit, name.replace(hit[0], hit[1][0])
            if target not in params:
                params[target] = torch.full((2 * w.shape[0], *w.shape[1:]), float("nan"), dtype=w.dtype)
            params[target].narrow(0, shard * w.shape[0], w.shape[0]).copy_(w)
    return out


ARCHS = ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"]


def untied_text_config(arch: str) -> dict:
    """Overrides that write ``text_config.tie_word_embeddings: false`` where the example leaves it
    out: vLLM builds the language model from ``text_config`` (``with_hf_config``), whose
    transformers default for Qwen3-VL-MoE is tied, while transformers reads the top-level field
    (false) - the published configs state both."""
    text = mcore_zoo.lookup(arch).example_config().get("text_config")
    return {} if text is None else {"text_config": {**text, "tie_word_embeddings": False}}


CASES = [(arch, tp) for arch in ARCHS for tp in (1, 2) if not (arch.startswith("Qwen3VLMoe") and tp == 2)]


@pytest.mark.parametrize("arch,tp", CASES, ids=[f"{a}-tp{tp}" for a, tp in CASES])
def test_refit_reproduces_vllms_loader_bitwise(mpu, reference_checkpoint, arch, tp):
    _, model, config, hf = _setup(reference_checkpoint, arch, untied_text_config(arch))
    adapter = DictAdapter(tp_size=tp)
    mcore_zoo.refit(model, adapter, bucket_size="64KB")
    want = vllm_vision_language_tensors(arch, hf, config, tp)
    assert_same(adapter.tensors, want)
    for got in adapter.tensors:
        assert any(n.startswith("visual.blocks.0.attn.qkv.") for n in got)
        assert not any(n.startswith("model.") or n.startswith("lm_head.") for n in got), sorted(got)[:4]


def test_qwen3_vl_moe_gate_up_halves_above_engine_tp_1_are_refused_by_name(mpu, reference_checkpoint):
    arch = ARCHS[2]
    _, model, _, _ = _setup(reference_checkpoint, arch, untied_text_config(arch))
    adapter = DictAdapter(tp_size=2)
    with pytest.raises(ZooError, match=r"experts\.gate_up_proj'.*contiguous halves.*engine TP 2"):
        mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert adapter.calls == []


def test_the_gpu_refit_configs_convert_with_the_tower_shrunk():
    """The configs ``tests/gpu/test_refit_vision_language_gpu.py`` writes from the published ones
    convert (every field classified): four decoder layers, a two-block tower, untied embeddings."""
    from tests.gpu.test_refit_vision_language_gpu import CASES as GPU_CASES
    from tests.gpu.test_refit_vision_language_gpu import CONFIGS, small_vision_language

    for fixture, arch in GPU_CASES:
        config = small_vision_language(json.loads((CONFIGS / fixture).read_text()))
        plugin = mcore_zoo.lookup(config)
        assert plugin.name == arch
        converted = plugin.config_from_hf(config)
        assert converted.num_layers == 4 and converted.vision.depth == 2 and not converted.tie_word_embeddings
        assert converted.vision.out_hidden_size == converted.hidden_size == 1024


def test_a_text_prompt_runs_as_a_right_padded_batch_as_the_gpu_refit_check_runs_it(mpu, reference_checkpoint):
    """``test_refit_gpu.check`` compares vLLM with ``packed_forward(..., seq_format="bshd")`` on text
    prompts: a vision-language model runs them as a text model, each sequence of the batch equal to
    itself run alone (within 1e-5: the padded batch's GEMMs see other row counts)."""
    from mcore_zoo.testing.common import random_sequences

    arch = ARCHS[1]
    _, model, _, _ = _setup(reference_checkpoint, arch, untied_text_config(arch))
    seqs = random_sequences([9, 17], 200, seed=3)
    with torch.no_grad():
        bshd = mcore_zoo.packed_forward(model.eval(), seqs, seq_format="bshd").logprobs
        alone = [mcore_zoo.packed_forward(model, [s], seq_format="bshd").logprobs[0] for s in seqs]
    for a, b in zip(bshd, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
