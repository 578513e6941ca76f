"""A vision-language model on Megatron-Core: the vision tower on the first stage, its features in
the decoder's input, multimodal RoPE.

:func:`attach_vision_tower` runs after the ``GPTModel`` (built with
``position_embedding_type="mrope"``) is constructed: on the first pipeline stage it adds the
tower as ``vision_model`` (its parameters are the model's, loaded, exported and trained like the
decoder's) and a forward pre-hook that turns each call's inputs into the language model's:

* position ids: ``[3, 1, T]`` multimodal ids per packed sequence (restarting at every sequence,
  :func:`~mcore_zoo.families.vision_language.positions.mrope_position_ids`); text-only input
  (no vision inputs pending) gets its 1-D ids in all three rows, as transformers does;
* ``decoder_input``: the word embeddings with the image / video tokens' rows replaced by the
  tower's merged features of that sequence's own images (the tower runs per sequence, so no
  attention crosses samples);
* deepstack features (Qwen3-VL): the tower's extra features of level ``k``, added to the output
  of decoder layer ``k`` at the same rows by a forward hook on that layer
  (:func:`_add_deepstack`), as transformers' ``_deepstack_process`` does.

A model with interleaved multimodal RoPE (``RopeSpec.mrope_interleaved``) gets its rotary module
from :mod:`.rotary`.

Under tensor parallelism the tower is replicated (every rank computes the same features from the
same pixels; its gradients are the same on every rank, as a replicated norm's are); under pipeline
parallelism it is on the first stage, every stage computes the position ids from the token ids it
is handed, and the decoder layers that take deepstack features must be on the first stage.

The vision inputs of the pack being run are set by the family's forward
(:func:`pending_vision_inputs`) for the duration of one call; the contract is
:class:`SequenceVisionInputs`, one per sequence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ...config.arch import ArchConfig
from ...errors import UnsupportedLayoutError, ZooError
from .positions import continue_positions, mrope_position_ids
from .rotary import install_interleaved_mrope
from .vision import TowerOutput, build_tower, tower_output

PENDING = "zoo_vision_inputs"
#: the deepstack features of the call being run: per level, ``(rows, features)`` of the pack
DEEPSTACK = "zoo_deepstack"


@dataclass(frozen=True)
class SequenceVisionInputs:
    """The vision inputs of one sequence, as transformers' processor gives them for one sample.

    Attributes:
        pixel_values: ``[patches, in_channels * temporal_patch_size * patch_size**2]``, every image's
            patches in order (``None``: no image).
        image_grid_thw: ``[images, 3]`` (frames, patch rows, patch columns) per image.
        pixel_values_videos, video_grid_thw: the same for videos.
        second_per_grid_ts: per video, seconds per temporal patch (default 1).
    """

    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    pixel_values_videos: Optional[torch.Tensor] = None
    video_grid_thw: Optional[torch.Tensor] = None
    second_per_grid_ts: Optional[Sequence[float]] = None

    @classmethod
    def of(cls, value: Any) -> "SequenceVisionInputs":
        """``None``, a mapping with these keys, or an instance."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ZooError(f"vision inputs: unknown keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ZooError(f"vision inputs of a sequence: expected None, a dict or SequenceVisionInputs, got {type(value).__name__}")


def attach_vision_tower(model: torch.nn.Module, arch: ArchConfig, params_dtype: torch.dtype) -> None:
    """Add the tower and the input pre-hook to a first-stage ``GPTModel`` of a vision-language arch."""
    if arch.vision is None:
        return
    model.zoo_vision = arch.vision
    setattr(model, DEEPSTACK, None)
    if getattr(model, "pre_process", True):
        device = model.embedding.word_embeddings.weight.device
        model.vision_model = build_tower(arch.vision).to(device=device, dtype=params_dtype)
    model.register_forward_pre_hook(_language_model_inputs, with_kwargs=True)
    if arch.rope.mrope_interleaved:
        install_interleaved_mrope(model)
    levels = len(arch.vision.deepstack_visual_indexes)
    for layer in model.decoder.layers:
        if layer.layer_number - 1 < levels:  # layer_number: 1-based, global
            if not getattr(model, "pre_process", True):
                raise UnsupportedLayoutError(f"{arch.architecture}: decoder layer {layer.layer_number - 1} takes deepstack"
                                             f" features ({levels} levels) but is not on the first pipeline stage, where"
                                             " the tower runs; give the first stage at least that many layers")  # fmt: skip
            layer.register_forward_hook(_add_deepstack(model, layer.layer_number - 1))


def _add_deepstack(model: torch.nn.Module, level: int) -> Any:
    """The forward hook of decoder layer ``level``: its output plus the call's deepstack features
    of that level at their rows (``hidden[rows] + features``, transformers' op)."""

    def hook(layer: torch.nn.Module, args: tuple, output: Any) -> Any:
        deepstack = getattr(model, DEEPSTACK, None)
        if not deepstack:
            return output
        hidden, *rest = output if isinstance(output, tuple) else (output,)
        rows, feats = deepstack[level]
        rows = rows.to(hidden.device)
        hidden = hidden.clone()
        hidden[rows, 0] = hidden[rows, 0] + feats.to(hidden.device, hidden.dtype)
        return (hidden, *rest) if isinstance(output, tuple) else hidden

    return hook


