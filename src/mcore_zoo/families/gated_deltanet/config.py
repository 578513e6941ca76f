"""HF gated DeltaNet fields (Qwen3-Next, Qwen3.5) -> :class:`~mcore_zoo.config.arch.GatedDeltaNetSpec`.

Which layers are linear attention: transformers' ``layer_types`` (``linear_attention`` /
``full_attention`` per layer). A config file without it has ``full_attention_interval`` (every
``n``-th layer full attention), which the config class turns into ``layer_types`` and drops; when a
config carries both, they must agree. The linear-attention block's sizes are ``linear_*``; its
convolution activation is ``hidden_act`` (read by the dense decoder reader) and its gated RMSNorm's
epsilon ``rms_norm_eps``.

Qwen3.5's text configs: the same fields, the input projections split (``projections="split"``);
``attn_output_gate`` (which transformers does not read: its attention always gates) must be true
(:func:`read_attention_output_gate`); a vision-language config (``text_config`` / ``vision_config``)
is refused by name (:func:`refuse_vision_language_config`): its vision tower is never dropped silently.

Multi-token prediction (``mtp_num_hidden_layers``, ``mtp_use_dedicated_embeddings``): the MTP layer
is not built for this family yet. A config with MTP layers is refused, naming the field, unless the
user drops them (``ignore_fields={"mtp_num_hidden_layers": reason}``); the checkpoint's ``mtp.*``
tensors are then ignored by name (:func:`dropped_mtp_ignored`) - as transformers' model does. So
are they when the config names no MTP layer (Qwen3-Next's published config, whose checkpoint ships one).
"""

from __future__ import annotations

from typing import Any

from mcore_zoo.config.arch import GatedDeltaNetSpec
from mcore_zoo.config.reader import positive_int

LAYER_KINDS = ("linear_attention", "full_attention")
MTP_FIELD = "mtp_num_hidden_layers"
MTP_REASON = ("the multi-token-prediction layer of gated DeltaNet models is not built yet; drop it with"
              " ignore_fields={'mtp_num_hidden_layers': reason} (transformers' model skips it too)")  # fmt: skip



def interval_layer_types(interval: int, num_layers: int) -> tuple:
    """transformers' ``layer_types`` from ``full_attention_interval``: every ``interval``-th layer
    (1-based) full attention, the others linear attention."""
    return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers))


def read_layer_types(reader: Any, num_layers: int) -> tuple:
    """``layer_types`` (and ``full_attention_interval`` where present) -> per-layer token mixers."""
    layer_types = reader.peek("layer_types")
    if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers
            or any(t not in LAYER_KINDS for t in layer_types)):  # fmt: skip
        raise reader.unsupported("layer_types", layer_types, f"expected {num_layers} entries from {list(LAYER_KINDS)}")
    reader.map("layer_types", "per layer: the gated DeltaNet (linear_attention) or the gated attention layer")
    if reader.has("full_attention_interval"):
        interval = reader.peek("full_attention_interval")
        if not positive_int(interval) or interval_layer_types(interval, num_layers) != tuple(layer_types):
            raise reader.unsupported("full_attention_interval", interval, "disagrees with layer_types, which"
                                     " transformers reads")  # fmt: skip
        reader.ignore("full_attention_interval", "agrees with layer_types, which transformers reads")
    return tuple(layer_types)


def read_gated_deltanet(reader: Any, num_layers: int, *, projections: str = "fused") -> GatedDeltaNetSpec:
    """The linear-attention fields -> :class:`GatedDeltaNetSpec` (``hidden_act`` and ``rms_norm_eps``
    are peeked here and classified by the dense decoder reader); ``projections``: the checkpoint's
    input-projection layout (:attr:`GatedDeltaNetSpec.projections`), the architecture's choice."""
    layer_types = read_layer_types(reader, num_layers)

    def size(field: str, target: str) -> int:
        return reader.map_checked(field, target, positive_int, reason="must be a positive integer")

    if reader.has("mamba_ssm_dtype"):
        reader.ignore("mamba_ssm_dtype", "dtype of an inference engine's recurrent-state cache; transformers does"
                      " not read it, and the forward keeps the delta rule's state in fp32")  # fmt: skip
    key_heads = size("linear_num_key_heads", "GatedDeltaNetSpec.num_key_heads (q / k heads of the linear layer)")
    value_heads = size("linear_num_value_heads", "GatedDeltaNetSpec.num_value_heads")
    if value_heads % key_heads:
        raise reader.unsupported("linear_num_value_heads", value_heads,
                                 f"must be a multiple of linear_num_key_heads={key_heads}")  # fmt: skip
    return GatedDeltaNetSpec(
        layer_types=layer_types,
        num_key_heads=key_heads,
        num_value_heads=value_heads,
        key_head_dim=size("linear_key_head_dim", "GatedDeltaNetSpec.key_head_dim"),
        value_head_dim=size("linear_value_head_dim", "GatedDeltaNetSpec.value_head_dim"),
        conv_kernel_dim=size("linear_conv_kernel_dim", "GatedDeltaNetSpec.conv_kernel_dim (causal convolution width)"),
        norm_eps=float(reader.peek("rms_norm_eps")),
        activation=reader.peek("hidden_act", "silu"),
        projections=projections,
    )


def refuse_vision_language_config(reader: Any) -> None:
    """Refuse, by name, a vision-language config (``vision_config`` / ``text_config``): only the text
    model's own config is read; the vision tower is not built."""
    for name in ("vision_config", "text_config"):
        if reader.has(name):
            raise reader.unsupported(name, "present", f"{reader.architecture} reads a text model's own config;"
                                     " a vision-language checkpoint's language model is read by its"
                                     " *ForConditionalGeneration architecture")  # fmt: skip


def read_attention_output_gate(reader: Any) -> None:
    """``attn_output_gate`` (Qwen3.5's published configs): transformers' attention always has the
    sigmoid output gate and does not read the field, so it must be true where present."""
    if reader.has("attn_output_gate"):
        reader.map_checked("attn_output_gate", "attention_output_gate (sigmoid gate; q_proj twice as wide)",
                           lambda v: v is True, reason="transformers' model always gates its attention output")  # fmt: skip


def read_mtp_fields(reader: Any) -> None:
    """Classify the MTP fields (module docstring): none or zero layers, or dropped on request."""
    record = reader.records.get(MTP_FIELD)
    dropped = record is not None and record.kind == "ignored"
    if not dropped and reader.has(MTP_FIELD):
        reader.map_checked(MTP_FIELD, "no multi-token-prediction layer (0)", lambda v: v in (0, None),
                           reason=MTP_REASON)  # fmt: skip
    if reader.has("mtp_use_dedicated_embeddings"):
        reader.ignore("mtp_use_dedicated_embeddings", "read only by the multi-token-prediction layer, which is not built")


def dropped_mtp_ignored(arch: Any) -> list[tuple[str, str]]:
    """The checkpoint's ``mtp.*`` tensors, ignored by name (a load reports each): the config names
    MTP layers the model does not build (dropped on request), or names none at all - Qwen3-Next's
    published config does not declare the MTP layer its checkpoint ships, which transformers'
    model skips too."""
    from mcore_zoo.config.language_model import text_hf_config

    if not text_hf_config(arch.hf_config).get(MTP_FIELD):
        return [(r"mtp\..*", "multi-token-prediction layer the config does not declare (mtp_num_hidden_layers"
                 " absent or 0): not built, as transformers' model skips it")]  # fmt: skip
    return [(r"mtp\..*", "multi-token-prediction layer, not built (mtp_num_hidden_layers dropped on request)")]
