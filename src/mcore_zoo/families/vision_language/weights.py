"""The weight tables of vision-language models: the language model's and the vision tower's
(Megatron-Core side: the first stage's ``vision_model.``).

The zoo's tower keeps transformers' parameter names (:mod:`.vision`), so every tower tensor is one
replicated rule ``vision_model.<name> <- <prefix><name>``; a tower of another kind brings its own
names (:data:`TOWER_TENSORS`). Two checkpoint layouts: Qwen2.5-VL's published one (and what
transformers writes for it) keeps the language model under ``model.`` and the tower under
``visual.`` (:func:`qwen2_5_vl_weight_map`); the newer one nests them under
``model.language_model.`` and ``model.visual.`` (:func:`vision_language_weight_map`, the text
table moved by :func:`mcore_zoo.weights.language_model.language_model_weight_map`, the tower
loaded instead of ignored): Qwen3-VL's (:func:`qwen3_vl_weight_map`,
:func:`qwen3_vl_moe_weight_map`).
"""

from __future__ import annotations

from ...config.arch import ArchConfig, VisionSpec
from ...weights.dense import decoder_weight_map, dense_decoder_weight_map, gated_mlp_rules
from ...weights.language_model import VISION_TOWER, language_model_weight_map
from ...weights.rules import Rule, WeightMap, replicated

MCORE_TOWER, HF_TOWER, HF_TOWER_TOP_LEVEL = "vision_model.", "model.visual.", "visual."


def qwen2_5_vision_tensor_names(spec: VisionSpec) -> list[str]:
    """The parameter names of Qwen2.5-VL's tower (transformers' and the zoo's alike)."""
    names = ["patch_embed.proj.weight"]
    for i in range(spec.depth):
        block = f"blocks.{i}."
        names += [block + "norm1.weight", block + "norm2.weight"]
        names += [block + f"attn.{p}.{t}" for p in ("qkv", "proj") for t in ("weight", "bias")]
        names += [block + f"mlp.{p}.{t}" for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")]
    names += ["merger.ln_q.weight"] + [f"merger.mlp.{i}.{t}" for i in (0, 2) for t in ("weight", "bias")]
    return names


def _linears(prefix: str, names: tuple) -> list[str]:
    return [f"{prefix}{p}.{t}" for p in names for t in ("weight", "bias")]


def _qwen3_merger_tensor_names(prefix: str) -> list[str]:
    return _linears(prefix, ("norm", "linear_fc1", "linear_fc2"))


def qwen3_vision_tensor_names(spec: VisionSpec) -> list[str]:
    """The parameter names of Qwen3-VL's tower (transformers' and the zoo's alike)."""
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"]
    for i in range(spec.depth):
        names += _linears(f"blocks.{i}.", ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    names += _qwen3_merger_tensor_names("merger.")
    for k in range(len(spec.deepstack_visual_indexes)):
        names += _qwen3_merger_tensor_names(f"deepstack_merger_list.{k}.")
    return names


#: each tower's parameter names, by ``VisionSpec.kind``
TOWER_TENSORS = {"qwen2_5_vl": qwen2_5_vision_tensor_names, "qwen3_vl": qwen3_vision_tensor_names}


def vision_tower_rules(spec: VisionSpec, hf_prefix: str = HF_TOWER) -> list[Rule]:
    """One replicated rule per tower parameter (the tower is not split under tensor parallelism)."""
    return [replicated(MCORE_TOWER + name, hf_prefix + name) for name in TOWER_TENSORS[spec.kind](spec)]


def vision_language_weight_map(text: WeightMap) -> WeightMap:
    """``text`` (the language model's text table) under ``model.language_model.``, plus the tower."""
    moved = language_model_weight_map(text)
    ignored = [(p, reason) for p, reason in moved.ignored if p != VISION_TOWER]
    return WeightMap(moved.arch, list(moved.rules) + vision_tower_rules(text.arch.vision), ignored, moved.copies)


def qwen3_vl_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen3-VL: Qwen3's dense decoder (q/k norms) under ``model.language_model.``, the tower under
    ``model.visual.``."""
    return vision_language_weight_map(dense_decoder_weight_map(arch))


def qwen3_vl_moe_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen3-VL-MoE: Qwen3-MoE's decoder whose checkpoints stack every expert of a layer
    (:func:`~mcore_zoo.families.moe.weights.stacked_transposed_expert_rules`), under
    ``model.language_model.``, the tower under ``model.visual.``."""
    from ..moe.weights import stacked_transposed_expert_rules

    mlp = gated_mlp_rules(arch, layer_kind="dense") + stacked_transposed_expert_rules(arch)
    return vision_language_weight_map(decoder_weight_map(arch, mlp))


def qwen2_5_vl_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen2.5-VL: Qwen2's dense decoder (q/k/v biases) under ``model.``, the tower under ``visual.``."""
    text = dense_decoder_weight_map(arch)
    return WeightMap(text.arch, list(text.rules) + vision_tower_rules(arch.vision, HF_TOWER_TOP_LEVEL),
                     text.ignored, text.copies)  # fmt: skip
