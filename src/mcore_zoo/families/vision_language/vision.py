"""The vision towers as zoo modules, in transformers' op order (CPU fp32: bit for bit).

``QwenVisionTower(spec)(pixel_values, grid_thw)`` -> ``[sum(t * h * w) / merge**2, out_hidden_size]``:
the merged features of every image (or video) in ``grid_thw``, in order. ``pixel_values`` are the
processor's rows (one patch each, ``in_channels * temporal_patch_size * patch_size**2`` values).
Attention never crosses an image: window blocks attend within windows of one frame, the
``fullatt_block_indexes`` blocks within one frame. Parameter names are transformers' (under
``model.visual.``), so the weight table maps them one to one.

``Qwen3VisionTower(spec)(pixel_values, grid_thw)`` -> :class:`TowerOutput`: Qwen3-VL's merged
features and its deepstack features (one ``[tokens, out_hidden_size]`` tensor per
``deepstack_visual_indexes`` entry, in block order), which the family's pre-hook adds to the first
decoder layers' outputs. Its patches carry a learned position embedding interpolated bilinearly
(corners aligned) from the square table to each image's grid, as transformers'
``get_vision_interpolation_indices_and_weights`` computes it; every block attends within one frame.

The towers are the family's extension point (:data:`TOWERS`, by ``VisionSpec.kind``). Qwen3.5's
tower is ``Qwen3VisionTower`` with no deepstack levels (its ``TowerOutput`` carries the merged
features alone).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...config.arch import VisionSpec

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip
NORM_EPS = 1e-6  # transformers' Qwen2.5-VL tower fixes it


class VisionRMSNorm(nn.Module):
    """transformers' ``Qwen2_5_VLRMSNorm``: fp32 statistics, ``weight * x``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Non-causal attention over each ``cu_seqlens`` segment alone, eager (fp32 softmax), 2-D rotary."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.heads = spec.num_heads
        self.scaling = spec.head_dim**-0.5
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        dtype = q.dtype
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q, k = q.float(), k.float()
        q = ((q * cos) + (_rotate_half(q) * sin)).to(dtype)
        k = ((k * cos) + (_rotate_half(k) * sin)).to(dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outputs = []
        for qs, ks, vs in zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v))):
            weights = torch.matmul(qs, ks.transpose(2, 3)) * self.scaling
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(qs.dtype)
            outputs.append(torch.matmul(weights, vs).transpose(1, 2).contiguous())
        return self.proj(torch.cat(outputs, dim=1).reshape(n, -1).contiguous())


class VisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(spec.hidden_size)
        self.norm2 = VisionRMSNorm(spec.hidden_size)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Conv3d over ``temporal_patch_size x patch_size x patch_size`` patches (Qwen2.5-VL: no bias)."""

    def __init__(self, spec: VisionSpec, bias: bool = False) -> None:
        super().__init__()
        self.shape = (-1, spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        kernel = self.shape[2:]
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)
        self.width = spec.hidden_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.view(*self.shape).to(self.proj.weight.dtype)).view(-1, self.width)


class PatchMerger(nn.Module):
    """RMSNorm, ``merge**2`` neighbouring patches concatenated, Linear - GELU - Linear."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(spec.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, spec.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) of every patch, merge blocks contiguous, frames repeated."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows, cols = (p.reshape(block).transpose(1, 2).flatten() for p in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)


def frame_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative patch counts of every frame: full attention stays within one frame."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(dim=0, dtype=torch.int32), (1, 0), value=0)


def window_order(grid_thw: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged-token order that groups windows, cumulative window lengths in patches), as transformers."""
    merge, unit = spec.spatial_merge_size, spec.spatial_merge_size**2
    side = spec.window_size // merge // spec.patch_size
    order, bounds, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100).reshape(t, nh, side, nw, side)
        padded = padded.permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
        lengths = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        bounds.extend((lengths.cumsum(0) * unit + bounds[-1]).tolist())
        offset += t * gh * gw
    return torch.cat(order), torch.unique_consecutive(torch.tensor(bounds, dtype=torch.int32))


class AxialRotary(nn.Module):
    """The towers' 2-D rotary: the same frequencies for a patch's row and column, ``(cos, sin)``
    of ``[row angles, column angles]`` repeated twice (the whole head rotates). The inverse
    frequencies stay float32 whatever dtype the model is cast to, as transformers keeps its towers'.
    The angles, cos and sin are computed on the device of ``positions``: the towers hand them over on
    the activations' device, where transformers computes its own (a GPU's cos / sin and a CPU's differ
    in the last bit)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        half = spec.head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn: Callable, recurse: bool = True) -> "AxialRotary":
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # moved, never cast
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)

        def recompose(f: torch.Tensor) -> torch.Tensor:
            hw = torch.cat([f[:, 0], f[:, 1]], dim=-1)
            return torch.cat([hw, hw], dim=-1)

        return recompose(freqs.cos()), recompose(freqs.sin())


