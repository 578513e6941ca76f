"""Weight tables of DeepSeek-V2 / V3 decoders: multi-head latent attention + DeepSeek MoE.

Megatron-Core ``MLASelfAttention`` parameters (``local`` / ``portable`` backends) and their HF
sources; every tensor keeps HF's layout (mcore splits the same rows the same way):

* ``linear_q_proj`` <- ``q_proj`` (no ``q_lora_rank``), or ``linear_q_down_proj`` <- ``q_a_proj``,
  ``q_layernorm`` <- ``q_a_layernorm``, ``linear_q_up_proj`` <- ``q_b_proj``; rows per head
  ``[nope; rope]``;
* ``linear_kv_down_proj`` <- ``kv_a_proj_with_mqa`` (rows ``[kv_lora_rank latent; qk_rope_head_dim
  shared rope key]``), ``kv_layernorm`` <- ``kv_a_layernorm``, ``linear_kv_up_proj`` <- ``kv_b_proj``
  (rows per head ``[k_nope; v]``);
* ``linear_proj`` <- ``o_proj``.

All column-parallel except ``linear_proj`` (row-parallel): Megatron-Core's local MLA spec builds the
down projections as column-parallel linears whose outputs it gathers, so they split by rows too.
The MoE part is :func:`~mcore_zoo.families.moe.weights.deepseek_moe_rules` (GLM-4.5 shares it).
"""

from __future__ import annotations

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.weights.dense import HF_LAYER, LAYER, decoder_weight_map
from mcore_zoo.weights.rules import Rule, WeightMap, column_parallel, replicated, row_parallel
from mcore_zoo.families.moe.weights import deepseek_moe_rules


def mla_attention_rules(arch: ArchConfig, *, hf_attn: str = "self_attn.") -> list[Rule]:
    """The MLA attention rules of ``arch.mla`` (see the module docstring), HF names under ``hf_attn``."""
    a, m = HF_LAYER + hf_attn, LAYER + "self_attention."
    rules = []
    if arch.mla.q_lora_rank is None:
        rules.append(column_parallel(m + "linear_q_proj.weight", a + "q_proj.weight"))
    else:
        rules += [
            column_parallel(m + "linear_q_down_proj.weight", a + "q_a_proj.weight",
                            note="column-parallel in mcore's local MLA; its output is gathered"),  # fmt: skip
            replicated(m + "q_layernorm.weight", a + "q_a_layernorm.weight"),
            column_parallel(m + "linear_q_up_proj.weight", a + "q_b_proj.weight"),
        ]
    rules += [
        column_parallel(m + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight",
                        note="rows [kv_lora_rank latent; qk_rope_head_dim rope key]; output gathered"),  # fmt: skip
        replicated(m + "kv_layernorm.weight", a + "kv_a_layernorm.weight"),
        column_parallel(m + "linear_kv_up_proj.weight", a + "kv_b_proj.weight", note="rows per head [k_nope; v]"),
        row_parallel(m + "linear_proj.weight", a + "o_proj.weight"),
    ]
    return rules


def deepseek_weight_map(arch: ArchConfig) -> WeightMap:
    """DeepSeek-V2 / V3: embedding, MLA, norms, dense MLPs in the first ``first_k_dense_replace``
    layers, then router (+ ``e_score_correction_bias`` for V3's sigmoid router), routed experts and
    the shared experts."""
    return decoder_weight_map(arch, deepseek_moe_rules(arch), attention=mla_attention_rules(arch))
