"""``ArchConfig`` -> Megatron-Core ``TransformerConfig`` + ``GPTModel`` keyword arguments.

Parallel sizes, dtype, the numerics profile and user overrides apply on top of the architecture.
:func:`validate_layout` rejects a layout that does not divide the model before anything is built
or read.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from ..errors import LayoutError, UnsupportedLayoutError, ZooError
from ..numerics.profiles import NumericsProfile
from .parallelism import Parallelism
from .arch import ArchConfig
from .rope import yarn_attention_factor, yarn_mscale

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def validate_layout(arch: ArchConfig, parallel: Parallelism) -> None:
    """Raise :class:`LayoutError` naming every way ``parallel`` fails to divide ``arch``; then
    :class:`UnsupportedLayoutError` naming the parallel sizes a layer of ``arch`` is not built for."""
    problems = []
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", parallel.ep)):
        if value < 1:
            problems.append(f"{name}={value} must be >= 1")
    if tp > 1:
        if arch.num_attention_heads % tp:
            problems.append(f"num_attention_heads={arch.num_attention_heads} is not divisible by tp={tp}")
        if arch.num_query_groups % tp:
            problems.append(f"num_key_value_heads={arch.num_query_groups} is not divisible by tp={tp}")
        if arch.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={arch.ffn_hidden_size} is not divisible by tp={tp}")
        if (arch.padded_vocab_size or arch.vocab_size) % tp:
            problems.append(f"vocab_size={arch.vocab_size} is not divisible by tp={tp} (make_vocab_size_divisible_by pads it)")
    chunks = pp * (parallel.vpp or 1)
    if parallel.vpp is not None and parallel.vpp > 1 and pp == 1:
        problems.append(f"vpp={parallel.vpp} needs pp > 1")
    if chunks > 1 and arch.num_layers % chunks:
        problems.append(
            f"num_hidden_layers={arch.num_layers} is not divisible by pp*vpp={pp}*{parallel.vpp or 1}"
        )
    if parallel.sequence_parallel and tp == 1:
        problems.append("sequence_parallel needs tp > 1")
    if arch.mtp_num_layers and cp > 1:
        # Megatron-Core exchanges the MTP inputs' shifted-in tokens between CP ranks by its own
        # chunking of each sequence; the zoo's zigzag CP packs are not tested with it
        problems.append("multi-token prediction (num_nextn_predict_layers) is not built with cp > 1: Megatron-Core"
                        " shifts the MTP inputs across CP ranks by its own chunking, untested with the zoo's packs")
    if arch.mtp_num_layers and parallel.vpp is not None and parallel.vpp > 1:
        problems.append("multi-token prediction (num_nextn_predict_layers) is not tested with vpp > 1")
    if arch.moe is not None:  # MoE: experts over ep, expert FFN over etp (a dense model ignores them)
        problems += arch.moe.layout_problems(parallel.ep, parallel.etp, tp)
    if arch.moe is not None and arch.mlp_bias and (parallel.etp or tp) > 1:
        problems.append(f"etp={parallel.etp or tp}: the experts carry biases, which Megatron-Core builds at expert"
                        " tensor-parallel size 1 only (etp=1; the default for such a model)")  # fmt: skip
    where = f"{arch.architecture}: layout tp={tp} pp={pp} vpp={parallel.vpp} cp={cp} ep={parallel.ep}"
    if problems:
        raise LayoutError(f"{where} does not fit the model:\n" + "\n".join(f"  - {p}" for p in problems))
    unsupported = []
    if arch.gated_deltanet is not None:
        unsupported = arch.gated_deltanet.layout_problems(parallel, moe=arch.moe is not None)
    if arch.vision is not None:
        unsupported += vision_layout_problems(arch, parallel)
    if unsupported:
        raise UnsupportedLayoutError(f"{where} is not supported by the model's layers yet:\n"
                                     + "\n".join(f"  - {p}" for p in unsupported))  # fmt: skip


def vision_layout_problems(arch: ArchConfig, parallel: Parallelism) -> list[str]:
    """What a vision-language model is not built for yet: its tower sits on the first stage,
    replicated over tensor-parallel ranks, and replaces rows of the whole (unsplit) sequence; the
    experts of its MoE language model (Qwen3-VL-MoE's stacked gate / up halves) are whole on every
    expert tensor-parallel rank (expert TP 1, the default such a model takes)."""
    problems = []
    if arch.moe is not None and (parallel.etp or parallel.tp) > 1:
        problems.append(f"etp={parallel.etp or parallel.tp}: the experts of a vision-language MoE model are not split"
                        " over expert tensor parallelism yet (etp=1; the default for such a model)")  # fmt: skip
    if parallel.cp > 1:
        problems.append("context parallelism of a vision-language model (its tower's features and 3-D position"
                        " ids over a split sequence) is not built yet")  # fmt: skip
    if parallel.sequence_parallel:
        problems.append("sequence parallelism of a vision-language model (the tower's features replace rows of the"
                        " whole sequence) is not built yet")  # fmt: skip
    if parallel.vpp is not None and parallel.vpp > 1:
        problems.append("virtual pipeline stages of a vision-language model are not built yet")
    return problems


def default_expert_tp(arch: ArchConfig, parallel: Parallelism) -> Parallelism:
    """``parallel`` with the expert tensor-parallel size the model takes when none is asked: that of
    ``tp``, except 1 for experts with biases (gpt-oss; Megatron-Core builds expert biases at expert
    TP 1 only) and for a vision-language MoE model (Qwen3-VL-MoE: :func:`vision_layout_problems`)."""
    whole_experts = arch.mlp_bias or arch.vision is not None  # biases; a vision-language model's stacked halves
    if arch.moe is not None and whole_experts and parallel.etp is None and parallel.tp > 1:
        return dataclasses.replace(parallel, etp=1)
    return parallel


@dataclass(frozen=True)
class BuildOptions:
    """How to build an mcore model from an :class:`ArchConfig`.

    Attributes:
        backend: ``"te"``, ``"local"`` or ``"portable"``.
        parallel: the parallel layout.
        params_dtype: parameter dtype (``bf16``/``fp16`` also set the mcore mixed-precision flags).
        numerics: the numerics profile (already adapted to the device).
        cpu: build for the CPU (``use_cpu_initialization``, CPU shim).
        overrides: extra ``TransformerConfig`` fields set last (names are checked).
        perform_initialization: run mcore's random init (off when weights will be loaded).
        head: ``"lm"`` (the language-model head) or ``"value"`` (a critic's width-1 value head,
            :class:`~mcore_zoo.specs.heads.ValueHead`; embeddings never tied).
        value_head_init: with ``head="value"``, how to initialise the head when the checkpoint
            has none (``"zeros"`` or ``"normal"``); ``None``: the checkpoint must have one.
    """

    backend: str = "local"
    parallel: Parallelism = Parallelism()
    params_dtype: torch.dtype = torch.float32
    numerics: NumericsProfile = None  # type: ignore[assignment]
    cpu: bool = False
    overrides: Mapping[str, Any] = field(default_factory=dict)
    perform_initialization: bool = True
    head: str = "lm"
    value_head_init: Optional[str] = None


def transformer_config_kwargs(arch: ArchConfig, options: BuildOptions) -> dict[str, Any]:
    """The ``TransformerConfig`` keyword arguments for ``arch`` under ``options`` (whose layout
    :func:`validate_layout` has accepted)."""
    numerics = options.numerics
    parallel = options.parallel
    dtype = options.params_dtype
    if arch.activation not in ACTIVATIONS:
        raise ZooError(f"{arch.architecture}: activation {arch.activation!r} has no mcore function")
    if arch.attn_output_bias != arch.mlp_bias:
        raise ZooError(
            f"{arch.architecture}: attention output bias ({arch.attn_output_bias}) and MLP bias"
            f" ({arch.mlp_bias}) differ; Megatron-Core's add_bias_linear sets both"
        )
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=arch.gated_linear_unit,
        activation_func=ACTIVATIONS[arch.activation],
        add_bias_linear=arch.mlp_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=arch.hidden_dropout,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.init_std,
        softmax_scale=arch.softmax_scale,
        rotary_interleaved=arch.rope.interleaved,
        # parallel layout
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.sequence_parallel,
        # dtype
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # device and init
        use_cpu_initialization=options.cpu,
        perform_initialization=options.perform_initialization,
        # numerics knobs
        apply_rope_fusion=numerics.rope_fusion and options.backend == "te" and not _yarn_needs_mscale(arch)
        and arch.rope.mrope_section is None,  # TE's fused THD kernel rotates by position in the sequence, not per token
        bias_activation_fusion=numerics.bias_activation_fusion and arch.activation in ("silu", "gelu"),
        masked_softmax_fusion=numerics.masked_softmax_fusion and options.backend == "local" and fused_softmax_available(),
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if options.cpu:
        kwargs["batch_p2p_sync"] = False  # gloo has no batched isend/irecv sync
    if arch.sliding_window is not None:
        # HF: key k is visible to query q iff q - W < k <= q  ->  (left, right) = (W - 1, 0)
        kwargs["window_size"] = (arch.sliding_window - 1, 0)
        if arch.sliding_window_layers is not None:
            kwargs["window_attn_skip_freq"] = [int(f) for f in arch.sliding_window_layers]
    if arch.mla is not None:  # DeepSeek MLA: MLATransformerConfig fields (mcore_zoo.families.mla.spec)
        kwargs.update(_mla_fields(arch))
    elif arch.rope.rope_type == "yarn":
        kwargs.update(_yarn_fields(arch))
    grouped = arch.moe is not None and numerics.grouped_experts
    if arch.moe is not None:  # MoE fields (mcore_zoo.families.moe.config): router, experts, dispatcher
        from ..families.moe import config as moe

        if grouped:
            moe.check_grouped_experts(arch, options.backend, cuda=not options.cpu)
        kwargs.update(moe.moe_config_kwargs(arch, cuda=not options.cpu, grouped_experts=grouped))
    if arch.mtp_num_layers:  # multi-token prediction (mcore_zoo.families.mtp.spec): the block on the last stage
        kwargs["mtp_num_layers"] = arch.mtp_num_layers
    if arch.attention_sinks:  # gpt-oss: a learned sink logit per head (core_attention.softmax_offset)
        kwargs["softmax_type"] = "learnable"
    if arch.rope.mrope_section is not None:  # multimodal RoPE over 3-D position ids (families/vision_language)
        kwargs["mrope_section"] = list(arch.rope.mrope_section)
    if arch.attention_output_gate:  # Qwen3-Next: the query projection carries a sigmoid output gate
        kwargs["attention_output_gate"] = True
    if arch.zero_centered_norm and options.backend == "te":  # TE's norms scale by 1 + weight (specs/gpt.py)
        kwargs["layernorm_zero_centered_gamma"] = True
    kwargs.update(arch.extra_transformer_config)
    for name, value in options.overrides.items():
        kwargs[name] = value
    if arch.moe is not None and bool(kwargs.get("moe_grouped_gemm")) != grouped:
        # the layer spec follows the numerics knob; a config that says otherwise describes another model
        raise ZooError(f"{arch.architecture}: overrides set moe_grouped_gemm={kwargs.get('moe_grouped_gemm')!r}, the"
                       f" numerics knob grouped_experts is {grouped}: choose grouped experts with the knob")  # fmt: skip
    return kwargs


def transformer_config_class(arch: ArchConfig) -> Any:
    """``MLATransformerConfig`` for MLA architectures, else ``TransformerConfig``."""
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig


def _mla_fields(arch: ArchConfig) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of ``arch.mla``. Megatron-Core's own RoPE module and
    softmax scale of each MLA layer are replaced by the zoo's (HF's frequencies, attention factor
    and scale: :mod:`mcore_zoo.families.mla.spec`); these fields still size the layer and pick the branch."""
    mla, rope = arch.mla, arch.rope
    if rope.rope_type not in ("default", "yarn"):
        raise ZooError(f"{arch.architecture}: MLA supports default and yarn RoPE, not {rope.rope_type!r}")
    if rope.partial_rotary_factor != 1.0:
        raise ZooError(f"{arch.architecture}: MLA rotates qk_rope_head_dim; partial_rotary_factor must be 1")
    yarn = rope.rope_type == "yarn"
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.q_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=rope.theta,
        rotary_percent=1.0,
        softmax_scale=mla.softmax_scale,
        apply_rope_fusion=False,
        # the latent RMSNorms (q_a_layernorm, kv_a_layernorm): Megatron-Core 0.19 builds MLA's
        # q / kv norms only with this set (0.16 builds them from the layer spec alone)
        qk_layernorm=True,
    )
    if yarn:
        fields.update(
            rotary_scaling_factor=rope.factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast or 32,
            beta_slow=rope.beta_slow or 1,
            mscale=rope.mscale if rope.mscale is not None else 1.0,
            mscale_all_dim=rope.mscale_all_dim if rope.mscale_all_dim is not None else 0.0,
        )
    else:
        fields.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return fields


