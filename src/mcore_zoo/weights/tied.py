"""Checkpoint tensors that repeat another one: a tied model's ``lm_head``, MTP layers' copies.

With ``tie_word_embeddings: true`` the output layer *is* the embedding, so a checkpoint's
``lm_head.weight`` is ignored by the weight map. transformers, though, may load that tensor; if it
differs from the embedding the two would be different models. :func:`check_tied_output` compares
the two (streaming, a block of rows at a time) and refuses a difference, naming the tensor.
:func:`check_copies` does the same for a weight map's declared copies (:attr:`WeightMap.copies`:
an MTP layer's ``embed_tokens`` / ``shared_head.head``, which the model takes from its embedding
and output layer).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import WeightMapError
from .rules import WeightMap

#: mcore name of the output layer whose source is the embedding under tying.
_OUTPUT = "output_layer.weight"
#: Rows compared at a time (bounded memory for large vocabularies).
_BLOCK_BYTES = 64 * 2**20


class TiedEmbeddingMismatchError(WeightMapError):
    """A tied-embedding config whose checkpoint has an output layer different from the embedding."""

    def __init__(self, head: str, embedding: str, source: str, detail: str):
        self.head = head
        self.embedding = embedding
        super().__init__(
            f"{source}: the config ties the output layer to {embedding!r} (tie_word_embeddings: true), but the"
            f" checkpoint's {head!r} differs from it ({detail}); transformers would use {head!r}. Set"
            f" tie_word_embeddings: false in config.json to load it as its own output layer, or drop {head!r}"
        )


def tied_pair(wmap: WeightMap, names: set[str]) -> Optional[tuple[str, str]]:
    """``(checkpoint output-layer name, embedding name)`` when the map ties the output layer to the
    embedding and the checkpoint carries an ignored output layer too; else ``None``."""
    if not getattr(wmap.arch, "tie_word_embeddings", False):
        return None
    tied = [r for r in wmap.rules if r.mcore == _OUTPUT and not r.export and len(r.sources) == 1]
    if not tied or tied[0].sources[0].select is not None:
        return None
    embedding = tied[0].sources[0].hf
    heads = sorted(n for n in names if n.split(".")[-2:] == ["lm_head", "weight"] and n != embedding)
    if not heads or wmap.is_ignored(heads[0]) is None:
        return None
    return heads[0], embedding


class CopyMismatchError(WeightMapError):
    """A checkpoint tensor declared a copy of another (:attr:`WeightMap.copies`) that differs from it."""

    def __init__(self, copy: str, source_tensor: str, source: str, detail: str):
        self.copy = copy
        self.source_tensor = source_tensor
        super().__init__(
            f"{source}: {copy!r} must be a copy of {source_tensor!r} (the model has one tensor for both),"
            f" but it differs ({detail}); refusing to pick one"
        )


def first_difference(checkpoint: Any, a_name: str, b_name: str) -> Optional[str]:
    """``None`` if the checkpoint's tensors ``a_name`` and ``b_name`` are bitwise equal (values
    compared in float64 when the dtypes differ), else what differs first (shape, or a row).
    Reads both a block of rows at a time."""
    shape_a, shape_b = tuple(checkpoint.shape(a_name)), tuple(checkpoint.shape(b_name))
    if shape_a != shape_b:
        return f"shape {shape_a} vs {shape_b}"
    if not shape_b or shape_b[0] == 0:
        return None
    row_bytes = max(1, int(torch.Size(shape_b[1:]).numel()) * 8)
    step = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, shape_b[0], step):
        stop = min(start + step, shape_b[0])
        a = checkpoint.read(a_name, select=(0, start, stop))
        b = checkpoint.read(b_name, select=(0, start, stop))
        if a.dtype != b.dtype:
            a, b = a.double(), b.double()
        if not torch.equal(a, b):
            rows = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
            return f"first differing row {start + int(rows[0])}"
    return None


def check_tied_output(wmap: WeightMap, checkpoint: Any) -> None:
    """Raise :class:`TiedEmbeddingMismatchError` if the checkpoint's output layer (ignored under
    tying) is not bitwise the embedding. Reads both tensors a block of rows at a time."""
    pair = tied_pair(wmap, set(checkpoint.keys()))
    if pair is None:
        return
    head, embedding = pair
    detail = first_difference(checkpoint, head, embedding)
    if detail is not None:
        raise TiedEmbeddingMismatchError(head, embedding, str(checkpoint.path), detail)


def check_copies(wmap: WeightMap, checkpoint: Any) -> None:
    """Raise :class:`CopyMismatchError` for the first declared copy the checkpoint carries that is
    not bitwise its source (a copy the checkpoint lacks is fine: export writes it)."""
    names = set(checkpoint.keys())
    for copy, source_tensor in wmap.copies:
        if copy not in names or source_tensor not in names:
            continue
        detail = first_difference(checkpoint, copy, source_tensor)
        if detail is not None:
            raise CopyMismatchError(copy, source_tensor, str(checkpoint.path), detail)
