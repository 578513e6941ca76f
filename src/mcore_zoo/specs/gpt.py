"""Layer specs for GPT-style decoders, per backend.

:func:`gpt_layer_specs` returns the ``TransformerBlockSubmodules`` of one pipeline stage (or virtual
stage): its layer specs and the final norm. Building the block spec ourselves (rather than calling
``get_gpt_layer_*_spec``, whose signatures differ between Megatron-Core releases) keeps the norm
classes, core attention and fusions under the numerics profile's control.

Backends:

* ``te`` - Transformer Engine linears and fused attention. With the ``default`` profile the input
  and pre-MLP norms are fused into ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``). Under
  ``pack_gemms="each"`` (``hf-exact``) the linears are the ``local`` backend's (torch's GEMM per
  sequence: TE's GEMM is not torch's bits at every row count).
  Zero-centred RMSNorm (``1 + weight``, Qwen3-Next / Qwen3.5) is TE's ``zero_centered_gamma`` under
  ``norm="mcore"`` and the zoo's :class:`~mcore_zoo.specs.norms.ZeroCenteredRMSNorm` under ``norm="hf"``.
  Attention sinks (gpt-oss) and DeepSeek sparse attention keep the zoo's own core attention
  between the TE linears.
* ``local`` - Megatron-Core modules without TE (mcore ``DotProductAttention``: no THD).
* ``portable`` - ``local`` with :class:`~mcore_zoo.specs.portable.PortableAttention` (THD on CPU
  and GPU, SDPA / varlen / flash-attn / HF-eager math).

MoE layers use sequential experts on every backend; with the numerics knob ``grouped_experts``
(``te`` only) Transformer Engine's grouped-GEMM experts (:func:`mcore_zoo.families.moe.spec.moe_mlp_submodule`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from ..config.arch import ArchConfig
from ..errors import ZooError
from ..numerics.profiles import NumericsProfile


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _pieces(arch: ArchConfig, backend: str, numerics: NumericsProfile) -> dict[str, Any]:
    """The module classes for one backend and profile."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from .norms import HFRMSNorm, HFRMSNormTriton
    from .swiglu_mlp import mlp_piece

    if arch.normalization != "RMSNorm" and numerics.norm == "hf":
        raise ZooError(f"{arch.architecture}: the hf norm order is implemented for RMSNorm only")
    if numerics.norm_kernel == "triton":
        from ..kernels import hf_rmsnorm
        from ..kernels.triton_rows import refuse_without_triton

        if arch.zero_centered_norm:
            raise ZooError(f"{arch.architecture}: norm_kernel='triton' implements HF's RMSNorm (x * weight), not the"
                           " zero-centred one (1 + weight) this architecture uses; use norm_kernel='torch'")  # fmt: skip
        refuse_without_triton("norm_kernel", hf_rmsnorm.available())
    hf_norm = HFRMSNormTriton if numerics.norm_kernel == "triton" else HFRMSNorm
    if numerics.kernels == "vllm":  # vLLM's batch-invariant kernels in mcore's modules
        if backend not in ("local", "portable"):
            raise ZooError(f"numerics {numerics.name!r} (vLLM's kernels) needs backend 'local' or 'portable', not {backend!r}")
        from .vllm_exact import pieces

        return pieces()
    if backend in ("local", "portable"):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = hf_norm if numerics.norm == "hf" else WrappedTorchNorm
        if arch.zero_centered_norm:  # 1 + weight: HF's op order under every profile
            from .norms import ZeroCenteredRMSNorm as norm
        core = _core_attention(backend, numerics, DotProductAttention)
        if arch.attention_sinks and core is DotProductAttention:
            # Megatron-Core's local attention creates its sink logits on CUDA only; the zoo's eager
            # attention computes the same softmax with the sink column on every device
            from .portable import PortableAttention

            core = functools.partial(PortableAttention, kernel="eager")
        column, row = _zoo_linears(numerics)
        return dict(
            **mlp_piece(arch, numerics),
            input_layernorm=norm,
            pre_mlp_layernorm=norm,
            linear_qkv=column,
            linear_proj=row,
            core_attention=core,
            linear_fc1=column,
            linear_fc2=row,
            qk_norm=norm,
            final_norm=norm,
        )
    if backend == "te":
        if not have_transformer_engine():
            raise ZooError("backend 'te' needs Transformer Engine (pip install 'mcore-zoo[te]')")
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TEDotProductAttention,
            TELayerNormColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        norm = hf_norm if numerics.norm == "hf" else TENorm
        if arch.zero_centered_norm and numerics.norm == "hf":  # 1 + weight in transformers' op order
            from .norms import ZeroCenteredRMSNorm as norm
        # norm="mcore": TE's norms with zero_centered_gamma (1 + weight) where arch.zero_centered_norm
        # (transformer_config_kwargs sets layernorm_zero_centered_gamma)
        column, row = TEColumnParallelLinear, TERowParallelLinear
        own_gemms = numerics.pack_gemms == "each"
        if own_gemms:
            # a pack's GEMMs one sequence at a time, each torch's F.linear as transformers calls
            # it: the zoo's linears. TE's GEMM runs cuBLASLt with a workspace of its own, free to
            # split the reduction at small row counts: not torch's bits for every row count
            # (measured on an H100: Qwen3-30B-A3B's layers on sequences of 37 - 512 tokens run
            # alone, max |dlogit| 0.84 against transformers; docs/numerics.md)
            column, row = _zoo_linears(numerics)
        fused = numerics.fuse_norm_into_linear and numerics.norm == "mcore" and not own_gemms
        core = _core_attention(backend, numerics, TEDotProductAttention)
        if arch.attention_sinks and core is TEDotProductAttention:
            # the sink logits as transformers adds them (its softmax op order): the zoo's eager
            # attention, between Transformer Engine's linears
            from .portable import PortableAttention

            core = functools.partial(PortableAttention, kernel="eager")
        return dict(
            **mlp_piece(arch, numerics),
            input_layernorm=IdentityOp if fused else norm,
            pre_mlp_layernorm=IdentityOp if fused else norm,
            linear_qkv=TELayerNormColumnParallelLinear if fused else column,
            linear_proj=row,
            core_attention=core,
            linear_fc1=TELayerNormColumnParallelLinear if fused else column,
            linear_fc2=row,
            qk_norm=norm,
            final_norm=norm,
        )
    raise ZooError(f"unknown backend {backend!r}; known: te, local, portable")


