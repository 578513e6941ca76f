"""Test helpers for multi-token prediction: a checkpoint with an MTP layer in DeepSeek-V3's published
layout, and an independent torch reference of what that layer computes.

transformers builds no MTP layer (its DeepSeek-V3 ignores ``model.layers.61.*``), so the reference
is written here from DeepSeek-V3's definition, with transformers' own modules for the pieces:

    h_0 = the main model's output after its final norm (``model(ids).last_hidden_state``)
    x   = eh_proj(cat([enorm(Emb(t[i + 1])), hnorm(h_0[i])]))
    h_1 = DecoderLayer(x)                       (transformers' decoder-layer class, MTP weights)
    logits_1 = shared_head.head(shared_head.norm(h_1))    predicting t[i + 2]

The decoder layer is transformers' own class loaded through transformers' own checkpoint loading:
a second checkpoint whose last decoder layer holds the MTP layer's tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..conftest import checkpoint_tensors

MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _fresh(name: str, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor shaped like ``like``: norms around 1, the rest with its spread."""
    noise = torch.randn(like.shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * noise).to(like.dtype)
    spread = float(like.float().std()) if like.numel() > 1 else 0.1
    return (noise * (spread or 0.1)).to(like.dtype)


def write_mtp_checkpoint(source: Path, out: Path, *, seed: int = 0, copies: bool = True) -> Path:
    """``source`` (an HF checkpoint of ``L`` layers, untied) plus one MTP layer
    ``model.layers.{L}.*`` with random weights (its decoder-layer tensors shaped like layer
    ``L - 1``'s), ``num_nextn_predict_layers: 1``; ``copies``: with the layer's ``embed_tokens`` /
    ``shared_head.head`` copies of the embedding / ``lm_head``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = checkpoint_tensors(str(source))
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    dtype = tensors["model.norm.weight"].dtype
    for name in sorted(n for n in tensors if n.startswith(last)):
        tensors[mtp + name[len(last):]] = _fresh(name, tensors[name], gen)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[mtp + name] = _fresh(name, tensors["model.norm.weight"], gen)
    tensors[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5).to(dtype)
    if copies:
        tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json", "config.json")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1), indent=2))
    return out


def write_layer_swap_checkpoint(mtp_ckpt: Path, out: Path) -> Path:
    """The checkpoint's main model with its last decoder layer replaced by the MTP layer's decoder
    tensors and no MTP layer: transformers loads it, and its last layer module is then the MTP
    layer's decoder layer, in transformers' own class."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((mtp_ckpt / "config.json").read_text())
    layers = config["num_hidden_layers"]
    tensors = checkpoint_tensors(str(mtp_ckpt))
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    swapped = {k: v for k, v in tensors.items() if not k.startswith(mtp)}
    for name in [n for n in tensors if n.startswith(mtp)]:
        rest = name[len(mtp):]
        if rest in MTP_OWN or rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue
        swapped[last + rest] = tensors[name]
    save_file({k: v.contiguous() for k, v in swapped.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0), indent=2))
    return out


class MTPReference(torch.nn.Module):
    """DeepSeek-V3's MTP depth 1 over an HF model (module docstring): ``forward(ids [B, S])``
    -> ``[B, S, V]`` logits of token ``i + 2`` (the shifted-in token at the last position is 0,
    as Megatron-Core's roll leaves it)."""

    def __init__(self, hf: torch.nn.Module, swapped: torch.nn.Module, mtp_ckpt: Path) -> None:
        super().__init__()
        config = json.loads((mtp_ckpt / "config.json").read_text())
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        tensors = checkpoint_tensors(str(mtp_ckpt))
        prefix = f"model.layers.{layers}."
        norm_class, eps = type(hf.model.norm), config["rms_norm_eps"]
        self.hf = hf
        self.layer = swapped.model.layers[layers - 1]
        self.rotary = hf.model.rotary_emb
        self.enorm, self.hnorm, self.norm = (norm_class(hidden, eps=eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        head = tensors[prefix + "shared_head.head.weight"]
        self.head = torch.nn.Linear(hidden, head.shape[0], bias=False)
        with torch.no_grad():
            self.enorm.weight.copy_(tensors[prefix + "enorm.weight"])
            self.hnorm.weight.copy_(tensors[prefix + "hnorm.weight"])
            self.norm.weight.copy_(tensors[prefix + "shared_head.norm.weight"])
            self.eh_proj.weight.copy_(tensors[prefix + "eh_proj.weight"])
            self.head.weight.copy_(head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        model = self.hf.model
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        h0 = model(ids).last_hidden_state
        following = torch.roll(ids, -1, dims=1)
        following[:, -1] = 0
        x = self.eh_proj(torch.cat([self.enorm(model.embed_tokens(following)), self.hnorm(h0)], dim=-1))
        mask = create_causal_mask(config=self.hf.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)  # fmt: skip
        h1 = self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=mask, position_ids=positions)
        if isinstance(h1, tuple):
            h1 = h1[0]
        return self.head(self.norm(h1))
