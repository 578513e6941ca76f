"""Token sequences with images for the vision-language tests, laid out as transformers' processor
lays out one sample (the marker ids and patch size of the Qwen-VL example configs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def check_pack_of_three_samples(model: Any, hf_logits: Callable[[torch.Tensor, dict], torch.Tensor],
                                exact_pack: bool = True) -> None:  # fmt: skip
    """Three samples (two images, none, one image) packed with alignment 8: each packed sample
    equals itself run alone (bitwise, or within 1e-6 of the largest logit with ``exact_pack=False``),
    and each alone equals ``hf_logits(ids, vision)`` (transformers on it) bitwise."""
    import mcore_zoo
    from mcore_zoo.testing.common import assert_same

    samples = [image_sample(1, [(1, 6, 4), (1, 4, 4)]), image_sample(2, [], text=13), image_sample(3, [(1, 8, 8)])]
    with torch.no_grad():
        packed = mcore_zoo.packed_forward(model, [s for s, _ in samples], vision_inputs=[v or None for _, v in samples],
                                          align=8)  # fmt: skip
        for i, (ids, vision) in enumerate(samples):
            alone = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision or None])
            assert_same(packed.logits[i], alone.logits[0], f"sample {i}: packed vs alone", exact=exact_pack)
            assert_same(packed.logprobs[i], alone.logprobs[0], f"sample {i}: log-probs packed vs alone", exact=exact_pack)
            assert_same(alone.logits[0], hf_logits(ids, vision), f"sample {i}: alone vs transformers", exact=True)
