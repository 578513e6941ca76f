"""Weight tables of DeepSeek sparse attention decoders (DeepSeek-V3.2, GLM-5): the DeepSeek-V3 table
(:func:`~mcore_zoo.families.mla.weights.deepseek_weight_map`: MLA, DeepSeek MoE, MTP) plus each
layer's lightning indexer, replicated over TP (every rank selects the same keys):

=============================================  ===============================================
HF ``model.layers.{layer}.self_attn.indexer.``  Megatron-Core ``decoder.layers.{layer}.self_attention.indexer.``
=============================================  ===============================================
``wq_b.weight``                                ``linear_wq_b.weight``
``wk.weight``                                  ``linear_wk.weight``
``k_norm.weight`` / ``k_norm.bias``            ``k_norm.weight`` / ``k_norm.bias``
``weights_proj.weight``                        ``linear_weights_proj.weight``
=============================================  ===============================================

The MTP layers carry their own indexer (``model.layers.{num_hidden_layers}.self_attn.indexer.*``),
moved there with the rest of the layer's rules.
"""

from __future__ import annotations

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.families.mla.weights import mla_attention_rules
from mcore_zoo.families.moe.weights import deepseek_moe_rules
from mcore_zoo.weights.dense import HF_LAYER, LAYER, decoder_weight_map
from mcore_zoo.weights.rules import Rule, WeightMap, replicated

#: (Megatron-Core name under the layer's ``self_attention.indexer.``, HF name under ``self_attn.indexer.``)
INDEXER_TENSORS = (
    ("linear_wq_b.weight", "wq_b.weight"),
    ("linear_wk.weight", "wk.weight"),
    ("k_norm.weight", "k_norm.weight"),
    ("k_norm.bias", "k_norm.bias"),
    ("linear_weights_proj.weight", "weights_proj.weight"),
)


def indexer_rules(arch: ArchConfig) -> list[Rule]:
    """The lightning indexer's rules of one layer (replicated: every TP rank holds it whole)."""
    m, hf = LAYER + "self_attention.indexer.", HF_LAYER + "self_attn.indexer."
    return [replicated(m + ours, hf + theirs, note="DSA indexer, replicated over TP") for ours, theirs in INDEXER_TENSORS]


def dsa_weight_map(arch: ArchConfig) -> WeightMap:
    """DeepSeek-V3.2 / GLM-5: the DeepSeek-V3 table with each layer's indexer."""
    return decoder_weight_map(arch, deepseek_moe_rules(arch), attention=[*mla_attention_rules(arch), *indexer_rules(arch)])
