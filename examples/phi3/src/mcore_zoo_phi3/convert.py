"""HF ``Phi3Config`` -> :class:`~mcore_zoo.ArchConfig`.

Phi-3 is a Llama-like decoder (RMSNorm, SiLU-gated MLP, GQA, rotate-half RoPE, no biases), so the
shared dense reader classifies most fields. Phi-3's own fields:

* ``sliding_window`` - transformers applies it in every layer (a query sees the last
  ``sliding_window`` keys, itself included): mapped to ``window_size=(sliding_window - 1, 0)``.
* ``partial_rotary_factor`` (Phi-4-mini: 0.75) - the first ``head_dim * factor`` channels rotate:
  mapped to ``rotary_percent`` by the shared RoPE reader (top level or inside ``rope_parameters``).
* ``resid_pdrop`` - dropout on the attention and MLP outputs before the residual add. Megatron-Core's
  ``hidden_dropout`` is the same dropout but also drops the embedding output, which Phi-3 does not:
  only 0 is exact (every published Phi-3 uses 0).
* ``embd_pdrop`` - read by no transformers Phi-3 code (there is no embedding dropout): ignored.
* ``original_max_position_embeddings`` - read only by ``longrope`` scaling.
* ``attention_bias`` / ``mlp_bias`` / ``lm_head_bias`` (found in published Phi-3 / Phi-4-mini
  configs, written by the remote-code era) - not fields of transformers' ``Phi3Config``: its
  projections never have biases. ``false`` agrees with that; ``true`` describes another model and is
  refused.
* ``rope_scaling`` / ``rope_parameters`` type ``longrope`` (legacy names ``su`` and ``yarn``; the
  128k-context Phi-3 / Phi-3.5 / Phi-4-mini checkpoints) - refused: see :data:`LONGROPE_REASON`.
"""

from __future__ import annotations

from typing import Any

LONGROPE_REASON = (
    "longrope RoPE scaling is not implemented: transformers switches the frequencies between"
    " short_factor and long_factor when a sequence grows past original_max_position_embeddings, and"
    " scales cos/sin by an attention factor; a Megatron-Core GPTModel has one fixed set of RoPE"
    " frequencies, so no single model reproduces it. Use a checkpoint with default RoPE (e.g."
    " Phi-3-mini-4k-instruct) or implement longrope in this plugin"
)

#: Bias switches left in published configs by the remote-code implementation (not Phi3Config fields).
BIAS_FIELDS = ("attention_bias", "mlp_bias", "lm_head_bias")

#: Phi-3's legacy RoPE type names that transformers maps to longrope (not the usual YaRN).
LONGROPE_TYPES = ("longrope", "su", "yarn")


def _rope_type(reader: Any) -> tuple[str, Any]:
    for source in ("rope_parameters", "rope_scaling"):
        params = reader.peek(source)
        if isinstance(params, dict):
            return source, params.get("rope_type") or params.get("type")
    return "rope_scaling", None


def convert(reader):  # type: ignore[no-untyped-def]
    """Classify every Phi-3 config field and return the :class:`~mcore_zoo.ArchConfig`."""
    from mcore_zoo.plugin_api import read_dense_decoder

    source, rope_type = _rope_type(reader)
    if rope_type in LONGROPE_TYPES:
        raise reader.unsupported(f"{source}.rope_type", rope_type, LONGROPE_REASON)
    reader.ignore(
        "original_max_position_embeddings", "read only by longrope RoPE scaling, which this config does not use"
    )
    window = reader.map("sliding_window", "window_size=(sliding_window - 1, 0) on every layer", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise reader.unsupported("sliding_window", window, "must be a positive integer or null")
    reader.map_checked(
        "resid_pdrop",
        "hidden_dropout = 0",
        lambda v: v == 0,
        reason="Megatron-Core's hidden_dropout would also drop the embedding output, which Phi-3 does"
        " not; only resid_pdrop=0 is exact",
        default=0.0,
    )
    reader.ignore("embd_pdrop", "no transformers Phi-3 code reads it (Phi-3 has no embedding dropout)")
    for name in BIAS_FIELDS:
        if reader.has(name):
            reader.expect(
                name,
                False,
                reason="transformers' Phi-3 builds its projections without biases whatever this says: a config"
                " claiming biases does not describe the reference model",
                detail="not read by transformers' Phi-3, whose projections have no biases",
            )
    return read_dense_decoder(reader, sliding_window=window)