def fused_softmax_available() -> bool:
    """Megatron's fused scale-mask-softmax needs its CUDA extension (not in the megatron-core wheel)."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _yarn_needs_mscale(arch: ArchConfig) -> bool:
    return arch.rope.rope_type == "yarn" and yarn_attention_factor(arch.rope) != 1.0


def _yarn_fields(arch: ArchConfig) -> dict[str, Any]:
    """mcore applies YaRN's cos/sin scale from these (non-dataclass) config attributes."""
    rope = arch.rope
    wanted = yarn_attention_factor(rope)
    # mcore's _yarn_get_concentration_factor: ratio of mscales when both are set, else mscale(factor)
    if rope.mscale and rope.mscale_all_dim:
        mscale, mscale_all_dim = rope.mscale, rope.mscale_all_dim
        got = yarn_mscale(rope.factor, mscale) / yarn_mscale(rope.factor, mscale_all_dim)
    else:
        mscale = mscale_all_dim = None
        got = yarn_mscale(rope.factor)
    if float(got) != wanted:
        raise ZooError(
            f"{arch.architecture}: YaRN attention factor {wanted!r} cannot be expressed through"
            f" Megatron-Core's (factor, mscale, mscale_all_dim) form (gives {got!r})"
        )
    return {
        "yarn_rotary_scaling_factor": rope.factor,
        "yarn_mscale": mscale,
        "yarn_mscale_all_dim": mscale_all_dim,
        "yarn_original_max_position_embeddings": rope.original_max_position_embeddings,
        "yarn_beta_fast": rope.beta_fast or 32,
        "yarn_beta_slow": rope.beta_slow or 1,
    }


def gpt_model_kwargs(arch: ArchConfig) -> dict[str, Any]:
    """``GPTModel`` arguments besides config and spec (vocab, positions, RoPE, tying)."""
    return dict(
        vocab_size=arch.padded_vocab_size or arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope" if arch.rope.mrope_section is None else "mrope",
        rotary_percent=arch.rope.partial_rotary_factor,
        rotary_base=int(arch.rope.theta) if float(arch.rope.theta).is_integer() else arch.rope.theta,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )
