"""Weight rules of the multi-token-prediction layers (DeepSeek-V3 / GLM-4.5 checkpoint layout).

MTP depth ``d`` of a model with ``L`` decoder layers is the checkpoint's ``model.layers.{L + d}.*``
and Megatron-Core's ``mtp.layers.{d}.*``:

=================================  ===========================================  ==========
HF ``model.layers.{L + d}.``       Megatron-Core ``mtp.layers.{d}.``            TP
=================================  ===========================================  ==========
``enorm.weight``                   ``enorm.weight``                             -
``hnorm.weight``                   ``hnorm.weight``                             -
``eh_proj.weight``                 ``eh_proj.weight`` (input columns            rows
                                   ``[embedding; hidden]``, both sides)
decoder-layer tensors              ``transformer_layer.*`` (0.19:               as decoder
(``input_layernorm``, attention,   ``mtp_model_layer.*``), the decoder layer's
``post_attention_layernorm``,      own rules (MoE or dense, as
``mlp.*``)                         ``ArchConfig.mtp_layer_moe`` says)
``shared_head.norm.weight``        ``final_layernorm.weight``                   -
``embed_tokens.weight``            - (the model's embedding)                    copy
``shared_head.head.weight``        - (the model's output layer)                 copy
=================================  ===========================================  ==========

The two copies: Megatron-Core's MTP uses the model's own embedding and output layer, DeepSeek's
checkpoints store them again per MTP layer. They are :attr:`WeightMap.copies
<mcore_zoo.weights.rules.WeightMap.copies>`: a checkpoint may lack them; when present, loading
checks each is bitwise equal to its source (:func:`mcore_zoo.weights.tied.check_copies`) and
refuses a difference, naming both tensors - never picking one. Export writes them back (equal to
the embedding / output layer).
"""

from __future__ import annotations

import dataclasses

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.weights.rules import Rule, column_parallel, replicated

#: the decoder-layer prefix of a rule's mcore name (``weights.dense.LAYER``)
_DECODER_LAYER = "decoder.layers.{layer}."
#: the MTP layer's decoder-layer submodule (Megatron-Core 0.16's name; 0.19's is an alias)
INNER = "transformer_layer."


def hf_mtp_layer(arch: ArchConfig, depth: int) -> str:
    """``model.layers.{num_hidden_layers + depth}.``: where the checkpoint keeps MTP depth ``depth``."""
    return f"model.layers.{arch.num_layers + depth}."


def mtp_rules(arch: ArchConfig, layer_rules: list[Rule]) -> list[Rule]:
    """The rules of every MTP depth: its own tensors, then ``layer_rules`` (the decoder's
    ``{layer}`` rules) moved to the MTP layer - only those of its kind (MoE or dense)."""
    rules: list[Rule] = []
    for depth in range(arch.mtp_num_layers):
        hf, m = hf_mtp_layer(arch, depth), f"mtp.layers.{depth}."
        rules += [
            replicated(m + "enorm.weight", hf + "enorm.weight", note="MTP: norm of the next token's embedding"),
            replicated(m + "hnorm.weight", hf + "hnorm.weight", note="MTP: norm of the previous depth's hidden state"),
            column_parallel(m + "eh_proj.weight", hf + "eh_proj.weight",
                            note="MTP: input columns [enorm(embedding); hnorm(hidden)] in both"),  # fmt: skip
            replicated(m + "final_layernorm.weight", hf + "shared_head.norm.weight", note="MTP: norm before the head"),
        ]
        for r in layer_rules:
            if not r.mcore.startswith(_DECODER_LAYER):
                continue
            kind = "moe" if "{expert}" in r.mcore else r.layer_kind
            if kind != "all" and (kind == "moe") != arch.mtp_layer_moe:
                continue
            sources = tuple(dataclasses.replace(s, hf=s.hf.replace("model.layers.{layer}.", hf)) for s in r.sources)
            rules.append(dataclasses.replace(r, mcore=m + INNER + r.mcore[len(_DECODER_LAYER):], sources=sources,
                                             layer_kind="all"))  # fmt: skip
    return rules


def mtp_copies(arch: ArchConfig) -> list[tuple[str, str]]:
    """``(copy, source)``: each MTP layer's copies of the embedding and of the output layer."""
    head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    copies = []
    for depth in range(arch.mtp_num_layers):
        hf = hf_mtp_layer(arch, depth)
        copies += [(hf + "embed_tokens.weight", "model.embed_tokens.weight"), (hf + "shared_head.head.weight", head)]
    return copies
