"""Built-in plugin: ``DeepseekV3ForCausalLM`` (DeepSeek-V3 / R1, Moonlight-16B-A3B, Kimi-K2).

Multi-head latent attention (:mod:`mcore_zoo.specs.mla`): ``q_lora_rank`` (null: a plain ``q_proj``),
``kv_lora_rank``, ``qk_nope_head_dim`` + ``qk_rope_head_dim`` per query / key head,
``v_head_dim``; RoPE (default or YaRN with ``mscale`` / ``mscale_all_dim``) on the rope dims only,
interleaved pairs (``rope_interleave``). Softmax scale ``(nope + rope) ** -0.5``, times
``mscale(factor, mscale_all_dim) ** 2`` under YaRN, as transformers computes it.

MoE as transformers' DeepSeek-V3 computes it (GLM-4.5's router: :mod:`mcore_zoo.plugins.glm4_moe`):
sigmoid scores in fp32, experts chosen by ``scores + e_score_correction_bias`` within the best
``topk_group`` of ``n_group`` groups (a group scores the sum of its best two), weights = the
unbiased scores renormalised (``norm_topk_prob``, +1e-20) times ``routed_scaling_factor``;
``n_shared_experts`` always-on experts; the first ``first_k_dense_replace`` layers dense.

Published configs name remote code (``auto_map``: ``configuration_deepseek.DeepseekV3Config``) and
some use their own ``model_type`` (Kimi-K2: ``kimi_k2``). The zoo reads them with transformers'
built-in ``DeepseekV3Config``; remote code is never executed. Fields only the remote code reads
(``scoring_func``, ``topk_method``, ``moe_layer_freq``, ``ep_size``, ...) are checked against what
the built-in model computes.

Multi-token prediction (``num_nextn_predict_layers: 1``) is built as Megatron-Core's MTP block on
the last pipeline stage (:mod:`mcore_zoo.specs.mtp`), loaded from the checkpoint's
``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer,
``shared_head.norm``; its ``embed_tokens`` / ``shared_head.head`` copies are checked equal to the
model's embedding / ``lm_head``): :mod:`mcore_zoo.config.mtp`, :mod:`mcore_zoo.weights.mtp`. The
caller may still drop the MTP layers explicitly (``ignore_fields={"num_nextn_predict_layers":
reason}``: no MTP block, their tensors ignored by name). Transformers' model has no MTP layer (it
ignores ``model.layers.61.*``).
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

EXAMPLE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},  # fmt: skip
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "num_nextn_predict_layers": 0,
}

REMOTE_ONLY = "read only by the checkpoint's remote modelling code (never executed); transformers' DeepseekV3"


def read_mla(reader, *, heads: int, rope_scaled: bool, rope, interleave_field: bool = True):  # type: ignore[no-untyped-def]
    """The MLA fields (``q_lora_rank``, ``kv_lora_rank``, head dims, ``rope_interleave``)."""
    from mcore_zoo.config.arch import MLASpec
    from mcore_zoo.config.rope import yarn_mscale

    def positive(v):  # type: ignore[no-untyped-def]
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    q_lora = reader.map_checked("q_lora_rank", "MLATransformerConfig.q_lora_rank (null: one q_proj)",
                                lambda v: v is None or positive(v), reason="must be null or > 0", default=None)  # fmt: skip
    kv_lora = reader.map_checked("kv_lora_rank", "MLATransformerConfig.kv_lora_rank", positive, reason="must be > 0")
    nope = reader.map_checked("qk_nope_head_dim", "MLATransformerConfig.qk_head_dim", positive, reason="must be > 0")
    rope_dim = reader.map_checked("qk_rope_head_dim", "MLATransformerConfig.qk_pos_emb_head_dim (RoPE dims)",
                                  lambda v: positive(v) and v % 2 == 0, reason="must be even and > 0")  # fmt: skip
    v_dim = reader.map_checked("v_head_dim", "MLATransformerConfig.v_head_dim", positive, reason="must be > 0")
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


def read_quantization(reader):  # type: ignore[no-untyped-def]
    """``quantization_config``: an FP8 block-quantized checkpoint (DeepSeek-V3 / R1, Kimi-K2 publish
    theirs so) is dequantized on load; every other quantization is refused, naming it."""
    q = reader.peek("quantization_config")
    if not q:
        reader.ignore("quantization_config", "null")
        return None
    from mcore_zoo.weights.fp8 import Fp8BlockFormat

    fmt = Fp8BlockFormat.from_hf(q, architecture=reader.architecture)  # refusals name quantization_config.<key>
    reader.map("quantization_config", f"FP8 block-quantized checkpoint ({fmt.fmt}, blocks {list(fmt.block)}):"
               " F8 weights dequantized with their weight_scale_inv into the model dtype on load;"
               " save_hf_checkpoint(fp8=True) writes the format back")  # fmt: skip
    return dict(q)


def read_remote_only(reader, *, score: str, topk_method: tuple) -> None:  # type: ignore[no-untyped-def]
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


def read_remote_code_names(reader, *, config_class: str = "DeepseekV3Config", model_type: str = "deepseek_v3") -> None:  # type: ignore[no-untyped-def]
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


def read_deepseek(reader, *, v3: bool):  # type: ignore[no-untyped-def]
    """The DeepSeek-V2 / V3 converter (``v3``: sigmoid router with expert bias and grouped top-k by
    the sum of a group's best two, renormalised; else V2's softmax router, ``greedy`` or
    ``group_limited_greedy`` by a group's best expert, never renormalised)."""
    from mcore_zoo.config.arch import MoESpec
    from mcore_zoo.config.moe import read_expert_counts, read_sparse_layers
    from mcore_zoo.config.mtp import read_mtp
    from mcore_zoo.plugin_api import read_dense_decoder

    mtp = read_mtp(reader)
    quantization = read_quantization(reader)
    reader.expect("attention_bias", False, default=False, reason="Megatron-Core's MLA has no q/kv down-projection"
                  " or o_proj biases", detail="false: no attention biases")  # fmt: skip
    reader.expect("mlp_bias", False, default=False, reason="DeepSeek MLPs have no biases", detail="false: no MLP biases")
    experts, topk, ffn = read_expert_counts(reader, experts_field="n_routed_experts")
    shared = reader.map_checked("n_shared_experts", "moe_shared_expert_intermediate_size = n * moe_intermediate_size",
                                lambda v: v is None or (isinstance(v, int) and v >= 0), reason="must be >= 0", default=None)  # fmt: skip
    if v3:
        method = "noaux_tc"
        read_remote_only(reader, score="sigmoid", topk_method=("noaux_tc",))
    else:
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
    grouped = v3 or method == "group_limited_greedy"
    if grouped:
        groups = reader.map_checked("n_group", "expert groups (moe_router_num_groups)",
                                    lambda v: isinstance(v, int) and v > 0 and experts % v == 0,
                                    reason=f"must divide n_routed_experts={experts}", default=1)  # fmt: skip
        group_topk = reader.map_checked("topk_group", "groups chosen per token (moe_router_group_topk)",
                                        lambda v: isinstance(v, int) and 0 < v <= groups,
                                        reason=f"must be in [1, n_group={groups}]", default=1)  # fmt: skip
        if v3 and (experts // groups) < 2:
            raise reader.unsupported("n_group", groups, "a group scores the sum of its best two experts: needs >= 2 per group")
    else:
        groups = group_topk = None
        reader.ignore("n_group", "topk_method greedy: no expert groups")
        reader.ignore("topk_group", "topk_method greedy: no expert groups")
    if v3:
        norm = bool(reader.map("norm_topk_prob", "top-k weights divided by their sum + 1e-20 (HF order)", True))
    else:
        norm = False
        reader.expect("norm_topk_prob", lambda v: not v, default=False, detail="false: the weights are not renormalised",
                      reason="transformers' DeepseekV2 model never renormalises the top-k weights")  # fmt: skip
    scale = reader.map("routed_scaling_factor", "moe_router_topk_scaling_factor", 1.0)
    layers = reader.peek("num_hidden_layers")
    pattern = read_sparse_layers(reader, layers, step_field=None, dense_field=None, first_dense_field="first_k_dense_replace")
    arch = read_dense_decoder(reader)
    read_remote_code_names(reader, config_class="DeepseekV3Config" if v3 else "DeepseekV2Config",
                           model_type="deepseek_v3" if v3 else "deepseek_v2")  # fmt: skip
    mla = read_mla(reader, heads=arch.num_attention_heads, rope_scaled=arch.rope.rope_type != "default", rope=arch.rope,
                   interleave_field=v3)  # fmt: skip
    moe = MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=ffn,
                  shared_expert_ffn_hidden_size=(shared * ffn) if shared else None,
                  router_score_function="sigmoid" if v3 else "softmax", router_logits_fp32=True,
                  router_expert_bias=v3, num_groups=groups if grouped and groups > 1 else None,
                  group_topk=group_topk if grouped and groups > 1 else None, group_score_topk=2 if v3 else 1,
                  normalize_topk=norm, normalize_eps=1e-20 if norm else 0.0, topk_scaling_factor=float(scale),
                  probs_dtype="fp32", layer_pattern=pattern)  # fmt: skip
    return arch.replace(moe=moe, mla=mla, head_dim=mla.q_head_dim, num_query_groups=arch.num_attention_heads,
                        checkpoint_quantization=quantization, mtp_num_layers=mtp, mtp_layer_moe=mtp > 0)


def convert(reader):  # type: ignore[no-untyped-def]
    return read_deepseek(reader, v3=True)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture="DeepseekV3ForCausalLM",
            model_type="deepseek_v3",
            converter="mcore_zoo.plugins.deepseek_v3:convert",
            weight_rules="mcore_zoo.weights.mla:deepseek_weight_map",
            example_config=EXAMPLE_CONFIG,
            backends=("te", "local", "portable"),
            description="DeepSeek-V3 / R1, Moonlight, Kimi-K2 (MLA, YaRN mscale; sigmoid grouped router with"
                        " expert bias, shared experts); MTP built (or dropped on request)",  # fmt: skip
        )
    ]
