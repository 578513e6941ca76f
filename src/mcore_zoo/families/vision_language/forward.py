"""``packed_forward`` of a vision-language model: token sequences with their own images / videos.

``vision_language_forward(handle, sequences, vision_inputs=[...], **options)``: ``sequences`` are
1-D token tensors whose image / video tokens stand where the merged features go (as transformers'
processor lays them out); ``vision_inputs`` has one entry per sequence - ``None`` (text only), a
dict or a :class:`~mcore_zoo.families.vision_language.spec.SequenceVisionInputs`
(``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``,
``second_per_grid_ts``). The sequences run as THD packs (one per micro-batch, as
:func:`~mcore_zoo.distributed.forward.generic_forward` plans them), each chunk call handed the
vision inputs of its micro-batch's sequences; each sequence's position ids restart at 0 and its
tower features come from its own images only. Without ``vision_inputs`` the model runs text as any
decoder does. The other options are ``generic_forward``'s.

Tensor parallelism (the tower replicated) and pipeline parallelism (the tower on the first stage)
are built; context and sequence parallelism and virtual pipeline stages are refused by name when
the model is built (``validate_layout``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from ...distributed.forward import generic_forward
from ...errors import ZooError
from ...handle import ModelHandle
from ...packing import PackedOutput


def vision_language_forward(
    handle: ModelHandle,
    sequences: Union[Sequence[torch.Tensor], torch.Tensor, Any],
    attention_mask: Optional[torch.Tensor] = None,
    *,
    vision_inputs: Optional[Sequence[Any]] = None,
    align: Optional[int] = None,
    pad_token_id: int = 0,
    **options: Any,
) -> PackedOutput:
    """The family's forward (module docstring)."""
    if vision_inputs is None:
        return generic_forward(handle, sequences, attention_mask, align=align, pad_token_id=pad_token_id, **options)
    if attention_mask is not None or isinstance(sequences, torch.Tensor) and sequences.dim() != 1:
        raise ZooError("vision inputs go with a list of 1-D token sequences (no padded batch)")
    seqs = [sequences] if isinstance(sequences, torch.Tensor) else list(sequences)
    if len(vision_inputs) != len(seqs):
        raise ZooError(f"vision_inputs has {len(vision_inputs)} entries for {len(seqs)} sequences (one per sequence)")
    if options.get("seq_format", "thd") != "thd":
        raise ZooError("vision inputs run as a THD pack (seq_format='thd')")
    return generic_forward(handle, seqs, align=align, pad_token_id=pad_token_id, vision_inputs=vision_inputs, **options)
