"""The weight table shared by Llama-like decoders (Llama, Mistral, Qwen2, Qwen3, ...)."""

from __future__ import annotations

from ..config.arch import ArchConfig
from .rules import GATE_UP, IDENTITY, QKV, Rule, Transform, WeightMap, rule

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."

ROTARY_BUFFER_IGNORED = (
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
    "RoPE buffer saved by old transformers versions; recomputed from the config",
)


def attention_rules(arch: ArchConfig, *, hf_attn: str = "self_attn.") -> list[Rule]:
    """QKV (+bias), output projection (+bias), q/k norms."""
    a = HF_LAYER + hf_attn
    rules = [
        rule(
            LAYER + "self_attention.linear_qkv.weight",
            [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
            tp_axis=0,
            transform=QKV,
        ),
        rule(LAYER + "self_attention.linear_proj.weight", a + "o_proj.weight", tp_axis=1),
    ]
    if arch.qkv_bias:
        rules.append(
            rule(
                LAYER + "self_attention.linear_qkv.bias",
                [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                tp_axis=0,
                transform=QKV,
            )
        )
    if arch.attn_output_bias:
        rules.append(rule(LAYER + "self_attention.linear_proj.bias", a + "o_proj.bias"))
    if arch.qk_norm:
        rules.append(rule(LAYER + "self_attention.q_layernorm.weight", a + "q_norm.weight"))
        rules.append(rule(LAYER + "self_attention.k_layernorm.weight", a + "k_norm.weight"))
    return rules


def gated_mlp_rules(arch: ArchConfig, *, hf_mlp: str = "mlp.", layer_kind: str = "all") -> list[Rule]:
    m = HF_LAYER + hf_mlp
    rules = [
        rule(
            LAYER + "mlp.linear_fc1.weight",
            [m + "gate_proj.weight", m + "up_proj.weight"],
            tp_axis=0,
            transform=GATE_UP,
            layer_kind=layer_kind,
        ),
        rule(LAYER + "mlp.linear_fc2.weight", m + "down_proj.weight", tp_axis=1, layer_kind=layer_kind),
    ]
    if arch.mlp_bias:
        rules.append(
            rule(
                LAYER + "mlp.linear_fc1.bias",
                [m + "gate_proj.bias", m + "up_proj.bias"],
                tp_axis=0,
                transform=GATE_UP,
                layer_kind=layer_kind,
            )
        )
        rules.append(rule(LAYER + "mlp.linear_fc2.bias", m + "down_proj.bias", layer_kind=layer_kind))
    return rules


def embedding_rules(arch: ArchConfig) -> list[Rule]:
    """Word embeddings, final norm and output layer (tied or not)."""
    pad = vocab_transform(arch)
    rules = [
        rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_axis=0, transform=pad),
        rule("decoder.final_layernorm.weight", "model.norm.weight"),
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
    """Identity, or :class:`~mcore_zoo.vocab.PadVocab` for a padded vocabulary."""
    if not arch.padded_vocab_size or arch.padded_vocab_size == arch.vocab_size:
        return IDENTITY
    from ..vocab import PadVocab

    return PadVocab(arch.vocab_size, arch.padded_vocab_size)


def dense_decoder_weight_map(arch: ArchConfig) -> WeightMap:
    """Embedding, per-layer norms / attention / gated MLP, final norm, output layer."""
    rules = embedding_rules(arch)
    rules.append(rule(LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight"))
    rules += attention_rules(arch)
    rules.append(rule(LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight"))
    rules += gated_mlp_rules(arch)
    ignored = [ROTARY_BUFFER_IGNORED]
    if arch.tie_word_embeddings:
        ignored.append(("lm_head.weight", "tie_word_embeddings: the output layer is model.embed_tokens.weight"))
    return WeightMap(arch, rules, ignored)
