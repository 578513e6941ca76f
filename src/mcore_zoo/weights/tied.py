"""Tied embeddings against a checkpoint that also carries an output layer.

With ``tie_word_embeddings: true`` the output layer *is* the embedding, so a checkpoint's
``lm_head.weight`` is ignored by the weight map. transformers, though, may load that tensor; if it
differs from the embedding the two would be different models. :func:`check_tied_output` compares
the two (streaming, a block of rows at a time) and refuses a difference, naming the tensor.
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


def check_tied_output(wmap: WeightMap, checkpoint: Any) -> None:
    """Raise :class:`TiedEmbeddingMismatchError` if the checkpoint's output layer (ignored under
    tying) is not bitwise the embedding. Reads both tensors a block of rows at a time."""
    pair = tied_pair(wmap, set(checkpoint.keys()))
    if pair is None:
        return
    head, embedding = pair
    source = str(checkpoint.path)
    shape_h, shape_e = tuple(checkpoint.shape(head)), tuple(checkpoint.shape(embedding))
    if shape_h != shape_e:
        raise TiedEmbeddingMismatchError(head, embedding, source, f"shape {shape_h} vs {shape_e}")
    if not shape_e or shape_e[0] == 0:
        return
    row_bytes = max(1, int(torch.Size(shape_e[1:]).numel()) * 8)
    step = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, shape_e[0], step):
        stop = min(start + step, shape_e[0])
        a = checkpoint.read(head, select=(0, start, stop))
        b = checkpoint.read(embedding, select=(0, start, stop))
        if a.dtype != b.dtype:
            a, b = a.double(), b.double()
        if not torch.equal(a, b):
            rows = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
            raise TiedEmbeddingMismatchError(head, embedding, source, f"first differing row {start + int(rows[0])}")
