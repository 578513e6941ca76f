"""``packed_forward`` of a vision-language model: token sequences with their own images / videos.

``vision_language_forward(handle, sequences, vision_inputs=[...], **options)``: ``sequences`` are
1-D token tensors whose image / video tokens stand where the merged features go (as transformers'
processor lays them out); ``vision_inputs`` has one entry per sequence - ``None`` (text only), a
dict or a :class:`~mcore_zoo.families.vision_language.spec.SequenceVisionInputs`
(``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``,
``second_per_grid_ts``). The sequences run as one THD pack; each sequence's position ids restart
at 0 and its tower features come from its own images only. Without ``vision_inputs`` the model runs
text as any decoder does. The other options are :func:`~mcore_zoo.distributed.forward.generic_forward`'s.

Tensor, pipeline and context parallelism of vision-language models are not built yet: refused by name.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from ...distributed.forward import generic_forward
from ...errors import ZooError
from ...handle import ModelHandle
from ...packing import PackedOutput, alignment_for, pack_sequences
from .spec import SequenceVisionInputs, pending_vision_inputs


def check_single_process_layout(handle: ModelHandle) -> None:
    """Vision-language models run on one model-parallel rank for now (TP = PP = CP = 1)."""
    layout = handle.placement
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1:
        raise ZooError(f"{handle.arch_config.architecture}: vision inputs under tensor, pipeline or context"
                       f" parallelism (tp={layout.tp}, pp={layout.pp}, cp={layout.cp}) are not built yet")  # fmt: skip


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
    check_single_process_layout(handle)
    if attention_mask is not None or isinstance(sequences, torch.Tensor) and sequences.dim() != 1:
        raise ZooError("vision inputs go with a list of 1-D token sequences (no padded batch)")
    seqs = [sequences] if isinstance(sequences, torch.Tensor) else list(sequences)
    if len(vision_inputs) != len(seqs):
        raise ZooError(f"vision_inputs has {len(vision_inputs)} entries for {len(seqs)} sequences (one per sequence)")
    if options.get("seq_format", "thd") != "thd":
        raise ZooError("vision inputs run as a THD pack (seq_format='thd')")
    inputs = [SequenceVisionInputs.of(v) for v in vision_inputs]
    align = align or alignment_for()
    batch = pack_sequences(seqs, align=align, pad_token_id=pad_token_id)
    model = next(m for m in handle.chunks[0].modules() if hasattr(m, "zoo_vision"))  # through DDP-style wrappers
    with pending_vision_inputs(model, inputs):
        return generic_forward(handle, batch, align=align, pad_token_id=pad_token_id, **options)
