"""The weight transform of a padded vocabulary (``make_vocab_size_divisible_by``):
:class:`PadVocab`. The padding rule and the logit mask are :mod:`mcore_zoo.vocab`'s."""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ZooError
from .rules import Transform, TransformContext


class PadVocab(Transform):
    """One ``[V, ...]`` HF tensor <-> this rank's rows of the zero-padded ``[Vp, ...]`` mcore tensor.

    Loading reads the whole HF tensor (``reads_whole``: the padded rows a rank owns are not a
    tensor-parallel chunk of the unpadded tensor). On export the rank's rows are gathered over TP
    and :meth:`finish` drops the padding."""

    name = "pad-vocab"
    reads_whole = True

    def __init__(self, vocab_size: int, padded_size: int) -> None:
        self.vocab_size, self.padded_size = vocab_size, padded_size

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        (full,) = pieces
        if full.shape[0] != self.vocab_size:
            raise ZooError(f"{self}: the HF tensor has {full.shape[0]} rows, expected {self.vocab_size}")
        rows = self.padded_size // ctx.tp_size
        start, stop = ctx.tp_rank * rows, (ctx.tp_rank + 1) * rows
        out = full.new_zeros((rows, *full.shape[1:]))
        if start < self.vocab_size:
            out[: min(stop, self.vocab_size) - start] = full[start : min(stop, self.vocab_size)]
        return out

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return [tensor]  # this rank's padded rows; gathered over TP, then finish()

    def finish(self, tensor: torch.Tensor) -> torch.Tensor:
        """The gathered ``[Vp, ...]`` tensor without its padding rows."""
        if tensor.shape[0] != self.padded_size:
            raise ZooError(
                f"{self}: {tensor.shape[0]} rows to unpad, expected the gathered {self.padded_size}"
                " (a padded vocabulary is exported gathered over tensor parallelism only)"
            )
        return tensor[: self.vocab_size]

    def hf_shape(self, param_shape: Sequence[int], ctx: TransformContext) -> tuple[int, ...]:
        return (self.vocab_size, *param_shape[1:])

    def __repr__(self) -> str:
        return f"pad-vocab({self.vocab_size}->{self.padded_size})"


__all__ = ["PadVocab"]