def _zoo_linears(numerics: NumericsProfile) -> tuple[type, type]:
    """The column- and row-parallel linears of the ``local`` / ``portable`` backends (and of ``te``
    under ``pack_gemms="each"``): Megatron-Core's own, or with ``linear_bias="fused"`` the zoo's,
    whose GEMM adds the bias as ``F.linear`` does and runs a pack one sequence at a time."""
    if numerics.linear_bias == "fused":
        from .linears import FusedBiasColumnParallelLinear, FusedBiasRowParallelLinear

        return FusedBiasColumnParallelLinear, FusedBiasRowParallelLinear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _core_attention(backend: str, numerics: NumericsProfile, own: Any) -> Any:
    """The backend's own core attention, or PortableAttention with the profile's kernel."""
    from .portable import PortableAttention

    if numerics.attention == "backend":
        if backend == "portable":
            return functools.partial(PortableAttention, kernel="auto")
        return own
    return functools.partial(PortableAttention, kernel=numerics.attention)


def gpt_layer_spec(arch: ArchConfig, backend: str, numerics: NumericsProfile, *, moe: bool = False) -> Any:
    """The ``ModuleSpec`` of one decoder layer (``moe``: its MLP is the MoE block of ``arch.moe``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from ..compat import mlp_submodule

    p = _pieces(arch, backend, numerics)
    layer_module = TransformerLayer
    if numerics.pack_gemms == "each":  # the layer keeps its pack's bounds for its GEMMs (specs/pack_rows.py)
        from .pack_rows import sequence_bounds_layer_class

        layer_module = sequence_bounds_layer_class()
    if arch.mla is not None:
        # MLA's q and kv down projections both read the normalised input: a separate input norm,
        # and plain (norm-free) linears for the attention's projections
        attention_pieces = _pieces(arch, backend, numerics.with_knobs(fuse_norm_into_linear=False))
        p = dict(p, input_layernorm=attention_pieces["input_layernorm"])
    if moe:  # the router and experts read the normalised input: the pre-MLP norm cannot be fused away
        from ..families.moe.spec import moe_mlp_submodule

        if p["pre_mlp_layernorm"] is IdentityOp:  # te: a separate norm, and expert fc1s without one
            unfused = _pieces(arch, backend, numerics.with_knobs(fuse_norm_into_linear=False))
            p = dict(p, pre_mlp_layernorm=unfused["pre_mlp_layernorm"], linear_fc1=unfused["linear_fc1"])
        if numerics.grouped_experts:
            from ..families.moe import config as moe_config

            moe_config.check_grouped_experts(arch, backend)
        if numerics.kernels == "vllm":  # vLLM's fused MoE block on mcore's router and experts
            from .vllm_exact import moe_submodule

            mlp = moe_submodule(arch, p)
        else:
            mlp = moe_mlp_submodule(arch, p, numerics.router, numerics.moe_experts, numerics.grouped_experts,
                                    numerics.pack_gemms, numerics.router_gemm, numerics.shared_expert_gemm)  # fmt: skip
    else:
        mlp = mlp_submodule(p["linear_fc1"], p["linear_fc2"], module=p.get("mlp"))
    qk_norm = p["qk_norm"] if arch.qk_norm else IdentityOp
    if arch.mla is not None:  # DeepSeek multi-head latent attention (mcore_zoo.families.mla.spec)
        if numerics.kernels == "vllm":  # vLLM's absorbed MLA layer
            from .vllm_exact import mla_attention_spec
        else:
            from ..families.mla.spec import mla_attention_spec

        attention = mla_attention_spec(arch, backend, numerics, attention_pieces)
        if arch.mla.indexer is not None:  # DeepSeek sparse attention (mcore_zoo.families.dsa.spec)
            from ..families.dsa.spec import dsa_attention_spec

            attention = dsa_attention_spec(arch, backend, numerics, attention)
    else:
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=p["linear_qkv"],
                core_attention=p["core_attention"],
                linear_proj=p["linear_proj"],
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
        )
    return ModuleSpec(
        module=layer_module,
        submodules=TransformerLayerSubmodules(
            input_layernorm=p["input_layernorm"],
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=p["pre_mlp_layernorm"],
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=_fused_norm_keys(p),
        ),
    )


def _vllm_first_layer(layers: list, config: Any, vp_stage: Optional[int], pp_rank: Optional[int]) -> list:
    """vLLM normalises the first layer's input without a residual (its Triton norm) and every later
    norm with the fused add + norm kernel: the model's first layer (dense or MoE) gets the former."""
    import dataclasses

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .vllm_exact import pieces

    if not layers or get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank) != 0:
        return layers
    layer = layers[0]
    first = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=pieces()["first_input_layernorm"]))  # fmt: skip
    return [first, *layers[1:]]