class QwenVisionTower(nn.Module):
    """Qwen2.5-VL's tower (module docstring)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.rotary = AxialRotary(spec)
        self.blocks = nn.ModuleList([VisionBlock(spec) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        spec, unit = self.spec, self.spec.spatial_merge_size**2
        grid_thw = grid_thw.to("cpu")
        positions = patch_positions(grid_thw, spec.spatial_merge_size)
        frames = frame_seqlens(grid_thw)
        order, windows = window_order(grid_thw, spec)
        x = self.patch_embed(pixel_values)
        n = x.shape[0]

        def windowed(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // unit, unit, -1)[order.to(t.device)].reshape(n, -1)

        x = windowed(x)
        cos, sin = (windowed(f) for f in self.rotary(positions.to(x.device)))
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in spec.fullatt_block_indexes else windows, cos, sin)
        return self.merger(x)[torch.argsort(order).to(x.device)]


class TowerOutput(NamedTuple):
    """A tower's merged features ``[tokens, out_hidden_size]`` and its deepstack features (one
    tensor of the same shape per deepstack level; empty for a tower without them)."""

    features: torch.Tensor
    deepstack: tuple = ()


def tower_output(value: Union[torch.Tensor, TowerOutput]) -> TowerOutput:
    """A tower's return value as a :class:`TowerOutput` (a plain tensor: merged features alone)."""
    return value if isinstance(value, TowerOutput) else TowerOutput(value)


class Qwen3VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))`` with biases."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    """LayerNorm (eps 1e-6) - attention - residual, LayerNorm - MLP - residual."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = Qwen3VisionMLP(spec)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm over each patch (``postshuffle``: over the ``merge**2`` patches concatenated),
    the patches concatenated, Linear - GELU - Linear to ``out_hidden_size``."""

    def __init__(self, spec: VisionSpec, postshuffle: bool = False) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else spec.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-axis taps into a ``side``-long table and their weights for target positions ``index``
    of an axis ``size`` long: bilinear, corners aligned, border clamped (transformers' op order)."""
    index = index.to(torch.float32)
    src = index * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (src[:, None] - floor[:, None] - offsets).abs()
    return taps, (1 - distance).clamp(min=0)


def position_table_taps(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, weights)``, each ``[patches, 4]``: the learned position table's four entries
    around every patch (patches in merge-block order, frames repeated) and their bilinear weights."""
    counts = grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]
    heights = torch.repeat_interleave(grid_thw[:, 1], counts)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    starts = torch.repeat_interleave(F.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
    within = (torch.arange(counts.sum()) - starts) % (heights * widths)
    blocks_w = widths // merge
    row = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    col = ((within // (merge * merge)) % blocks_w) * merge + within % merge
    h_taps, h_weights = _bilinear_taps(row, heights, side)
    w_taps, w_weights = _bilinear_taps(col, widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's tower (module docstring)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.side = int(spec.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(spec, bias=True)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.rotary = AxialRotary(spec)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(spec) for _ in range(spec.depth)])
        self.merger = Qwen3PatchMerger(spec)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(spec, postshuffle=True) for _ in spec.deepstack_visual_indexes])

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        spec = self.spec
        grid_thw = grid_thw.to("cpu")
        indices, weights = position_table_taps(grid_thw, self.side, spec.spatial_merge_size)
        x = self.patch_embed(pixel_values)
        pos = (self.pos_embed(indices.to(x.device)) * weights.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(patch_positions(grid_thw, spec.spatial_merge_size).to(x.device))
        frames = frame_seqlens(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if i in spec.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[spec.deepstack_visual_indexes.index(i)](x))
        return TowerOutput(self.merger(x), tuple(deepstack))


#: the towers the family builds, by ``VisionSpec.kind``
TOWERS: dict[str, Callable[[VisionSpec], nn.Module]] = {"qwen2_5_vl": QwenVisionTower, "qwen3_vl": Qwen3VisionTower}


def build_tower(spec: VisionSpec) -> nn.Module:
    """The vision tower of ``spec.kind``."""
    if spec.kind not in TOWERS:
        raise ValueError(f"no vision tower of kind {spec.kind!r}; built: {', '.join(TOWERS)}")
    return TOWERS[spec.kind](spec)
