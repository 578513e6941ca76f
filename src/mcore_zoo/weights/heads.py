"""Weight rules of output heads other than the language-model head.

:func:`with_value_head` changes an architecture's table for a model built with ``head="value"``:
the output layer is the critic's value head (:class:`~mcore_zoo.specs.heads.ValueHead`), read from
and exported as transformers' token-classification ``score`` layer (``score.weight [1, hidden]``,
``score.bias [1]``), replicated over tensor-parallel ranks; the LM head is not used, so a causal-LM
checkpoint's ``lm_head.weight`` is skipped with that reason. Every other rule is the
architecture's own, so a critic loads the actor's decoder unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .rules import WeightMap, replicated

#: HF names of the value head (transformers ``*ForTokenClassification`` with ``num_labels=1``)
VALUE_HEAD_WEIGHT = "score.weight"
VALUE_HEAD_BIAS = "score.bias"
LM_HEAD_UNUSED = "value head: the LM head is not used"


def with_value_head(wmap: WeightMap, *, init: Optional[str] = None) -> WeightMap:
    """``wmap`` with the output layer replaced by a value head (see the module docstring).

    ``init`` (``value_head_init``): when given, a checkpoint without ``score.weight`` loads, and
    the head keeps that initialisation (reported in ``LoadReport.absent``). ``score.bias`` may
    always be absent (a bias-free ``score`` layer, as ``*ForSequenceClassification`` has): the
    bias then stays 0.
    """
    rules = [r for r in wmap.rules if not r.mcore.startswith("output_layer.")]
    weight = replicated("output_layer.weight", VALUE_HEAD_WEIGHT, note="value head")
    if init is not None:
        weight = dataclasses.replace(weight, absent=f"value head initialised by request (value_head_init={init!r})")
    bias = dataclasses.replace(
        replicated("output_layer.bias", VALUE_HEAD_BIAS, note="value head bias"),
        absent="a score layer without bias: the value head's bias stays 0",
    )
    ignored = [(p, r) for p, r in wmap.ignored if p != "lm_head.weight"] + [("lm_head.weight", LM_HEAD_UNUSED)]
    return WeightMap(wmap.arch, [*rules, weight, bias], ignored, copies=list(wmap.copies))


__all__ = ["with_value_head", "VALUE_HEAD_WEIGHT", "VALUE_HEAD_BIAS", "LM_HEAD_UNUSED"]
