"""Classification of the fields every HF ``PretrainedConfig`` carries, and the dense-decoder reader.

:func:`classify_common_fields` covers the generic fields of ``PretrainedConfig`` (transformers 4.x
and 5.x): provenance, output switches, generation defaults, tokenizer ids. Each is ignored with a
reason, or checked (``is_encoder_decoder`` must be false, ``pruned_heads`` empty, a
``quantization_config`` is rejected). A test asserts that every base field of the installed
transformers is covered, so a new generic field fails loudly instead of slipping through.

:func:`read_dense_decoder` reads the fields shared by Llama-like decoders (Llama, Mistral, Qwen2,
Qwen3 and most of their descendants) into an :class:`ArchConfig`. The attention windows some of them
add: :func:`read_qwen_window` / :func:`read_layer_types` (per layer), :func:`read_sliding_window`
(one window for every layer). :func:`mcore_zoo.config.quantization.read_quantization` accepts the one
quantized checkpoint format the zoo loads (FP8 blocks, dequantized on load) before
:func:`classify_common_fields` would refuse it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .arch import ArchConfig
from .reader import ConfigReader, positive_int
from .rope import read_rope

_PROVENANCE = "provenance metadata; no effect on the model"
_OUTPUTS = "HF forward-output switch; the mcore forward returns logits / log-probs"
_GENERATION = "generation default (sampling / decoding); no effect on the forward"
_TOKENS = "special-token id used by tokenizers and generation; no effect on the forward"
_CLASSIFICATION = "sequence-classification head setting; causal-LM heads do not use it"

GENERIC_IGNORED: dict[str, str] = {
    "architectures": "selects the plugin (lookup)",
    "model_type": "selects the plugin (lookup)",
    "transformers_version": _PROVENANCE,
    "_name_or_path": _PROVENANCE,
    "_commit_hash": _PROVENANCE,
    "auto_map": "names remote modelling code; the zoo plugin implements the architecture instead",
    "dtype": "storage dtype of the checkpoint; the mcore model dtype is chosen with params_dtype",
    "torch_dtype": "storage dtype of the checkpoint; the mcore model dtype is chosen with params_dtype",
    "use_bfloat16": "storage dtype hint; the mcore model dtype is chosen with params_dtype",
    "output_attentions": _OUTPUTS,
    "output_hidden_states": _OUTPUTS,
    "return_dict": _OUTPUTS,
    "use_return_dict": _OUTPUTS,
    "torchscript": "HF TorchScript export switch",
    "use_cache": "inference KV-cache switch; training forward has no cache",
    "id2label": _CLASSIFICATION,
    "label2id": _CLASSIFICATION,
    "num_labels": _CLASSIFICATION,
    "problem_type": _CLASSIFICATION,
    "finetuning_task": _CLASSIFICATION,
    "classifier_dropout": _CLASSIFICATION,
    "tokenizer_class": _TOKENS,
    "prefix": _TOKENS,
    "bos_token_id": _TOKENS,
    "eos_token_id": _TOKENS,
    "pad_token_id": _TOKENS,
    "sep_token_id": _TOKENS,
    "decoder_start_token_id": _TOKENS,
    "task_specific_params": _GENERATION,
    "tf_legacy_loss": "TensorFlow loss switch",
    "chunk_size_feed_forward": "feed-forward chunking of encoder models; decoder layers do not use it",
    "is_decoder": "encoder/decoder role flag of encoder-decoder models; causal LMs are decoders",
    "_attn_implementation": "HF attention kernel choice; parity runs select it explicitly",
    "_attn_implementation_autoset": "HF attention kernel choice; parity runs select it explicitly",
    "_experts_implementation": "HF MoE kernel choice (the moe_experts numerics knob follows one; parity-report loads the reference with it)",
}
for _name in (
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
):  # fmt: skip
    GENERIC_IGNORED[_name] = _GENERATION


def classify_common_fields(reader: ConfigReader) -> None:
    """Classify the generic ``PretrainedConfig`` fields (see module docstring)."""
    reader.ignore_many(GENERIC_IGNORED)
    if reader.has("is_encoder_decoder"):
        reader.expect("is_encoder_decoder", False, reason="encoder-decoder models are not causal LMs")
    if reader.has("add_cross_attention"):
        reader.expect("add_cross_attention", False, reason="cross-attention is not supported")
    if reader.has("cross_attention_hidden_size"):
        reader.expect("cross_attention_hidden_size", None, reason="cross-attention is not supported")
    if reader.has("tie_encoder_decoder"):
        reader.expect("tie_encoder_decoder", False, reason="encoder-decoder tying is not supported")
    if reader.has("pruned_heads"):
        reader.expect("pruned_heads", lambda v: not v, reason="pruned attention heads are not supported")
    if "quantization_config" in reader.records:
        return  # classified by the plugin (a quantized format it reads, e.g. DeepSeek's FP8 blocks)
    if reader.has("quantization_config") and reader.peek("quantization_config"):
        raise reader.unsupported(
            "quantization_config",
            reader.peek("quantization_config"),
            "quantized checkpoints are not supported; load a dequantized (bf16/fp32) checkpoint",
        )
    reader.ignore("quantization_config", "null")



def read_dense_decoder(
    reader: ConfigReader,
    *,
    qkv_bias: Optional[bool] = None,
    attn_output_bias: Optional[bool] = None,
    qk_norm: bool = False,
    activations: Mapping[str, str] = {"silu": "silu"},
    sliding_window: Optional[int] = None,
    sliding_window_layers: Optional[tuple] = None,
    ffn_hidden_size: Optional[int] = None,
    text_mrope: bool = False,
    multimodal_rope: bool = False,
    interleaved_mrope: bool = False,
) -> ArchConfig:
    """Read the fields of a Llama-like decoder (RMSNorm, gated MLP, GQA, RoPE).

    Fields read here: sizes, ``hidden_act``, ``rms_norm_eps``, ``initializer_range``,
    ``attention_dropout``, ``tie_word_embeddings``, RoPE, ``head_dim``. Bias and window decisions
    are the caller's (they differ per family) and are passed in. ``ffn_hidden_size``: the width
    for a model whose config has no ``intermediate_size`` (no dense MLP: every layer MoE; the
    caller classifies the field where present). ``text_mrope``, ``multimodal_rope``,
    ``interleaved_mrope``: see
    :func:`~mcore_zoo.config.rope.read_rope`.
    """
    arch = reader.architecture
    classify_common_fields(reader)
    vocab_size = reader.map_checked("vocab_size", "GPTModel.vocab_size", positive_int, reason="must be > 0")
    hidden = reader.map_checked("hidden_size", "hidden_size", positive_int, reason="must be > 0")
    if ffn_hidden_size is None:
        ffn = reader.map_checked("intermediate_size", "ffn_hidden_size", positive_int, reason="must be > 0")
    else:
        ffn = ffn_hidden_size
    layers = reader.map_checked("num_hidden_layers", "num_layers", positive_int, reason="must be > 0")
    heads = reader.map_checked("num_attention_heads", "num_attention_heads", positive_int, reason="must be > 0")
    groups = reader.map("num_key_value_heads", "num_query_groups", None)
    if groups is None:
        groups = heads
        reader.map("num_key_value_heads", "num_query_groups (null: = num_attention_heads)", None)
    if not positive_int(groups) or heads % groups:
        raise reader.unsupported(
            "num_key_value_heads", groups, f"must divide num_attention_heads={heads}"
        )
    head_dim = reader.map("head_dim", "kv_channels", None)
    if head_dim is None:
        if hidden % heads:
            raise reader.unsupported("num_attention_heads", heads, f"does not divide hidden_size={hidden}")
        head_dim = hidden // heads
        if reader.has("head_dim"):
            reader.map("head_dim", "kv_channels (null: hidden_size // num_attention_heads)", None)
    act = reader.map_checked(
        "hidden_act",
        "activation_func (gated: act(gate) * up)",
        lambda v: v in activations,
        reason=f"activation not supported for {arch}; supported: {sorted(activations)}",
        default="silu",
    )
    max_pos = reader.map("max_position_embeddings", "GPTModel.max_sequence_length")
    eps = reader.map("rms_norm_eps", "layernorm_epsilon (RMSNorm)")
    init_std = reader.map("initializer_range", "init_method_std", 0.02)
    attn_dropout = reader.map("attention_dropout", "attention_dropout", 0.0)
    tie = reader.map("tie_word_embeddings", "share_embeddings_and_output_weights", False)
    rope = read_rope(reader, max_position_embeddings=max_pos, text_mrope=text_mrope, multimodal_rope=multimodal_rope,
                     interleaved_mrope=interleaved_mrope)  # fmt: skip
    reader.ignore(
        "pretraining_tp",
        "slices the reference's linear layers during pretraining; the math is the same",
    )
    return ArchConfig(
        architecture=arch,
        model_type=reader.peek("model_type", ""),
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        rope=rope,
        norm_eps=float(eps),
        normalization="RMSNorm",
        activation=activations[act],
        gated_linear_unit=True,
        qkv_bias=bool(qkv_bias),
        attn_output_bias=bool(attn_output_bias),
        qk_norm=qk_norm,
        tie_word_embeddings=bool(tie),
        sliding_window=sliding_window,
        sliding_window_layers=sliding_window_layers,
        attention_dropout=float(attn_dropout or 0.0),
        init_std=float(init_std),
        hf_config=reader.config,
    )


def read_layer_types(reader: ConfigReader, num_layers: int, sliding_window: Optional[int]) -> Optional[tuple]:
    """Read transformers-5 ``layer_types`` (``full_attention`` / ``sliding_attention`` per layer).

    Returns per-layer window flags, or ``None`` when every layer is full attention.
    """
    layer_types = reader.peek("layer_types")
    if layer_types is None:
        reader.ignore("layer_types", "null: every layer uses full attention")
        return None
    allowed = {"full_attention", "sliding_attention"}
    bad = [t for t in layer_types if t not in allowed]
    if bad or len(layer_types) != num_layers:
        raise reader.unsupported(
            "layer_types", layer_types, f"expected {num_layers} entries from {sorted(allowed)}"
        )
    flags = tuple(t == "sliding_attention" for t in layer_types)
    if any(flags) and sliding_window is None:
        raise reader.unsupported("layer_types", layer_types, "sliding layers without a sliding_window")
    if not any(flags):
        reader.map("layer_types", "every layer full attention")
        return None
    reader.map("layer_types", "window_attn_skip_freq (per-layer sliding-window pattern)")
    return flags


def read_qwen_window(reader: ConfigReader, num_layers: int) -> tuple[Optional[int], Optional[tuple]]:
    """Sliding-window fields shared by Qwen2 / Qwen3 (``use_sliding_window``, ``sliding_window``,
    ``max_window_layers``, transformers-5 ``layer_types``) -> (window, per-layer flags)."""
    use = reader.peek("use_sliding_window", False)
    if not use:
        reader.ignore("use_sliding_window", "false: full attention in every layer")
        reader.ignore("sliding_window", "unused: use_sliding_window is false")
        reader.ignore("max_window_layers", "unused: use_sliding_window is false")
        window = None
    else:
        reader.map("use_sliding_window", "sliding-window attention on")
        window = reader.map("sliding_window", "window_size=(sliding_window - 1, 0)")
        if not isinstance(window, int) or window < 1:
            raise reader.unsupported("sliding_window", window, "must be a positive integer")
    if reader.has("layer_types"):
        flags = read_layer_types(reader, num_layers, window)
    elif window is not None:
        first = reader.map("max_window_layers", "window_attn_skip_freq: layers >= max_window_layers slide")
        flags = tuple(i >= first for i in range(num_layers))
        flags = flags if any(flags) else None
    else:
        flags = None
    if window is not None and reader.has("max_window_layers") and reader.has("layer_types"):
        reader.ignore("max_window_layers", "already applied by transformers in layer_types")
    if window is not None and flags is None:
        window = None  # no layer slides
    return window, flags


def read_sliding_window(reader: ConfigReader) -> Optional[int]:
    """One ``sliding_window`` for every layer, or ``None`` (Qwen3-MoE, Mixtral): ``use_sliding_window``
    is read where the config has it (the Qwen3-MoE config class clears the window unless it is set);
    ``max_window_layers`` is ignored, as transformers applies the window to every layer."""
    if reader.has("use_sliding_window"):
        use = reader.peek("use_sliding_window")
        reader.map("use_sliding_window", "sliding-window attention on every layer" if use else "false: full attention")
    reader.ignore("max_window_layers", "not read by the transformers model: its window (if any) applies to every layer")
    window = reader.map("sliding_window", "window_size=(sliding_window - 1, 0) on every layer", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise reader.unsupported("sliding_window", window, "must be a positive integer or null")
    return window
