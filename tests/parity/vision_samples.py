"""Token sequences with images for the vision-language tests, laid out as transformers' processor
lays out one sample (the marker ids and patch size of the Qwen-VL example configs)."""

from __future__ import annotations

import torch

#: vision_start, vision_end and image token ids of the example configs
START, END, IMAGE = 248, 249, 250
#: in_channels * temporal_patch_size * patch_size**2 of the example configs
PATCH_VALUES = 3 * 2 * 4 * 4


def image_sample(seed: int, grids: list[tuple[int, int, int]], text: int = 9) -> tuple[torch.Tensor, dict]:
    """Token ids with ``len(grids)`` images (start, one image token per merged feature, end between
    text runs of ``text`` random tokens) and the sample's vision inputs (random pixels; ``{}``
    without images)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, START, (text,), generator=g)]
    for t, h, w in grids:
        parts += [torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([END]),
                  torch.randint(0, START, (text,), generator=g)]  # fmt: skip
    ids = torch.cat(parts)
    if not grids:
        return ids, {}
    rows = sum(t * h * w for t, h, w in grids)
    return ids, {"pixel_values": torch.randn(rows, PATCH_VALUES, generator=g), "image_grid_thw": torch.tensor(grids)}
