"""Config reading of the DeepSeek-V2 / V3 decoder: multi-head latent attention (:class:`MLASpec`),
DeepSeek's MoE routers, multi-token prediction, FP8 block-quantized checkpoints and the fields only
the checkpoints' remote modelling code reads.

:func:`read_deepseek` is a whole converter: a DeepSeek-like plugin's ``convert`` is one call
(``read_deepseek(reader, v3=True)``); :func:`read_mla` reads the attention fields alone, for an
architecture that combines MLA with another MLP. Plugins take them from :mod:`mcore_zoo.plugin_api`.

Published configs name remote code (``auto_map``) and some use their own ``model_type`` (Kimi-K2:
``kimi_k2``); they are read with transformers' built-in config classes, remote code is never
executed (:func:`read_remote_code_names`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mcore_zoo.config.arch import ArchConfig, MLASpec, MoESpec, RopeSpec
from mcore_zoo.config.common import read_dense_decoder
from mcore_zoo.config.quantization import read_quantization
from mcore_zoo.config.reader import ConfigReader, positive_int
from mcore_zoo.config.rope import yarn_mscale
from mcore_zoo.families.moe.config import read_expert_counts, read_expert_groups, read_grouped_sigmoid_router, read_shared_experts, read_sparse_layers
from mcore_zoo.families.mtp.config import read_mtp

REMOTE_ONLY = "read only by the checkpoint's remote modelling code (never executed); transformers' DeepseekV3"


def read_mla(reader: ConfigReader, *, heads: int, rope_scaled: bool, rope: RopeSpec,
             interleave_field: bool = True) -> MLASpec:  # fmt: skip
    """The MLA fields (``q_lora_rank``, ``kv_lora_rank``, head dims, ``rope_interleave``; the derived
    ``qk_head_dim`` / ``head_dim`` and ``num_key_value_heads`` checked) -> :class:`MLASpec` with HF's
    softmax scale. ``interleave_field``: DeepSeek-V3's ``rope_interleave`` is read; without it
    (DeepSeek-V2) the rope pairs are interleaved and rotated as complex numbers."""
    q_lora = reader.map_checked("q_lora_rank", "MLATransformerConfig.q_lora_rank (null: one q_proj)",
                                lambda v: v is None or positive_int(v), reason="must be null or > 0", default=None)  # fmt: skip
    kv_lora = reader.map_checked("kv_lora_rank", "MLATransformerConfig.kv_lora_rank", positive_int, reason="must be > 0")
    nope = reader.map_checked("qk_nope_head_dim", "MLATransformerConfig.qk_head_dim", positive_int, reason="must be > 0")
    rope_dim = reader.map_checked("qk_rope_head_dim", "MLATransformerConfig.qk_pos_emb_head_dim (RoPE dims)",
                                  lambda v: positive_int(v) and v % 2 == 0, reason="must be even and > 0")  # fmt: skip
    v_dim = reader.map_checked("v_head_dim", "MLATransformerConfig.v_head_dim", positive_int, reason="must be > 0")
    interleave = True  # V2: always interleaved pairs (complex rotation), no field
    if interleave_field:
        interleave = reader.map_checked("rope_interleave", "RoPE on interleaved pairs of the rope dims (MLA RoPE)",
                                    True, reason="rotate-half on the rope dims (rope_interleave=false) is not"
                                    " what Megatron-Core's MLA RoPE computes", default=True)  # fmt: skip
    # derived by DeepseekV3Config from the fields above
    reader.expect("qk_head_dim", lambda v: v in (None, nope + rope_dim), default=None,
                  reason=f"must be qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim}",
                  detail="derived: qk_nope_head_dim + qk_rope_head_dim")  # fmt: skip
    reader.expect("head_dim", lambda v: v in (None, rope_dim), default=None,
                  reason=f"must be qk_rope_head_dim = {rope_dim} (the RoPE width)",
                  detail="derived: qk_rope_head_dim (the RoPE width)")  # fmt: skip
    reader.expect("num_key_value_heads", lambda v: v in (None, heads), default=None,
                  reason=f"MLA expands keys and values per head: must equal num_attention_heads={heads}",
                  detail="MLA: one key / value per head (= num_attention_heads)")  # fmt: skip
    scale = (nope + rope_dim) ** (-0.5)  # transformers' yarn_apply_mscale, same op order
    if rope_scaled and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return MLASpec(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                   v_head_dim=v_dim, softmax_scale=scale, rope_interleave=bool(interleave),
                   rope_complex=not interleave_field)  # fmt: skip


def read_remote_only(reader: ConfigReader, *, score: str, topk_method: tuple) -> None:
    """DeepSeek-V3 fields only the remote modelling code reads, checked against what the built-in
    model computes (``scoring_func``, ``topk_method``, ``moe_layer_freq``) or ignored with the reason
    (expert-parallel size, auxiliary losses)."""
    # stated in the export when absent: vLLM reads a V3 config without them as softmax scoring
    # without the score-correction bias, and then cannot load the bias the export carries
    reader.expect("scoring_func", score, default=score, reason=f"{REMOTE_ONLY} model always scores with {score}",
                  detail=f"{score} (what transformers' model computes)", state_absent=True)  # fmt: skip
    reader.expect("topk_method", topk_method, default=topk_method[0],
                  reason=f"{REMOTE_ONLY} model routes with {topk_method[0]}",
                  detail=f"{topk_method[0]} (what transformers' model computes)", state_absent=True)  # fmt: skip
    reader.expect("moe_layer_freq", 1, default=1, reason=f"{REMOTE_ONLY} model makes every layer after"
                  " first_k_dense_replace MoE (moe_layer_freq 1)", detail="1: every layer after the dense ones")  # fmt: skip
    reader.ignore("ep_size", "expert-parallel size of the remote inference code; the layout is chosen with Parallelism")
    reader.ignore("aux_loss_alpha", f"{REMOTE_ONLY} model adds no auxiliary loss")
    reader.ignore("seq_aux", f"{REMOTE_ONLY} model adds no auxiliary loss")
    reader.ignore("output_router_logits", "the transformers DeepSeek model adds no load-balancing loss; it only"
                  " returns the router logits")  # fmt: skip
    reader.ignore("router_aux_loss_coef", "not read by the transformers DeepSeek model (no auxiliary loss)")


def read_remote_code_names(reader: ConfigReader, *, config_class: str = "DeepseekV3Config",
                           model_type: str = "deepseek_v3") -> None:  # fmt: skip
    """``auto_map`` / a foreign ``model_type``: recorded as read with the built-in config class."""
    auto_map = reader.peek("auto_map")
    if auto_map:
        named = ", ".join(f"{k}: {v}" for k, v in sorted(dict(auto_map).items()))
        reader.ignore("auto_map", f"names remote code ({named}); read with transformers' built-in {config_class},"
                      " remote code never executed")  # fmt: skip
    given = reader.peek("model_type")
    if given and given != model_type:
        reader.ignore("model_type", f"{given!r}: not a transformers model type; read with transformers'"
                      f" built-in {config_class}, remote code never executed")  # fmt: skip


def read_v2_router(reader: ConfigReader, experts: int, topk: int, expert_ffn_hidden_size: int, *,
                   shared_expert_ffn_hidden_size: Any) -> MoESpec:  # fmt: skip
    """DeepSeek-V2's router: softmax scores in fp32; ``topk_method`` ``greedy`` (top-k of all
    experts) or ``group_limited_greedy`` (within the best ``topk_group`` of ``n_group`` groups, a
    group scoring its best expert; the others masked with 0.0), the top k unsorted either way; the
    chosen scores times ``routed_scaling_factor``, never renormalised; the remote-only fields
    checked or ignored."""
    method = reader.map_checked("topk_method", "greedy: top-k of the softmax scores; group_limited_greedy: within"
                                " the best topk_group of n_group groups (a group scores its best expert)",
                                ("greedy", "group_limited_greedy"), default="greedy",
                                reason="transformers' DeepseekV2 model routes with greedy or group_limited_greedy")  # fmt: skip
    reader.expect("scoring_func", "softmax", default="softmax", detail="softmax (what transformers' model computes)",
                  reason=f"{REMOTE_ONLY} V2 model always scores with softmax")  # fmt: skip
    reader.expect("moe_layer_freq", 1, default=1, reason=f"{REMOTE_ONLY} V2 model makes every layer after"
                  " first_k_dense_replace MoE (moe_layer_freq 1)", detail="1: every layer after the dense ones")  # fmt: skip
    for name in ("ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits", "router_aux_loss_coef"):
        reader.ignore(name, "auxiliary-loss / inference-layout setting; transformers' DeepseekV2 model adds no"
                      " auxiliary loss")  # fmt: skip
    groups = group_topk = None
    if method == "group_limited_greedy":
        groups, group_topk = read_expert_groups(reader, experts, group_score_topk=1)
    else:
        reader.ignore("n_group", "topk_method greedy: no expert groups")
        reader.ignore("topk_group", "topk_method greedy: no expert groups")
    reader.expect("norm_topk_prob", lambda v: not v, default=False, detail="false: the weights are not renormalised",
                  reason="transformers' DeepseekV2 model never renormalises the top-k weights")  # fmt: skip
    scale = reader.map("routed_scaling_factor", "moe_router_topk_scaling_factor", 1.0)
    pattern = read_sparse_layers(reader, reader.peek("num_hidden_layers"), step_field=None, dense_field=None,
                                 first_dense_field="first_k_dense_replace")  # fmt: skip
    grouped = groups is not None and groups > 1
    return MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=expert_ffn_hidden_size,
                   shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size, router_score_function="softmax",
                   router_logits_fp32=True, router_expert_bias=False, num_groups=groups if grouped else None,
                   group_topk=group_topk if grouped else None, group_score_topk=1, topk_sorted=False,
                   group_mask_value=0.0, normalize_topk=False,
                   normalize_eps=0.0, topk_scaling_factor=float(scale), probs_dtype="fp32", layer_pattern=pattern)  # fmt: skip


def read_deepseek(reader: ConfigReader, *, v3: bool) -> ArchConfig:
    """The DeepSeek-V2 / V3 converter (``v3``: the sigmoid router with expert bias and grouped top-k
    by the sum of a group's best two, renormalised - :func:`~mcore_zoo.families.moe.config.read_grouped_sigmoid_router`;
    else V2's softmax router, :func:`read_v2_router`): MTP layers, FP8 quantization, the expert
    counts and shared experts, the dense decoder fields, MLA."""
    mtp = read_mtp(reader)
    quantization = read_quantization(reader)
    reader.expect("attention_bias", False, default=False, reason="Megatron-Core's MLA has no q/kv down-projection"
                  " or o_proj biases", detail="false: no attention biases")  # fmt: skip
    reader.expect("mlp_bias", False, default=False, reason="DeepSeek MLPs have no biases", detail="false: no MLP biases")
    experts, topk, ffn = read_expert_counts(reader, experts_field="n_routed_experts")
    shared = read_shared_experts(reader, ffn)
    if v3:
        read_remote_only(reader, score="sigmoid", topk_method=("noaux_tc",))
        moe = read_grouped_sigmoid_router(reader, experts, topk, ffn, shared_expert_ffn_hidden_size=shared)
        if moe.num_groups == 1:  # one group of all experts: plain top-k (unsorted, as transformers takes it)
            moe = dataclasses.replace(moe, num_groups=None, group_topk=None)
    else:
        moe = read_v2_router(reader, experts, topk, ffn, shared_expert_ffn_hidden_size=shared)
    arch = read_dense_decoder(reader)
    read_remote_code_names(reader, config_class="DeepseekV3Config" if v3 else "DeepseekV2Config",
                           model_type="deepseek_v3" if v3 else "deepseek_v2")  # fmt: skip
    mla = read_mla(reader, heads=arch.num_attention_heads, rope_scaled=arch.rope.rope_type != "default", rope=arch.rope,
                   interleave_field=v3)  # fmt: skip
    return arch.replace(moe=moe, mla=mla, head_dim=mla.q_head_dim, num_query_groups=arch.num_attention_heads,
                        checkpoint_quantization=quantization, mtp_num_layers=mtp, mtp_layer_moe=mtp > 0)
