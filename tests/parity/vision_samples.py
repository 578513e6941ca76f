"""Token sequences with images for the vision-language tests, laid out as transformers' processor
lays out one sample (the marker ids and patch size of the Qwen-VL example configs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: vision_start, vision_end, image and video token ids of the example configs
START, END, IMAGE, VIDEO = 248, 249, 250, 251
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


def check_pack_of_three_samples(model: Any, hf_logits: Callable[[torch.Tensor, dict], torch.Tensor]) -> None:
    """Three samples (two images, none, one image) packed with alignment 8: each packed sample
    equals itself run alone bitwise,
    and each alone equals ``hf_logits(ids, vision)`` (transformers on it) bitwise."""
    import mcore_zoo
    from mcore_zoo.testing.common import assert_same

    samples = [image_sample(1, [(1, 6, 4), (1, 4, 4)]), image_sample(2, [], text=13), image_sample(3, [(1, 8, 8)])]
    with torch.no_grad():
        packed = mcore_zoo.packed_forward(model, [s for s, _ in samples], vision_inputs=[v or None for _, v in samples],
                                          align=8)  # fmt: skip
        for i, (ids, vision) in enumerate(samples):
            alone = mcore_zoo.packed_forward(model, [ids], vision_inputs=[vision or None])
            assert_same(packed.logits[i], alone.logits[0], f"sample {i}: packed vs alone", exact=True)
            assert_same(packed.logprobs[i], alone.logprobs[0], f"sample {i}: log-probs packed vs alone", exact=True)
            assert_same(alone.logits[0], hf_logits(ids, vision), f"sample {i}: alone vs transformers", exact=True)


def image_token_types(ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` of one sample: ``[1, len]``, 1 at image tokens, else 0."""
    return (ids == IMAGE).int()[None]


def check_train_step_trains_the_tower(model: Any, hf: torch.nn.Module) -> set:
    """``train_step`` over two samples with images (two micro-batches): the loss equals
    transformers' summed next-token log-likelihood within 1e-6, and every tower parameter's
    gradient equals transformers' (``hf``, eager) within 1e-5 of its largest. Returns the tower's
    parameter names."""
    import mcore_zoo

    model.train()
    samples = [image_sample(1, [(1, 4, 4)], text=5), image_sample(3, [(1, 4, 8)], text=5)]

    def loss_fn(tokens):  # type: ignore[no-untyped-def]
        return -(tokens.logprobs * tokens.mask).sum(), {}

    result = mcore_zoo.train_step(model, [s for s, _ in samples], loss_fn, vision_inputs=[v for _, v in samples],
                                  num_microbatches=2)  # fmt: skip
    hf_loss = 0.0
    for ids, vision in samples:
        logits = hf(input_ids=ids[None], mm_token_type_ids=image_token_types(ids), **vision).logits[0]
        hf_loss = hf_loss - torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[1:, None]).sum()
    hf_loss.backward()
    torch.testing.assert_close(result.loss, hf_loss.detach(), rtol=1e-6, atol=0)
    tower = dict(model.vision_model.named_parameters())
    theirs = {n[len("model.visual."):]: p for n, p in hf.named_parameters() if n.startswith("model.visual.")}
    assert set(theirs) == set(tower)
    for name, param in theirs.items():
        ours = tower[name].grad
        assert ours is not None and ours.abs().sum() > 0, name
        torch.testing.assert_close(ours, param.grad, rtol=1e-5, atol=1e-5 * float(param.grad.abs().max()))
    return set(tower)


def check_a_video_sample_in_a_pack(model: Any, hf: torch.nn.Module) -> None:
    """A sample with a two-frame video (each frame its own run of video tokens, timestamp text
    between, as Qwen3-VL's and Qwen3.5's processors lay it out) and an image, packed after an
    image-only sample: its logits equal transformers' (``hf``, eager) bit for bit."""
    import mcore_zoo
    from mcore_zoo.testing.common import assert_same

    g = torch.Generator().manual_seed(7)
    text = lambda n: torch.randint(0, START, (n,), generator=g)
    frame = lambda: [text(2), torch.tensor([START]), torch.full((4,), VIDEO), torch.tensor([END])]
    ids = torch.cat([text(5), *frame(), *frame(), text(4), torch.tensor([START]), torch.full((4,), IMAGE),
                     torch.tensor([END]), text(6)])  # fmt: skip
    vision = {"pixel_values_videos": torch.randn(2 * 4 * 4, PATCH_VALUES, generator=g),
              "video_grid_thw": torch.tensor([[2, 4, 4]]),
              "pixel_values": torch.randn(16, PATCH_VALUES, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    types = ((ids == IMAGE).int() + 2 * (ids == VIDEO).int())[None]
    with torch.no_grad():
        theirs = hf(input_ids=ids[None], mm_token_type_ids=types, **vision).logits[0]
        other, other_vision = image_sample(4, [(1, 4, 8)])
        packed = mcore_zoo.packed_forward(model, [other, ids], vision_inputs=[other_vision, vision], align=8)
    assert_same(packed.logits[1], theirs, "video sample in a pack vs transformers", exact=True)
