"""Padded vocabulary (``make_vocab_size_divisible_by``, as Megatron trainers use it).

Megatron-LM pads the embedding and output layer to a multiple of ``make_vocab_size_divisible_by *
tp`` rows so that the vocabulary divides evenly and GEMMs stay aligned. With
``build_model(..., make_vocab_size_divisible_by=128)`` the zoo does the same, exactly:

* loading: each rank reads the whole HF ``[V, H]`` tensor, pads it with zero rows to ``[Vp, H]``
  and keeps its tensor-parallel rows (:class:`mcore_zoo.weights.vocab.PadVocab`, the weight
  transform);
* export: the gathered ``[Vp, H]`` tensor loses its padding rows before it is yielded, so they
  never reach the HF side (``iter_hf_weights``, ``save_hf_checkpoint``, ``convert``);
* forward: the logits of the padding ids are set to :data:`PAD_LOGIT` (:func:`install_logit_mask`),
  so log-probabilities are those of the HF vocabulary: their ``exp`` underflows to exactly 0 next to
  any real logit, the padding ids get probability 0 and no gradient. The value is finite (not
  ``-inf``) because entropy needs ``p * log p`` to be 0, not ``0 * -inf``
  (:func:`mcore_zoo.distributed.token_logprobs_and_entropy` requires finite logits).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .errors import ZooError

#: The logit of a padding id: finite in every float dtype (and after a temperature of 0.01), and
#: far enough below any real logit that its probability is exactly 0 in fp32 (e^-104 underflows).
PAD_LOGIT = -1.0e4


def padded_vocab_size(vocab_size: int, divisible_by: Optional[int], tp: int = 1) -> int:
    """Megatron-LM's rule: the next multiple of ``divisible_by * tp`` (``vocab_size`` itself
    without ``divisible_by``)."""
    if divisible_by is None:
        return vocab_size
    if isinstance(divisible_by, bool) or not isinstance(divisible_by, int) or divisible_by < 1:
        raise ZooError(f"make_vocab_size_divisible_by={divisible_by!r} must be a positive integer")
    multiple = divisible_by * max(1, tp)
    return -(-vocab_size // multiple) * multiple


def install_logit_mask(model: torch.nn.Module, arch: Any, tp_rank: int) -> None:
    """Set the logits of padding ids to :data:`PAD_LOGIT` (the output layer's forward hook); no-op
    without padding or on a stage without an output layer. ``tp_rank``: the tensor-parallel rank
    the chunk is built for (its output layer holds that rank's slice of the vocabulary)."""
    padded = getattr(arch, "padded_vocab_size", None)
    layer = getattr(model, "output_layer", None)
    if not padded or padded == arch.vocab_size or layer is None:
        return
    vocab = arch.vocab_size

    def mask(module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, bias = output if isinstance(output, tuple) else (output, None)
        width = logits.shape[-1]
        start = tp_rank * width
        if start + width <= vocab:
            return output
        keep = torch.arange(start, start + width, device=logits.device) < vocab
        logits = logits.masked_fill(~keep, PAD_LOGIT)
        return (logits, bias) if isinstance(output, tuple) else logits

    layer.register_forward_hook(mask)
