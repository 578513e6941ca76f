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

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts block (used by MoE plugins; ``None`` for dense models)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: Optional[int] = None
    router_score_function: str = "softmax"
    normalize_topk: bool = False
    router_bias: bool = False
    layer_pattern: Optional[tuple] = None  # per layer: True = MoE, False = dense
    extra: Mapping[str, Any] = field(default_factory=dict)


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
    extra_transformer_config: Mapping[str, Any] = field(default_factory=dict)
    #: rows of the embedding / output layer when padded (``make_vocab_size_divisible_by``); None: vocab_size
    padded_vocab_size: Optional[int] = None
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    fields: Optional[FieldReport] = field(default=None, compare=False, repr=False)

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
