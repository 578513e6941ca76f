"""Mixture-of-experts config helpers: HF MoE fields -> :class:`MoESpec`, :class:`MoESpec` ->
Megatron-Core ``TransformerConfig`` fields.

Plugins read their family's fields with the ``read_*`` helpers (each field is classified through
the :class:`~mcore_zoo.config.reader.ConfigReader`, like every other field; plugins take them from
:mod:`mcore_zoo.plugin_api`). The router kinds the zoo computes in HF's op order
(:mod:`mcore_zoo.families.moe.spec`) and their readers:

* softmax over all experts, top-k, renormalised or not (Qwen2-MoE, Qwen3-MoE, Mixtral):
  :func:`read_expert_counts`, :func:`read_sparse_layers`, :func:`read_aux_loss`, built into a
  :class:`MoESpec` by the plugin;
* sigmoid scores with an expert-bias choice within the best groups, renormalised and scaled, plus
  shared experts (GLM-4.5, DeepSeek-V3): :func:`read_grouped_sigmoid_router`;
* the pieces the DeepSeek-V2 softmax router shares with it: :func:`read_shared_experts`,
  :func:`read_expert_groups`;
* top-k of biased logits, softmax over the k, experts with biases and a clamped SwiGLU (gpt-oss):
  :func:`read_clamped_swiglu` and ``MoESpec(softmax_over_topk=True)``.

:func:`moe_config_kwargs` is what the zoo's config builder adds for an architecture with ``arch.moe``:

* dropless routing (no capacity factor) and no token dropping, as every HF model computes;
* ``moe_router_score_function`` / ``moe_router_pre_softmax`` / ``moe_router_topk_scaling_factor`` /
  groups / expert bias set to the closest stock Megatron-Core routing. The zoo's own router
  (:mod:`mcore_zoo.families.moe.spec`, numerics knob ``router="hf"``, the default) overrides the
  arithmetic to follow HF's op order exactly; these fields still drive Megatron-Core's aux-loss
  and bookkeeping code and the stock router (``router="mcore"``);
* the token dispatcher: ``alltoall`` on CUDA, ``allgather`` on the CPU (Megatron-Core's all-to-all
  dispatcher creates CUDA streams); both are dropless and give the same tokens to each expert;
* ``moe_grouped_gemm`` from the numerics knob ``grouped_experts`` (:func:`check_grouped_experts`
  says where it can be honoured).
"""

from __future__ import annotations

from typing import Any, Optional

from mcore_zoo.errors import ZooError
from mcore_zoo.config.arch import ArchConfig, ClampedSwiGLU, MoESpec
from mcore_zoo.config.reader import ConfigReader, positive_int



def read_expert_counts(reader: ConfigReader, *, experts_field: str, topk_field: str = "num_experts_per_tok",
                       ffn_field: str = "moe_intermediate_size") -> tuple[int, int, int]:  # fmt: skip
    """``(num_experts, top_k, expert_ffn_hidden_size)`` (all required, positive)."""
    experts = reader.map_checked(experts_field, "num_moe_experts", positive_int, reason="must be > 0")
    topk = reader.map_checked(topk_field, "moe_router_topk", lambda v: positive_int(v) and v <= experts,
                              reason=f"must be in [1, {experts_field}={experts}]")  # fmt: skip
    ffn = reader.map_checked(ffn_field, "moe_ffn_hidden_size (per expert)", positive_int, reason="must be > 0")
    return experts, topk, ffn


#: Megatron-Core's ``quick_gelu`` gain: ``x * sigmoid(1.702 * x)``
QUICK_GELU_ALPHA = 1.702


def read_clamped_swiglu(reader: ConfigReader, *, alpha_field: str = "swiglu_alpha",
                        limit_field: str = "swiglu_limit") -> ClampedSwiGLU:  # fmt: skip
    """The experts' clamped SwiGLU (gpt-oss: ``swiglu_alpha``, ``swiglu_limit``). Megatron-Core
    computes it as ``quick_gelu(gate) * (up + glu_linear_offset)`` with ``activation_func_clamp_value``,
    whose gain is fixed at 1.702: another ``alpha`` is refused."""
    alpha = reader.map_checked(alpha_field, "ClampedSwiGLU.alpha (Megatron-Core quick_gelu's 1.702)",
                               lambda v: float(v) == QUICK_GELU_ALPHA, default=QUICK_GELU_ALPHA,
                               reason="Megatron-Core's quick_gelu computes x * sigmoid(1.702 * x); another gain has"
                               " no Megatron-Core activation")  # fmt: skip
    limit = reader.map_checked(limit_field, "ClampedSwiGLU.limit (activation_func_clamp_value)",
                               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                               default=7.0, reason="must be a positive number")  # fmt: skip
    return ClampedSwiGLU(alpha=float(alpha), limit=float(limit))


