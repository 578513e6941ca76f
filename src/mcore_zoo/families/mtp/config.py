"""``num_nextn_predict_layers``: multi-token prediction (DeepSeek-V3, GLM-4.5).

A checkpoint with ``N`` MTP layers stores them after the decoder, as ``model.layers.{L + d}.*``
(``L = num_hidden_layers``, ``d < N``). The zoo builds them as Megatron-Core's MTP block
(:mod:`mcore_zoo.families.mtp.spec`). Two ways a config with MTP layers converts:

* **built** (default): ``ArchConfig.mtp_num_layers = N``. Only ``N = 1`` (what every published
  checkpoint has): for ``N > 1`` Megatron-Core's block feeds depth ``d + 1`` the *normed* output of
  depth ``d`` (its ``final_layernorm``), DeepSeek's definition the un-normed one, so depths past
  the first would not compute what the checkpoint was trained to compute - refused, naming the field.
* **dropped on request**: ``ignore_fields={"num_nextn_predict_layers": reason}``; the model has no
  MTP block and the checkpoint's MTP tensors are ignored by name (:func:`dropped_mtp_ignored`).
"""

from __future__ import annotations

from typing import Any

MTP_FIELD = "num_nextn_predict_layers"

DEPTHS_REASON = ("Megatron-Core's MTP block feeds depth d + 1 the normed output of depth d (its final_layernorm);"
                 " DeepSeek's MTP definition chains the un-normed one, so only one MTP layer is built as the"
                 " checkpoint computes it. Drop the MTP layers with ignore_fields={'num_nextn_predict_layers':"
                 " reason}")  # fmt: skip


def read_mtp(reader: Any) -> int:
    """Classify ``num_nextn_predict_layers``; return the number of MTP layers to build (0 when
    absent, 0, or dropped by the user through ``ignore_fields``)."""
    record = reader.records.get(MTP_FIELD)
    if record is not None and record.kind == "ignored":  # ignore_fields: dropped on purpose
        return 0
    count = reader.map_checked(MTP_FIELD, "mtp_num_layers: Megatron-Core's multi-token-prediction block (last"
                               " pipeline stage), loaded from model.layers.{num_hidden_layers + d}.*",
                               lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1),
                               reason=DEPTHS_REASON, default=0)  # fmt: skip
    return int(count or 0)


def dropped_mtp_ignored(arch: Any) -> list[tuple[str, str]]:
    """Ignore patterns for the checkpoint's MTP layers when the user dropped them (the config
    still names ``N`` layers, the model builds none); empty otherwise."""
    from mcore_zoo.config.language_model import text_hf_config

    count = int(text_hf_config(arch.hf_config).get(MTP_FIELD) or 0)
    if not count or arch.mtp_num_layers:
        return []
    layers = "|".join(str(arch.num_layers + i) for i in range(count))
    return [(rf"model\.layers\.({layers})\..*", "multi-token-prediction layer(s), dropped on request"
             " (ignore_fields num_nextn_predict_layers)")]  # fmt: skip
