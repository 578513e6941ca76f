"""THD sequence packing and the packed forward.

Variable-length sequences are concatenated into one ``[1, T]`` row; ``cu_seqlens`` marks where each
starts. Each sequence is padded to a multiple of ``align`` (what tensor / context parallelism
need: ``tp`` under sequence parallel, ``2 * cp * tp`` under context parallel), and mcore receives
``PackedSeqParams(qkv_format="thd")`` with both the real (``cu_seqlens_q``) and padded
(``cu_seqlens_q_padded``) boundaries. Positions restart at 0 for every sequence.

Pure data: no model, no process group. The forward that runs a model on a pack is
:func:`mcore_zoo.packed_forward` (:mod:`mcore_zoo.distributed.forward`); it returns
:class:`PackedOutput` with per-token log-probabilities of the next token
(``logprobs[i][j] = log p(tokens[j + 1] | tokens[:j + 1])``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from .errors import ZooError


def alignment_for(tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> int:
    """Per-sequence padding multiple for a layout (the rule proven in verl / mbridge)."""
    if cp > 1:
        return 2 * cp * tp
    if sequence_parallel:
        return tp
    return 1


@dataclass
class PackedBatch:
    """Sequences packed into one THD row.

    Attributes:
        input_ids: ``[1, T]`` long, sequences back to back, each padded to ``align``.
        position_ids: ``[1, T]`` long, restarting at 0 per sequence (pads continue counting).
        cu_seqlens: ``[n + 1]`` int32, boundaries of the real tokens (cumulative lengths).
        cu_seqlens_padded: ``[n + 1]`` int32, boundaries of the padded slots.
        lengths: real length of each sequence.
        max_seqlen: longest padded slot.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    lengths: list[int]
    max_seqlen: int
    align: int = 1

    @property
    def total(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: Union[str, torch.device]) -> "PackedBatch":
        return PackedBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.cu_seqlens_padded.to(device),
            list(self.lengths),
            self.max_seqlen,
            self.align,
        )

    def packed_seq_params(self) -> Any:
        """Megatron-Core ``PackedSeqParams`` for this pack."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """``[1, T, ...]`` (or ``[T, ...]``) -> one ``[len_i, ...]`` tensor per sequence."""
        if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == self.total:
            packed = packed[0]
        starts = self.cu_seqlens_padded.tolist()
        return [packed[s : s + n] for s, n in zip(starts, self.lengths)]

    def context_parallel_index(self, cp_rank: int, cp_size: int) -> torch.Tensor:
        """Pack positions held by context-parallel rank ``cp_rank`` (see :func:`zigzag_index`)."""
        return zigzag_index(self.cu_seqlens_padded, cp_rank, cp_size)

    def context_parallel_shard(self, cp_rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input_ids, position_ids)``, each ``[1, T / cp_size]``; positions are
        the tokens' original positions in their sequence. The ``PackedSeqParams`` stay global."""
        index = self.context_parallel_index(cp_rank, cp_size).to(self.input_ids.device)
        return self.input_ids[:, index], self.position_ids[:, index]

    def merge_context_parallel(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-rank outputs ``[T / cp, ...]`` (rank order) -> the whole pack ``[T, ...]``, in pack order."""
        size = len(parts)
        index = torch.cat([self.context_parallel_index(r, size) for r in range(size)]).to(parts[0].device)
        merged = parts[0].new_empty((self.total, *parts[0].shape[1:]))
        merged[index] = torch.cat(list(parts))
        return merged


def zigzag_index(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Load-balanced context-parallel split of a THD pack.

    Each sequence's padded slot is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds chunk
    ``r`` followed by chunk ``2 * cp_size - 1 - r`` (so every rank gets as much causal-attention work
    as the others). Returns the pack positions of this rank's tokens, in its local order: sequence
    ``i`` occupies local rows ``[cu_padded[i] / cp, cu_padded[i + 1] / cp)``, which is what
    Megatron-Core's THD RoPE and Transformer Engine's context-parallel attention expect.
    """
    if not 0 <= cp_rank < cp_size:
        raise ZooError(f"context-parallel rank {cp_rank} is not in [0, {cp_size})")
    bounds = cu_seqlens_padded.tolist()
    pieces = []
    for start, stop in zip(bounds, bounds[1:]):
        slot = stop - start
        if slot % (2 * cp_size):
            raise ZooError(
                f"a packed slot of {slot} tokens cannot be split into 2*cp={2 * cp_size} chunks;"
                f" pack with align=alignment_for(cp={cp_size}, ...)"
            )
        chunk = slot // (2 * cp_size)
        pieces.append(torch.arange(start + cp_rank * chunk, start + (cp_rank + 1) * chunk))
        back = 2 * cp_size - 1 - cp_rank
        pieces.append(torch.arange(start + back * chunk, start + (back + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def pack_sequences(
    sequences: Union[Sequence[torch.Tensor], torch.Tensor],
    attention_mask: Optional[torch.Tensor] = None,
    *,
    align: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack token sequences (a list of 1-D tensors, or a padded ``[B, S]`` batch + 0/1 mask).

    With a mask, each row's tokens are those where the mask is 1 (left or right padding); they
    must be contiguous.
    """
    if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
        rows = []
        for b in range(sequences.shape[0]):
            if attention_mask is None:
                rows.append(sequences[b])
                continue
            keep = attention_mask[b].bool()
            idx = keep.nonzero().flatten()
            if idx.numel() and int(idx[-1] - idx[0] + 1) != idx.numel():
                raise ZooError(f"row {b}: attention_mask has holes; only left/right padding can be packed")
            rows.append(sequences[b][keep])
        sequences = rows
    elif attention_mask is not None:
        raise ZooError("attention_mask goes with a padded [B, S] batch")
    if not sequences:
        raise ZooError("nothing to pack")
    lengths = [int(s.numel()) for s in sequences]
    if min(lengths) < 1:
        raise ZooError("cannot pack an empty sequence")
    padded = [-(-n // align) * align for n in lengths]
    total = sum(padded)
    device = sequences[0].device
    input_ids = torch.full((1, total), pad_token_id, dtype=torch.long, device=device)
    position_ids = torch.zeros((1, total), dtype=torch.long, device=device)
    offset = 0
    for seq, n, p in zip(sequences, lengths, padded):
        input_ids[0, offset : offset + n] = seq.reshape(-1).to(torch.long)
        position_ids[0, offset : offset + p] = torch.arange(p, device=device)
        offset += p
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu_padded = torch.zeros_like(cu)
    cu[1:] = torch.tensor(lengths, device=device).cumsum(0)
    cu_padded[1:] = torch.tensor(padded, device=device).cumsum(0)
    # mcore/TE read the real boundaries relative to padded slots: real token k of sequence i sits
    # at cu_padded[i] + k; cu_seqlens counts real tokens (lengths) only.
    return PackedBatch(input_ids, position_ids, cu, cu_padded, lengths, max(padded), align)


@dataclass
class PackedOutput:
    """Per-sequence results of a packed forward (lists in input order).

    ``logits[i]``: ``[len_i, vocab]`` (float as the model computes); ``logprobs[i]``: ``[len_i - 1]``
    float32 log-probabilities of the next token; ``values[i]``: ``[len_i]`` float32 value-head
    outputs (a model built with ``head="value"``, which has no logits); ``mtp_logprobs[d][i]``:
    ``[len_i - 2 - d]`` float32 log-probabilities that multi-token-prediction depth ``d + 1`` gives
    token ``j + d + 2`` at position ``j`` (a model built with MTP, ``return_mtp_logprobs=True``).
    """

    logits: Optional[list[torch.Tensor]] = None
    logprobs: Optional[list[torch.Tensor]] = None
    values: Optional[list[torch.Tensor]] = None
    mtp_logprobs: Optional[list[list[torch.Tensor]]] = None


def next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float())[j, tokens[j + 1]]`` for ``j < len - 1`` (HF's usual formula)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logp.gather(-1, tokens[1:].reshape(-1, 1).to(logp.device)).squeeze(-1)