def read_mxfp4_experts(reader: ConfigReader) -> Optional[dict[str, Any]]:
    """``quantization_config`` of a checkpoint whose routed experts are MXFP4 (gpt-oss as published:
    ``quant_method`` ``"mxfp4"``, the other modules listed in ``modules_to_not_convert``): loading
    dequantizes the experts as transformers does (:mod:`mcore_zoo.weights.mxfp4`). ``None``:
    unquantized. Any other method is refused (the generic reading, by name)."""
    config = reader.peek("quantization_config")
    if not config:
        return None
    if not isinstance(config, dict) or config.get("quant_method") != "mxfp4":
        raise reader.unsupported("quantization_config", config, "only MXFP4 experts (quant_method 'mxfp4') are read"
                                 " for this architecture; load a dequantized checkpoint")  # fmt: skip
    unknown = sorted(set(config) - {"quant_method", "modules_to_not_convert"})
    if unknown:
        raise reader.unsupported(f"quantization_config.{unknown[0]}", config[unknown[0]],
                                 "not a field of the published MXFP4 format")  # fmt: skip
    reader.map("quantization_config", "checkpoint_quantization: MXFP4 expert blocks dequantized as read"
               " (modules_to_not_convert: the tensors stored unquantized)")  # fmt: skip
    return dict(config)


def read_no_jitter(reader: ConfigReader, field: str = "router_jitter_noise") -> None:
    """HF Mixtral multiplies the whole MoE input (router *and* experts) by uniform noise in
    training; Megatron-Core's ``moe_input_jitter_eps`` jitters the router input only, and the noise
    cannot be reproduced anyway. Only 0 is exact."""
    reader.expect(field, lambda v: not v, default=0.0, detail="0: no jitter (HF applies it in training only)",
                  reason="router jitter noise multiplies the MoE input by random noise in training (router and"
                  " experts); Megatron-Core jitters the router input only and the noise is not reproducible:"
                  " set it to 0")  # fmt: skip


def read_aux_loss(reader: ConfigReader, *, coef_field: str = "router_aux_loss_coef",
                  switch_field: Optional[str] = "output_router_logits") -> float:  # fmt: skip
    """HF adds ``coef * load_balancing_loss`` to the LM loss only when ``output_router_logits`` is
    set; the same switch decides here (``moe_aux_loss_coeff``, ``moe_router_load_balancing_type``).

    The loss is Megatron-Core's Switch loss per MoE layer (summed over layers, divided by top-k),
    attached to the graph in training. HF computes one loss over all layers' router logits
    concatenated (a product of cross-layer means) and does not divide by top-k, so the values
    and gradients differ from HF's; the coefficient means the same thing (weight of a
    load-balancing term) and the forward is unaffected."""
    on = True
    if switch_field is not None:
        on = bool(reader.map(switch_field, "moe_aux_loss_coeff is router_aux_loss_coef when true, else 0", False))
    coef = reader.map(coef_field, "moe_aux_loss_coeff (load-balancing loss, Switch form) when output_router_logits",
                      0.0)  # fmt: skip
    return float(coef or 0.0) if on else 0.0


def read_sparse_layers(reader: ConfigReader, num_layers: int, *, step_field: Optional[str] = "decoder_sparse_step",
                       dense_field: Optional[str] = "mlp_only_layers",
                       first_dense_field: Optional[str] = None) -> Optional[tuple]:  # fmt: skip
    """Per-layer MoE flags from Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` (layer ``i`` is
    MoE iff ``i`` not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``) or GLM /
    DeepSeek's ``first_k_dense_replace`` (the first k layers are dense). ``None``: every layer."""
    flags = [True] * num_layers
    if step_field is not None:
        step = reader.map_checked(step_field, "moe_layer_freq (layer i is MoE iff (i + 1) % step == 0)",
                                  positive_int, reason="must be > 0", default=1)  # fmt: skip
        flags = [f and (i + 1) % step == 0 for i, f in enumerate(flags)]
    if dense_field is not None:
        dense = reader.map(dense_field, "moe_layer_freq (these layers use a dense MLP)", None) or []
        if not isinstance(dense, (list, tuple)) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
            raise reader.unsupported(dense_field, dense, f"must list layer indices in [0, {num_layers})")
        flags = [f and i not in set(dense) for i, f in enumerate(flags)]
    if first_dense_field is not None:
        k = reader.map_checked(first_dense_field, "moe_layer_freq (the first k layers use a dense MLP)",
                               lambda v: isinstance(v, int) and 0 <= v <= num_layers,
                               reason=f"must be in [0, {num_layers}]", default=0)  # fmt: skip
        flags = [f and i >= k for i, f in enumerate(flags)]
    if not any(flags):
        raise reader.unsupported(dense_field or step_field or first_dense_field, reader.peek(dense_field or ""),
                                 "no layer is an MoE layer: convert it as the dense architecture")  # fmt: skip
    return None if all(flags) else tuple(flags)