def _fused_norm_keys(pieces: dict[str, Any]) -> dict[str, str]:
    """Distributed-checkpoint keys of separate norms, renamed to those of norms fused into the next
    linear (``linear_qkv.layer_norm_weight``), as Megatron-Core's own local spec does: one
    checkpoint then loads into every backend."""
    from megatron.core.transformer.identity_op import IdentityOp

    if pieces["input_layernorm"] is IdentityOp:
        return {}
    return {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def stage_layer_indices(config: Any, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> range:
    """The global indices of the layers one (virtual) pipeline stage builds under ``config``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def gpt_layer_specs(
    arch: ArchConfig,
    backend: str,
    numerics: NumericsProfile,
    *,
    config: Any,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> Any:
    """``TransformerBlockSubmodules`` for the layers of one (virtual) pipeline stage.

    ``config`` is the ``TransformerConfig`` (it decides how many layers this stage builds).
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if backend in ("local", "portable") and numerics.norm != "hf" and getattr(config, "sequence_parallel", False):
        raise ZooError(
            f"{arch.architecture}: sequence_parallel with backend {backend!r} needs norms that support it;"
            " Megatron-Core's torch norm does not. Use backend 'te', or a numerics profile with"
            " norm='hf' (e.g. 'hf-exact'), whose HFRMSNorm marks its weight sequence-parallel"
        )
    if arch.gated_deltanet is not None:  # its layers come from the family's own layer spec
        raise ZooError(f"{arch.architecture} has gated DeltaNet layers: build it with layer_spec="
                       "'mcore_zoo.plugin_api:hybrid_layer_specs' (mcore_zoo.families.gated_deltanet.spec)")  # fmt: skip
    if numerics.kernels == "vllm":
        from .vllm_exact import check_supported

        check_supported(arch, config, numerics)
    layer = gpt_layer_spec(arch, backend, numerics)
    indices = stage_layer_indices(config, vp_stage, pp_rank)
    layers = [layer] * len(indices)
    if arch.moe is not None:  # MoE: per global layer index, the MoE or the dense MLP layer
        moe_layer = gpt_layer_spec(arch, backend, numerics, moe=True)
        layers = [moe_layer if arch.moe.is_moe_layer(i) else layer for i in indices]
    if numerics.kernels == "vllm":
        layers = _vllm_first_layer(layers, config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=_pieces(arch, backend, numerics)["final_norm"])
