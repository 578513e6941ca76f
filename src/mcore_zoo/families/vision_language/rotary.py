"""Interleaved multimodal RoPE (Qwen3-VL) for Megatron-Core's ``GPTModel``.

Megatron-Core's ``MultimodalRotaryEmbedding`` gives each of the three position rows (temporal,
height, width) a contiguous section of the rotary frequencies (Qwen2.5-VL). Qwen3-VL interleaves
them, as transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies`` does: frequency
``j`` of the half-width takes the height row's angle where ``j % 3 == 1 and j < 3 * sections[1]``,
the width row's where ``j % 3 == 2 and j < 3 * sections[2]``, the temporal row's elsewhere; the
half is then repeated (``cat(f, f)``). The angles are the products ``position * inv_freq`` (the
model's HF frequencies, :func:`mcore_zoo.build.install_rope`), selected, not recomputed, so the
decoder's rotation equals transformers' bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from ...errors import UnsupportedLayoutError


def interleaved_rows(half: int, sections: Sequence[int]) -> torch.Tensor:
    """``[half]``: which position row (0 temporal, 1 height, 2 width) drives each frequency."""
    rows = torch.zeros(half, dtype=torch.long)
    for row in (1, 2):
        rows[row:sections[row] * 3:3] = row
    return rows


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """``MultimodalRotaryEmbedding`` with the interleaved frequency layout (module docstring);
    the same call and output: ``[3, batch, seq]`` position ids -> ``[seq, batch, 1, 2 * half]`` angles
    (one context-parallel rank: the sequence is not split)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                cp_group: Optional[Any] = None) -> torch.Tensor:  # fmt: skip
        inv_freq = self.inv_freq
        freqs = position_ids.to(inv_freq.device)[..., None].float() * inv_freq.float()  # [3, b, s, half]
        rows = interleaved_rows(freqs.shape[-1], mrope_section).to(freqs.device)
        picked = torch.gather(freqs, 0, rows.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]  # [b, s, half]
        emb = torch.cat((picked, picked), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, 2 * half]
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is not None and cp_group.size() > 1:  # the build refuses it first (validate_layout)
            raise UnsupportedLayoutError("interleaved multimodal RoPE under context parallelism is not built yet")
        return emb


def install_interleaved_mrope(model: torch.nn.Module) -> None:
    """Give ``model`` (a ``GPTModel`` built with ``position_embedding_type="mrope"``) the
    interleaved layout; its frequencies and groups are kept."""
    rotary = model.rotary_pos_emb
    if not isinstance(rotary, MultimodalRotaryEmbedding):
        raise TypeError(f"interleaved multimodal RoPE replaces a MultimodalRotaryEmbedding, not {type(rotary).__name__}")
    rotary.__class__ = InterleavedMultimodalRotaryEmbedding
