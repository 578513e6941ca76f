"""Multimodal RoPE position ids of one sequence, exactly as transformers' ``get_rope_index``.

A vision-language language model rotates each query / key by three position ids (temporal,
height, width; ``RopeSpec.mrope_section`` says which rotary frequencies each one drives). Text
tokens carry one id in all three rows, counting up; the tokens of one image (or video) carry its
merged grid's frame, row and column, offset by the position reached before it, and the text after
it continues from ``max(rows, columns)`` past that offset. Image and video tokens are recognised by
id (``VisionSpec.image_token_id`` / ``video_token_id``), and consecutive tokens of one kind are one
image or video, in order, as in transformers. In a THD pack every sequence gets its own ids, from 0 (the family's
input pre-hook, :mod:`mcore_zoo.families.vision_language.spec`).

Qwen3-VL (``VisionSpec.frames_per_video_run``) separates a video's frames by timestamp text: each
frame is its own run of video tokens, placed as an image of one frame (temporal position 0 past
its offset), and ``second_per_grid_ts`` is not read.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from ...config.arch import VisionSpec

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: torch.Tensor, vision: VisionSpec) -> torch.Tensor:
    """Per token: 0 text, 1 image, 2 video (transformers' ``mm_token_type_ids``)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == vision.image_token_id] = IMAGE
    types[input_ids == vision.video_token_id] = VIDEO
    return types


def _grid_positions(start: int, grid_thw: torch.Tensor, merge: int, time_interval: float) -> torch.Tensor:
    """``[3, t * h * w / merge**2]`` ids of one image / video (transformers' ``get_vision_position_ids``)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    temporal = (torch.arange(t) * time_interval).long()
    t_grid, h_grid, w_grid = torch.meshgrid(temporal, torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    ids = torch.stack([t_grid, h_grid, w_grid], dim=0).reshape(3, -1)
    ids[0] += start
    return ids


def mrope_position_ids(input_ids: torch.Tensor, vision: VisionSpec, image_grid_thw: Optional[torch.Tensor] = None,
                       video_grid_thw: Optional[torch.Tensor] = None,
                       second_per_grid_ts: Optional[Sequence[float]] = None) -> torch.Tensor:  # fmt: skip
    """``[3, len]`` position ids of one 1-D token sequence (module docstring)."""
    if vision.frames_per_video_run and video_grid_thw is not None:
        if second_per_grid_ts is not None:
            raise ValueError("second_per_grid_ts is not read by this model: timestamp text separates its video frames")
        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
    grids = {IMAGE: iter(image_grid_thw if image_grid_thw is not None else ()),
             VIDEO: iter(video_grid_thw if video_grid_thw is not None else ())}  # fmt: skip
    seconds = iter(second_per_grid_ts if second_per_grid_ts is not None else itertools.repeat(1))
    parts, position = [], 0
    for kind, group in itertools.groupby(enumerate(token_types(input_ids, vision).tolist()), lambda x: x[1]):
        members = list(group)
        if kind == TEXT:
            parts.append(torch.arange(len(members)).view(1, -1).expand(3, -1) + position)
            position += len(members)
            continue
        grid = next(grids[kind], None)
        if grid is None:
            what = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
            raise ValueError(f"more runs of {'image' if kind == IMAGE else 'video'} tokens than rows of {what}")
        interval = vision.tokens_per_second * next(seconds) if kind == VIDEO else 1
        ids = _grid_positions(position, grid, vision.spatial_merge_size, interval)
        if ids.shape[1] != len(members):
            raise ValueError(f"a run of {len(members)} {'image' if kind == IMAGE else 'video'} tokens, but its grid"
                             f" {tuple(int(v) for v in grid)} merges into {ids.shape[1]} features")  # fmt: skip
        parts.append(ids)
        position += max(int(grid[1]), int(grid[2])) // vision.spatial_merge_size
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def continue_positions(ids: torch.Tensor, count: int) -> torch.Tensor:
    """``ids`` followed by ``count`` padding positions counting on from its largest id."""
    start = int(ids.max()) + 1 if ids.numel() else 0
    return torch.cat([ids, (torch.arange(count) + start).view(1, -1).expand(3, -1)], dim=1)