@contextlib.contextmanager
def pending_vision_inputs(model: torch.nn.Module, inputs: Sequence[SequenceVisionInputs]) -> Iterator[None]:
    """Hand ``inputs`` (one per sequence of the pack about to run) to ``model``'s next calls."""
    setattr(model, PENDING, list(inputs))
    try:
        yield
    finally:
        setattr(model, PENDING, None)


def vision_inputs_for(chunk: torch.nn.Module, members: Sequence[int], inputs: Optional[Sequence[Any]]) -> Any:
    """The context that hands the vision inputs of the sequences ``members`` (indexes into
    ``inputs``, one entry per sequence of a step) to ``chunk`` (possibly wrapped) for one call;
    a no-op without ``inputs``."""
    if inputs is None:
        return contextlib.nullcontext()
    model = next((m for m in chunk.modules() if hasattr(m, "zoo_vision")), None)
    if model is None:
        raise ZooError("vision inputs given to a model without a vision tower")
    return pending_vision_inputs(model, [SequenceVisionInputs.of(inputs[i]) for i in members])


def _segments(total: int, packed_seq_params: Any) -> list[tuple[int, int, int]]:
    """``(start, length, padded length)`` of every sequence of a THD pack (one if not packed)."""
    if packed_seq_params is None:
        return [(0, total, total)]
    real = packed_seq_params.cu_seqlens_q.tolist()
    padded = packed_seq_params.cu_seqlens_q_padded
    padded = real if padded is None else padded.tolist()
    return [(padded[i], real[i + 1] - real[i], padded[i + 1] - padded[i]) for i in range(len(real) - 1)]


def _features(tower: torch.nn.Module, pixels: Optional[torch.Tensor], grid: Optional[torch.Tensor], what: str) -> Optional[TowerOutput]:
    if pixels is None:
        return None
    if grid is None:
        raise ZooError(f"vision inputs: {what} pixels without their grid_thw")
    return tower_output(tower(pixels.to(tower.patch_embed.proj.weight.device), grid))


def _deepstack_levels(replaced: list[tuple[torch.Tensor, TowerOutput]], levels: int) -> Optional[list]:
    """Per deepstack level, the rows of every replaced token of the pack and their features."""
    if not levels or not replaced:
        return None
    rows = torch.cat([r for r, _ in replaced])
    return [(rows, torch.cat([out.deepstack[k] for _, out in replaced])) for k in range(levels)]


def _language_model_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    input_ids, position_ids, *rest = args
    pending = getattr(model, PENDING, None)
    setattr(model, DEEPSTACK, None)
    if position_ids is not None and position_ids.dim() == 3:  # multimodal ids already given
        return args, kwargs
    if not pending:  # text: the same 1-D ids in all three rows
        return (input_ids, position_ids.unsqueeze(0).expand(3, -1, -1), *rest), kwargs
    vision = model.zoo_vision
    if input_ids.shape[0] != 1:
        raise ZooError("vision inputs need a THD pack (one row of packed sequences)")
    ids = input_ids[0]
    segments = _segments(ids.numel(), kwargs.get("packed_seq_params"))
    if len(segments) != len(pending):
        raise ZooError(f"vision inputs for {len(pending)} sequences, the pack holds {len(segments)}")
    positions, replaced = [], []
    for i, ((start, length, padded), inputs) in enumerate(zip(segments, pending)):
        tokens = ids[start:start + length].cpu()
        try:
            found = mrope_position_ids(tokens, vision, inputs.image_grid_thw, inputs.video_grid_thw,
                                       inputs.second_per_grid_ts)  # fmt: skip
        except ValueError as exc:
            raise ZooError(f"sequence {i} of the pack: {exc}") from None
        positions.append(continue_positions(found, padded - length))
        if getattr(model, "pre_process", True):
            for token, pixels, grid in ((vision.image_token_id, inputs.pixel_values, inputs.image_grid_thw),
                                        (vision.video_token_id, inputs.pixel_values_videos, inputs.video_grid_thw)):
                out = _features(model.vision_model, pixels, grid, "image" if token == vision.image_token_id else "video")
                rows = (ids[start:start + length] == token).nonzero().flatten() + start
                count = 0 if out is None else out.features.shape[0]
                if rows.numel() != count:
                    raise ZooError(f"sequence {i} of the pack has {rows.numel()} {'image' if token == vision.image_token_id else 'video'}"
                                   f" tokens and {count} merged features")  # fmt: skip
                if count:
                    replaced.append((rows, out))
    position_ids = torch.cat(positions, dim=1).unsqueeze(1).to(input_ids.device)
    if getattr(model, "pre_process", True):
        embeddings = model.embedding(input_ids=input_ids, position_ids=None)  # [T, 1, H]
        if replaced:
            embeddings = embeddings.clone()
            for rows, out in replaced:
                embeddings[rows.to(embeddings.device), 0] = out.features.to(embeddings.dtype)
        setattr(model, DEEPSTACK, _deepstack_levels(replaced, len(vision.deepstack_visual_indexes)))
        kwargs = dict(kwargs, decoder_input=embeddings)
    return (input_ids, position_ids, *rest), kwargs
