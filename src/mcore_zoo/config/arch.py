"""Target-independent description of a decoder-only architecture instance.

:class:`ArchConfig` is what a plugin's converter produces from an HF config. It says what the
model *is* (sizes, norms, biases, RoPE, attention window, tied embeddings) and nothing about how
it is built: :mod:`mcore_zoo.config.transformer` turns it into a Megatron-Core ``TransformerConfig``
plus ``GPTModel`` arguments, and a future ``HybridModel`` target can read the same object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .reader import FieldReport


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding, as HF defines it.

    ``rope_type`` is one of ``default``, ``linear``, ``llama3``, ``yarn``. Frequencies are computed
    by :func:`mcore_zoo.config.rope.inv_freq` exactly as transformers computes them.
    """

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    interleaved: bool = False
    #: multimodal RoPE (Qwen2.5-VL): the rotary half-width split into (temporal, height, width)
    #: sections, each rotated by its own row of 3-D position ids; ``None``: 1-D positions
    mrope_section: Optional[tuple] = None
    #: interleaved multimodal RoPE (Qwen3-VL): frequency ``j`` of the half-width follows the height
    #: row where ``j % 3 == 1 and j < 3 * sections[1]``, the width row where ``j % 3 == 2 and
    #: j < 3 * sections[2]``, else the temporal row (instead of three contiguous sections)
    mrope_interleaved: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The experts' activation of gpt-oss, as transformers computes it on ``h = x @ gate_up + bias``
    (gate and up in alternating columns): ``gate = h[..., ::2].clamp(max=limit)``,
    ``up = h[..., 1::2].clamp(-limit, limit)``, ``(up + 1) * (gate * sigmoid(gate * alpha))``."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts block (``None`` for dense models), as the HF model computes it.

    Routing, in HF's op order (every supported family scores all experts, then takes the top k):
    ``logits = x @ router.T`` (in the hidden dtype, or fp32 when ``router_logits_fp32``);
    ``scores = softmax(logits in fp32)`` or ``sigmoid(logits)`` (``router_score_function``);
    experts are chosen by ``scores (+ expert bias)`` (``router_expert_bias``), optionally first
    restricted to the best ``group_topk`` of ``num_groups`` groups (a group's score is the sum of
    its best ``group_score_topk`` scores); the weights are the chosen ``scores``, divided by their
    sum (+ ``normalize_eps``) when ``normalize_topk``, times ``topk_scaling_factor``; they are cast
    to the hidden dtype or kept in fp32 (``probs_dtype``) and multiply each expert's *output*.
    ``softmax_over_topk`` (gpt-oss): the experts are the top k of the logits themselves (the router
    has a bias), the weights a softmax over those k logits in the logits' dtype.

    Attributes:
        layer_pattern: per layer (0-based), True = MoE block, False = dense MLP; ``None``: all MoE.
        shared_expert_ffn_hidden_size: width of the always-on shared expert(s) (summed), or None.
        shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x @ gate.T)``.
        aux_loss_coeff: load-balancing loss coefficient (0: off).
        softmax_over_topk: route by the top-k logits, weights ``softmax`` over them (see above).
        clamped_swiglu: the experts' clamped SwiGLU (gpt-oss; their linears carry biases), or
            ``None`` for the plain gated activation.
        topk_sorted: whether the reference takes the top k sorted (``torch.topk``'s default) or not
            (``sorted=False``: DeepSeek-V2 / V3, GLM-4.5). Unsorted, the order of a token's experts
            is the kernel's, and it sets the order of each expert's rows (transformers' eager
            experts) and of the combine's sum (``grouped_mm``): the zoo takes the top k the same way.
        group_mask_value: what the experts of the groups not chosen are masked with before the
            top k (``-inf``; DeepSeek-V2's ``group_limited_greedy``: 0.0) - an unsorted top k's
            order can depend on the masked values.
        router_weight_dtype: ``"fp32"`` when the installed transformers model keeps the router's
            gate weight in fp32 whatever the load dtype (``_keep_in_fp32_modules_strict`` names
            ``gate.weight`` from transformers 5.2x on for GLM-4.5 and DeepSeek-V2 / V3); the zoo's
            HF-order router then keeps it in fp32 too. ``"params"``: the model's parameter dtype.
    """

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: Optional[int] = None
    shared_expert_gate: bool = False
    router_score_function: str = "softmax"
    router_logits_fp32: bool = False
    router_expert_bias: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    group_score_topk: int = 2
    topk_sorted: bool = True
    group_mask_value: float = float("-inf")
    normalize_topk: bool = False
    normalize_eps: float = 0.0
    topk_scaling_factor: Optional[float] = None
    probs_dtype: str = "hidden"  # "hidden" | "fp32"
    aux_loss_coeff: float = 0.0
    layer_pattern: Optional[tuple] = None
    router_weight_dtype: str = "params"  # "params" | "fp32" (the reference keeps the gate weight in fp32)
    softmax_over_topk: bool = False
    clamped_swiglu: Optional[ClampedSwiGLU] = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether global layer ``layer_index`` (0-based) is an MoE layer."""
        return self.layer_pattern is None or bool(self.layer_pattern[layer_index])

    def layout_problems(self, ep: int, etp: Optional[int], tp: int) -> list[str]:
        """Ways an expert-parallel layout (experts over ``ep``, each expert's FFN over ``etp``,
        default ``tp``; shared experts over ``tp``) fails to divide this block (empty when it fits)."""
        problems = []
        if self.num_experts % ep:
            problems.append(f"num_experts={self.num_experts} is not divisible by ep={ep}")
        etp = tp if etp is None else etp
        if self.expert_ffn_hidden_size % etp:
            problems.append(f"moe_intermediate_size={self.expert_ffn_hidden_size} is not divisible by etp={etp}")
        if self.shared_expert_ffn_hidden_size is not None and self.shared_expert_ffn_hidden_size % tp:
            problems.append(f"shared expert size {self.shared_expert_ffn_hidden_size} is not divisible by tp={tp}")
        return problems


@dataclass(frozen=True)
class DSASpec:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer in each MLA layer picks
    the keys every query attends to, as transformers' ``DeepseekV32Indexer`` computes it.

    Per token: ``q = wq_b(q_resid)`` (``index_n_heads`` heads of ``index_head_dim``, ``q_resid``
    the MLA's normalised q latent), ``k = LayerNorm(wk(x))`` (one key of ``index_head_dim``, norm
    epsilon ``k_norm_eps``), RoPE on the first ``qk_rope_head_dim`` dims of both (rotate-half pairs,
    or interleaved pairs when ``rope_interleave``), then ``score[s, t] = sum_h w[s, h] *
    relu(q[s, h] . k[t] * index_head_dim ** -0.5)`` in fp32 with ``w = weights_proj(x) *
    index_n_heads ** -0.5``; each query keeps the ``index_topk`` best causal keys of its own
    sequence (all of them when it has fewer).
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleave: bool = False
    k_norm_eps: float = 1e-6


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2 / V3), as the HF model computes it.

    ``q = q_b_proj(norm(q_a_proj(x)))`` (``q_lora_rank``) or ``q_proj(x)``; ``[kv_latent; k_rope] =
    kv_a_proj_with_mqa(x)``; ``[k_nope; v] = kv_b_proj(norm(kv_latent))`` per head; RoPE on the last
    ``qk_rope_head_dim`` dims of q and on the one shared ``k_rope`` (``rope_interleave``: the rotary
    dims come in interleaved pairs and leave de-interleaved, as Megatron-Core's MLA RoPE does).
    The latent norms use ``latent_norm_eps`` (HF builds them with its RMSNorm default, 1e-6).
    ``softmax_scale`` is HF's (``(nope + rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
    under YaRN).
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6
    #: DeepSeek-V2: the rope pairs are rotated as complex numbers and stay interleaved
    rope_complex: bool = False
    #: DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5); ``None``: dense MLA
    indexer: Optional[DSASpec] = None

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


#: the input-projection layouts of the gated DeltaNet layer (:attr:`GatedDeltaNetSpec.projections`)
PROJECTION_LAYOUTS = ("fused", "split")


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet linear attention (Qwen3-Next), as the HF model computes it, and where it sits.

    Per linear-attention layer, from the normalised input ``x``: ``in_proj_qkvz(x)`` gives per key
    head ``[q (dk), k (dk), v (r * dv), z (r * dv)]`` and ``in_proj_ba(x)`` per key head
    ``[b (r), a (r)]`` (``r = num_value_heads / num_key_heads``); ``[q; k; v]`` (all heads, in that
    order) runs through a depthwise causal convolution of width ``conv_kernel_dim`` and
    ``activation``; q and k are L2-normalised, ``beta = sigmoid(b)``, the per-head decay
    ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule (chunks of ``chunk_size``,
    state from zero at every sequence start) gives ``o``; ``out_proj(rmsnorm(o) * silu(z))`` with
    the gated RMSNorm's own weight (not zero-centred) and ``norm_eps``.

    Qwen3.5 computes the same from four separate projections (``projections="split"``):
    ``in_proj_qkv`` (``[q (all heads); k; v]``, the convolution's channel order), ``in_proj_z``
    (``z``, value heads in order), ``in_proj_b`` and ``in_proj_a`` (one row per value head).

    Attributes:
        layer_types: per layer (0-based), ``"linear_attention"`` or ``"full_attention"``.
        projections: ``"fused"`` (Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba``) or
            ``"split"`` (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
    """

    layer_types: tuple
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    norm_eps: float
    activation: str = "silu"
    chunk_size: int = 64
    projections: str = "fused"

    def __post_init__(self) -> None:
        if self.projections not in PROJECTION_LAYOUTS:
            raise ValueError(f"GatedDeltaNetSpec.projections must be one of {PROJECTION_LAYOUTS},"
                             f" got {self.projections!r}")  # fmt: skip

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: ``[q; k; v]``."""
        return 2 * self.key_dim + self.value_dim

    def is_linear_layer(self, layer_index: int) -> bool:
        """Whether global layer ``layer_index`` (0-based) is a gated DeltaNet layer."""
        return self.layer_types[layer_index] == "linear_attention"

    def layout_problems(self, parallel: Any, moe: bool = False) -> list[str]:
        """The parallel sizes the zoo's gated DeltaNet layer does not split (empty when it fits):
        tensor parallelism splits whole key-head groups, so ``tp`` must divide ``num_key_heads``
        (models with the MoE block, ``moe``, too: they train under TP with sequence parallelism, as
        Megatron-Core's MoE layer requires); context parallelism is refused."""
        problems = []
        if parallel.tp > 1 and self.num_key_heads % parallel.tp:
            problems.append(f"tp={parallel.tp}: the gated DeltaNet layer splits whole key heads over tensor-parallel"
                            f" ranks; tp must divide linear_num_key_heads={self.num_key_heads}")  # fmt: skip
        if parallel.cp > 1:
            problems.append(f"cp={parallel.cp}: the gated DeltaNet layer (layer_types linear_attention) is not split"
                            " over context-parallel ranks yet (its recurrent state runs through the whole sequence)")  # fmt: skip
        return problems


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower of a vision-language model and how its features enter the language model.

    Qwen2.5-VL's tower (``kind="qwen2_5_vl"``), as transformers computes it: a Conv3d patch
    embedding over ``temporal_patch_size x patch_size x patch_size`` patches of ``in_channels``
    (no bias), ``depth`` pre-norm blocks (RMSNorm, eps 1e-6; q/k/v in one biased linear, 2-D
    rotary over (row, column) of each patch with base ``rope_theta``, non-causal attention within
    windows of ``window_size`` pixels, or within each frame in the ``fullatt_block_indexes``
    blocks; a biased gated MLP of ``intermediate_size`` with ``hidden_act``), then the patch
    merger: RMSNorm, ``spatial_merge_size ** 2`` neighbouring patches concatenated, Linear - GELU -
    Linear to ``out_hidden_size`` (the language model's width). The merged features replace the
    language model's embeddings of the ``image_token_id`` / ``video_token_id`` tokens in order.

    Qwen3-VL's tower (``kind="qwen3_vl"``) differs: the Conv3d has a bias, a learned position
    embedding of ``num_position_embeddings`` (a square grid) is interpolated bilinearly to each
    image's patch grid and added to the patches, the blocks use LayerNorm and a plain biased MLP
    (``linear_fc1`` - act - ``linear_fc2``), every block attends within one frame (no windows),
    the merger norms with LayerNorm, and the blocks ``deepstack_visual_indexes`` feed one more
    merger each (LayerNorm over the concatenated patches) whose features are added to the output
    of decoder layer ``k`` (the ``k``-th of them) at the image / video tokens. Each video frame is
    its own run of video tokens (timestamps separate them), so its temporal position is 0.

    Attributes:
        kind: which tower (the extension point of the vision-language family).
        tokens_per_second: temporal position step of a video's frames (times ``second_per_grid_ts``).
        num_position_embeddings: Qwen3-VL: the learned position grid's size (a square number).
        deepstack_visual_indexes: Qwen3-VL: the blocks whose outputs feed the deepstack mergers.
        frames_per_video_run: ``True`` where each video frame is its own run of video tokens with
            its own position ids (Qwen3-VL), ``False`` where a video is one run (Qwen2.5-VL).
    """

    kind: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple = ()
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: float = 4
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple = ()
    frames_per_video_run: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ArchConfig:
    """A converted architecture instance. Shapes are global (before any parallel split).

    Attributes:
        head_dim: per-head width (``kv_channels``); may differ from hidden/heads (Qwen3).
        ffn_hidden_size: MLP width (per branch for gated MLPs).
        sliding_window: HF ``sliding_window`` (attend to the last ``W`` keys, the query included),
            or ``None``.
        sliding_window_layers: per layer (0-based), whether the window applies; ``None`` = all.
        softmax_scale: ``None`` means ``head_dim ** -0.5``.
        extra_transformer_config: architecture-specific ``TransformerConfig`` fields.
        hf_config: the normalised HF config dict the conversion read.
        fields: how each HF config field was classified.
    """

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope: RopeSpec
    norm_eps: float
    normalization: str = "RMSNorm"
    activation: str = "silu"
    gated_linear_unit: bool = True
    qkv_bias: bool = False
    attn_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    sliding_window_layers: Optional[tuple] = None
    softmax_scale: Optional[float] = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_std: float = 0.02
    moe: Optional[MoESpec] = None
    #: multi-head latent attention (DeepSeek); ``None``: standard GQA attention
    mla: Optional[MLASpec] = None
    #: gated DeltaNet layers among the attention layers (Qwen3-Next); ``None``: attention everywhere
    gated_deltanet: Optional[GatedDeltaNetSpec] = None
    #: the attention output is multiplied by ``sigmoid(gate)``, the gate a second half of each query
    #: head's projection (Qwen3-Next's full attention; Megatron-Core's ``attention_output_gate``)
    attention_output_gate: bool = False
    #: every attention head has a learned sink logit in its softmax (gpt-oss ``self_attn.sinks``;
    #: Megatron-Core's ``softmax_type="learnable"``, parameter ``core_attention.softmax_offset``)
    attention_sinks: bool = False
    #: RMSNorms scale by ``1 + weight`` (weights stored zero-centred, Qwen3-Next), in HF's op order
    zero_centered_norm: bool = False
    #: the HF ``quantization_config`` of an FP8 block-quantized checkpoint (validated by
    #: ``mcore_zoo.config.quantization.Fp8BlockFormat``): loading dequantizes its tensors into the model's
    #: dtype, ``save_hf_checkpoint(fp8=True)`` writes the format back. ``None``: unquantized
    checkpoint_quantization: Optional[Mapping[str, Any]] = None
    extra_transformer_config: Mapping[str, Any] = field(default_factory=dict)
    #: rows of the embedding / output layer when padded (``make_vocab_size_divisible_by``); None: vocab_size
    padded_vocab_size: Optional[int] = None
    #: multi-token prediction (DeepSeek-V3 / GLM-4.5 ``num_nextn_predict_layers``): Megatron-Core's MTP
    #: block with this many depths, on the last pipeline stage (:mod:`mcore_zoo.families.mtp.spec`); 0: none
    mtp_num_layers: int = 0
    #: whether the MTP layers' MLP is the MoE block (by the checkpoint's own rule for layer index
    #: ``num_hidden_layers + d``) rather than the dense MLP
    mtp_layer_moe: bool = False
    #: the vision tower of a vision-language model, built before the decoder on the first pipeline
    #: stage (:mod:`mcore_zoo.families.vision_language`); ``None``: a text model
    vision: Optional[VisionSpec] = None
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    fields: Optional[FieldReport] = field(default=None, compare=False, repr=False)
    #: what extensions' ``amend_config`` changed: ``(origin, attribute, before, after)`` per change
    amendments: tuple = field(default=(), compare=False, repr=False)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def replace(self, **changes: Any) -> "ArchConfig":
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("hf_config", "fields"):
                continue
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out
