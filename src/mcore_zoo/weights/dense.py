"""The weight table shared by Llama-like decoders (Llama, Mistral, Qwen2, Qwen3, ...).

Plugins import these pieces from :mod:`mcore_zoo.plugin_api`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..config.arch import ArchConfig
from .rules import (
    IDENTITY, QKV, Rule, Transform, WeightMap, fused_gate_up, fused_qkv, replicated, row_parallel, rule,
)  # fmt: skip

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."

ROTARY_BUFFER_IGNORED = (
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
    "RoPE buffer saved by old transformers versions; recomputed from the config",
)


def tied_lm_head_ignored(arch: ArchConfig) -> list[tuple[str, str]]:
    """The ``lm_head.weight`` ignore pattern of a tied model (the output layer is the embedding)."""
    if not arch.tie_word_embeddings:
        return []
    return [("lm_head.weight", "tie_word_embeddings: the output layer is model.embed_tokens.weight")]


def attention_rules(arch: ArchConfig, *, hf_attn: str = "self_attn.", layer_kind: str = "all",
                    qkv_transform: Transform = QKV, qkv_note: str = "") -> list[Rule]:  # fmt: skip
    """QKV (+bias), output projection (+bias), q/k norms. ``layer_kind``: only in layers of that
    kind (a hybrid model's full-attention layers); ``qkv_transform``: how q / k / v rows are
    interleaved into ``linear_qkv`` (:data:`~mcore_zoo.weights.rules.QKV`, or a gated attention's)."""
    a, k = HF_LAYER + hf_attn, layer_kind
    qkv = LAYER + "self_attention.linear_qkv."

    def fused(part: str, note: str = "") -> Rule:
        return fused_qkv(qkv + part, q=a + f"q_proj.{part}", k=a + f"k_proj.{part}", v=a + f"v_proj.{part}",
                         layer_kind=k, transform=qkv_transform, note=note)  # fmt: skip

    rules = [fused("weight", qkv_note), row_parallel(LAYER + "self_attention.linear_proj.weight", a + "o_proj.weight", layer_kind=k)]
    if arch.qkv_bias:
        rules.append(fused("bias"))
    if arch.attn_output_bias:
        rules.append(replicated(LAYER + "self_attention.linear_proj.bias", a + "o_proj.bias", layer_kind=k))
    if arch.qk_norm:
        rules.append(replicated(LAYER + "self_attention.q_layernorm.weight", a + "q_norm.weight", layer_kind=k))
        rules.append(replicated(LAYER + "self_attention.k_layernorm.weight", a + "k_norm.weight", layer_kind=k))
    return rules


def gated_mlp_rules(arch: ArchConfig, *, hf_mlp: str = "mlp.", mcore_mlp: str = "mlp.", layer_kind: str = "all") -> list[Rule]:
    """A gated MLP: ``linear_fc1`` from gate / up, ``linear_fc2`` from down (+ biases).
    ``layer_kind="dense"``: only in the dense layers of an MoE model."""
    m, c, k = HF_LAYER + hf_mlp, LAYER + mcore_mlp, layer_kind
    rules = [
        fused_gate_up(c + "linear_fc1.weight", gate=m + "gate_proj.weight", up=m + "up_proj.weight", layer_kind=k),
        row_parallel(c + "linear_fc2.weight", m + "down_proj.weight", layer_kind=k),
    ]
    if arch.mlp_bias:
        rules.append(fused_gate_up(c + "linear_fc1.bias", gate=m + "gate_proj.bias", up=m + "up_proj.bias", layer_kind=k))
        rules.append(replicated(c + "linear_fc2.bias", m + "down_proj.bias", layer_kind=k))
    return rules


def embedding_rules(arch: ArchConfig) -> list[Rule]:
    """Word embeddings, final norm and output layer (tied or not)."""
    pad = vocab_transform(arch)
    rules = [
        # column-parallel; a padded vocabulary pads the rows (mcore_zoo.vocab)
        rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_axis=0, transform=pad),
        replicated("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if arch.tie_word_embeddings:
        # Only pipeline last stages with PP > 1 hold a separate output_layer.weight under tying.
        rules.append(
            rule(
                "output_layer.weight",
                "model.embed_tokens.weight",
                tp_axis=0,
                transform=pad,
                export=False,
                note="tied: the last pipeline stage's copy of the embedding",
            )
        )
    else:
        rules.append(rule("output_layer.weight", "lm_head.weight", tp_axis=0, transform=pad))
    return rules


def vocab_transform(arch: ArchConfig) -> Transform:
    """Identity, or :class:`~mcore_zoo.weights.vocab.PadVocab` for a padded vocabulary."""
    if not arch.padded_vocab_size or arch.padded_vocab_size == arch.vocab_size:
        return IDENTITY
    from .vocab import PadVocab

    return PadVocab(arch.vocab_size, arch.padded_vocab_size)


def decoder_weight_map(
    arch: ArchConfig,
    mlp_rules: list[Rule],
    *,
    attention: Optional[list[Rule]] = None,
    ignored: Sequence[tuple[str, str]] = (),
) -> WeightMap:
    """A pre-norm decoder's table: embedding, final norm and output layer; per layer the input norm,
    ``attention`` (default :func:`attention_rules`), the pre-MLP norm and ``mlp_rules``; the
    multi-token-prediction layers built from the same layer rules (:mod:`.mtp`), or ignored when
    the user dropped them. Ignores the old RoPE buffer, a tied ``lm_head.weight`` and ``ignored``."""
    from ..families.mtp.config import dropped_mtp_ignored
    from ..families.mtp.weights import mtp_copies, mtp_rules

    layer = [
        replicated(LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight"),
        *(attention_rules(arch) if attention is None else attention),
        replicated(LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight"),
        *mlp_rules,
    ]
    rules = [*embedding_rules(arch), *layer, *mtp_rules(arch, layer)]
    ignored = [ROTARY_BUFFER_IGNORED, *ignored, *dropped_mtp_ignored(arch), *tied_lm_head_ignored(arch)]
    return WeightMap(arch, rules, ignored, copies=mtp_copies(arch))


def dense_decoder_weight_map(arch: ArchConfig) -> WeightMap:
    """Embedding, per-layer norms / attention / gated MLP, final norm, output layer."""
    return decoder_weight_map(arch, gated_mlp_rules(arch))