def read_shared_experts(reader: ConfigReader, expert_ffn_hidden_size: int, *,
                        field: str = "n_shared_experts") -> Optional[int]:  # fmt: skip
    """``n_shared_experts`` always-on experts, each as wide as a routed one (GLM-4.5, DeepSeek): the
    summed width (``moe_shared_expert_intermediate_size``), or ``None`` for none."""
    shared = reader.map_checked(field, "moe_shared_expert_intermediate_size = n * moe_intermediate_size",
                                lambda v: v is None or (isinstance(v, int) and v >= 0), reason="must be >= 0", default=None)  # fmt: skip
    return (shared * expert_ffn_hidden_size) if shared else None


_BEST = {1: "its best expert", 2: "the sum of its best two experts"}


def read_expert_groups(reader: ConfigReader, experts: int, *, group_score_topk: int = 2) -> tuple[int, int]:
    """``(n_group, topk_group)``: experts are chosen within the best ``topk_group`` of ``n_group``
    groups, a group scoring the sum of its best ``group_score_topk`` experts (GLM-4.5 / DeepSeek-V3:
    2; DeepSeek-V2's ``group_limited_greedy``: 1)."""
    groups = reader.map_checked("n_group", "expert groups (moe_router_num_groups)",
                                lambda v: isinstance(v, int) and v > 0 and experts % v == 0,
                                reason=f"must divide n_routed_experts={experts}", default=1)  # fmt: skip
    group_topk = reader.map_checked("topk_group", "groups chosen per token (moe_router_group_topk)",
                                    lambda v: isinstance(v, int) and 0 < v <= groups, reason=f"must be in [1, n_group={groups}]",
                                    default=1)  # fmt: skip
    if group_score_topk > 1 and (experts // groups) < group_score_topk:
        best = _BEST.get(group_score_topk, f"the sum of its best {group_score_topk} experts")
        raise reader.unsupported("n_group", groups, f"a group scores {best}: needs >= {group_score_topk} per group")
    return groups, group_topk


def read_grouped_sigmoid_router(reader: ConfigReader, experts: int, topk: int, expert_ffn_hidden_size: int, *,
                                shared_expert_ffn_hidden_size: Optional[int]) -> MoESpec:  # fmt: skip
    """The GLM-4.5 / DeepSeek-V3 router as transformers computes it: router logits in fp32, sigmoid
    scores; experts chosen by ``scores + e_score_correction_bias`` within the best ``topk_group`` of
    ``n_group`` groups (a group scores the sum of its best two; the others masked with ``-inf``), the
    top k unsorted; weights = the unbiased scores,
    renormalised (``norm_topk_prob``, +1e-20) and times ``routed_scaling_factor``, kept in fp32;
    dense MLPs in the first ``first_k_dense_replace`` layers. Reads ``n_group``, ``topk_group``,
    ``norm_topk_prob``, ``routed_scaling_factor`` and ``first_k_dense_replace``; the counts and the
    shared experts come from :func:`read_expert_counts` and :func:`read_shared_experts`."""
    groups, group_topk = read_expert_groups(reader, experts, group_score_topk=2)
    norm = bool(reader.map("norm_topk_prob", "top-k weights divided by their sum + 1e-20 (HF order)", True))
    scale = reader.map("routed_scaling_factor", "moe_router_topk_scaling_factor", 1.0)
    pattern = read_sparse_layers(reader, reader.peek("num_hidden_layers"), step_field=None, dense_field=None,
                                 first_dense_field="first_k_dense_replace")  # fmt: skip
    return MoESpec(num_experts=experts, top_k=topk, expert_ffn_hidden_size=expert_ffn_hidden_size,
                   shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size, router_score_function="sigmoid",
                   router_logits_fp32=True, router_expert_bias=True, num_groups=groups, group_topk=group_topk,
                   group_score_topk=2, topk_sorted=False, normalize_topk=norm, normalize_eps=1e-20 if norm else 0.0,
                   topk_scaling_factor=float(scale), probs_dtype="fp32", layer_pattern=pattern)  # fmt: skip


def check_grouped_experts(arch: ArchConfig, backend: str, *, cuda: bool = True) -> None:
    """Raise :class:`~mcore_zoo.errors.ZooError` unless the numerics knob ``grouped_experts=True``
    can be honoured for ``arch`` on ``backend`` (``cuda``: the build is for a CUDA device).

    Grouped experts are Megatron-Core's ``TEGroupedMLP``: Transformer Engine's ``GroupedLinear``,
    CUDA only. Megatron-Core's other grouped module, the legacy ``GroupedMLP``, is no way around it:
    it needs the CUDA ``grouped_gemm`` package, bf16 and no biases, and 0.19 removed it."""
    if backend != "te":
        raise ZooError(
            f"{arch.architecture}: numerics knob grouped_experts=True needs backend 'te' (Transformer Engine's"
            f" grouped GEMM, Megatron-Core's TEGroupedMLP); backend {backend!r} has sequential experts only:"
            " set grouped_experts=False or use backend 'te'"
        )
    if not cuda:
        raise ZooError(f"{arch.architecture}: numerics knob grouped_experts=True (Transformer Engine's grouped GEMM)"
                       " needs a CUDA device; this build is for the CPU")  # fmt: skip


def moe_config_kwargs(arch: ArchConfig, *, cuda: bool, grouped_experts: bool = False) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``arch.moe`` (see the module docstring).
    ``grouped_experts``: the numerics knob, already checked by :func:`check_grouped_experts`."""
    moe: MoESpec = arch.moe  # type: ignore[assignment]
    pattern = [int(moe.is_moe_layer(i)) for i in range(arch.num_layers)]
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_layer_freq=pattern,
        moe_router_score_function=moe.router_score_function,
        # HF scores every expert, then picks the top k. With softmax that is mcore's pre-softmax
        # mode; HF's renormalised top-k equals mcore's softmax over the top-k logits in exact
        # arithmetic (the zoo's router reproduces HF's rounding).
        # gpt-oss (softmax_over_topk): the top k logits, then a softmax over them - mcore's default order
        moe_router_pre_softmax=moe.router_score_function == "softmax" and not moe.normalize_topk
        and not moe.softmax_over_topk,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        moe_router_num_groups=moe.num_groups if (moe.num_groups or 1) > 1 else None,
        moe_router_group_topk=moe.group_topk if (moe.num_groups or 1) > 1 else None,
        moe_router_dtype="fp32" if moe.router_logits_fp32 else None,
        moe_router_fusion=False,
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        moe_grouped_gemm=grouped_experts,
        moe_permute_fusion=False,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_shared_expert_overlap=False,
    )
    if moe.router_expert_bias:
        # aux-loss-free balancing updates the bias from token counts during training; the zoo
        # loads the checkpoint's bias and leaves updating it to the trainer (rate 0 = frozen)
        kwargs["moe_router_bias_update_rate"] = 0.0
    if moe.clamped_swiglu is not None:  # gpt-oss experts: mcore's quick_gelu GLU, clamped, up + 1
        from megatron.core.activations import quick_gelu

        kwargs.update(activation_func=quick_gelu, glu_linear_offset=1.0,
                      activation_func_clamp_value=moe.clamped_swiglu.limit, bias_activation_fusion=False)  # fmt: skip
    if moe.top_k == 1 and moe.router_score_function == "softmax":
        kwargs["moe_router_pre_softmax"] = True  # mcore refuses top-1 without it (both give 1.0)
    return kwargs


def reference_router_weight_dtype(reference_class: Any) -> str:
    """``"fp32"`` when the transformers class ``reference_class`` keeps the MoE router's gate weight
    in fp32 whatever dtype the model is loaded in (``gate.weight`` among its
    ``_keep_in_fp32_modules_strict`` / ``_keep_in_fp32_modules``), else ``"params"``. Which classes
    do so changes between transformers releases, so this reads the installed one."""
    names: list = []
    for attr in ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules"):
        names.extend(getattr(reference_class, attr, None) or [])
    return "fp32" if any(name in ("gate.weight", "gate") for name in names) else "params"
