"""Capture hidden states with forward hooks, paired between an HF model and a zoo-built mcore model.

Capture sites, named the same on both sides so that they pair automatically:

===============  =====================================  ==========================================
site             HF (``LlamaForCausalLM``-like)          Megatron-Core ``GPTModel``
===============  =====================================  ==========================================
``embedding``    ``get_input_embeddings()``              ``embedding``
``layer.<i>``    ``model.layers[i]``                     ``decoder.layers[k]`` with global index
                                                         ``layer_number - 1 == i``
``final_norm``   ``model.norm``                          ``decoder.final_layernorm``
===============  =====================================  ==========================================

A vision-language model adds its vision tower's sites before the decoder's (transformers' tower is
``model.visual`` or ``model.model.visual``, the zoo's ``vision_model``; the module names are the same):

========================  ========================================================================
``vision.block.<i>``      ``blocks[i]``: the tower's block outputs (patch rows)
``vision.deepstack.<k>``  ``deepstack_merger_list[k]``: Qwen3-VL's deepstack merger of level ``k``
``vision.merger``         ``merger``: the merged features
========================  ========================================================================

The tower runs once per sequence that has images, on both sides, so a tower site holds one record
per such sequence (its patches or merged tokens, in the tower's own row order), not one per sequence.

Every captured tensor is normalised to ``[batch, seq, hidden]`` (mcore's ``[s, b, h]`` is
transposed; a THD pack ``[t, 1, h]`` becomes ``[1, t, h]``; a tower's ``[rows, width]`` becomes
``[1, rows, width]``) and detached to the CPU; runners cut it into per-sequence ``[len_i, hidden]``
pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

SITE_ORDER_HINT = "vision.block.0 .. vision.merger (vision-language), embedding, layer.0 .. layer.N-1, final_norm"
#: the prefix of a vision tower's sites (their records are per tower call, not per sequence)
VISION_SITE_PREFIX = "vision."


def is_vision_site(site: str) -> bool:
    """Whether ``site`` is a vision tower's (one record per tower call; see module docstring)."""
    return site.startswith(VISION_SITE_PREFIX)


def vision_tower_sites(tower: Optional[torch.nn.Module]) -> "OrderedDict[str, torch.nn.Module]":
    """The sites of a vision tower with transformers' module names (``blocks``, optional
    ``deepstack_merger_list``, ``merger``), in that order; empty for ``None``."""
    sites: OrderedDict[str, torch.nn.Module] = OrderedDict()
    if tower is None:
        return sites
    for i, block in enumerate(getattr(tower, "blocks", None) or []):
        sites[f"{VISION_SITE_PREFIX}block.{i}"] = block
    for k, merger in enumerate(getattr(tower, "deepstack_merger_list", None) or []):
        sites[f"{VISION_SITE_PREFIX}deepstack.{k}"] = merger
    merger = getattr(tower, "merger", None)
    if isinstance(merger, torch.nn.Module):
        sites[f"{VISION_SITE_PREFIX}merger"] = merger
    return sites


def _hf_vision_tower(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    for owner in (model, getattr(model, "model", None)):
        tower = getattr(owner, "visual", None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    raise TypeError(f"cannot find the hidden states in a module output of type {type(output).__name__}")


def _hf_decoder(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module holding the decoder layers: ``model.model``, or a vision-language model's
    ``model.model.language_model``."""
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None)
    return language_model if isinstance(language_model, torch.nn.Module) else inner


def _hf_decoder_layers(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    inner = _hf_decoder(model)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for _, module in model.named_modules():  # fall back: the ModuleList with one entry per layer
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    return None


def hf_sites(model: torch.nn.Module) -> "OrderedDict[str, torch.nn.Module]":
    """Capture sites of an HF causal LM (see module docstring)."""
    sites = vision_tower_sites(_hf_vision_tower(model))
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None:
        sites["embedding"] = embed
    layers = _hf_decoder_layers(model)
    for i, layer in enumerate(layers or []):
        sites[f"layer.{i}"] = layer
    norm = getattr(_hf_decoder(model), "norm", None)
    if isinstance(norm, torch.nn.Module):
        sites["final_norm"] = norm
    return sites


def mcore_sites(model: torch.nn.Module) -> "OrderedDict[str, torch.nn.Module]":
    """Capture sites of a Megatron-Core ``GPTModel`` (this pipeline stage's part of them)."""
    sites = vision_tower_sites(getattr(model, "vision_model", None))
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        sites["embedding"] = embedding
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        sites[f"layer.{layer.layer_number - 1}"] = layer
    norm = getattr(decoder, "final_layernorm", None)
    if isinstance(norm, torch.nn.Module):
        sites["final_norm"] = norm
    return sites


def to_bsh_hf(output: Any) -> torch.Tensor:
    """HF module output -> ``[b, s, h]`` (a tower's ``[rows, width]``: one batch)."""
    tensor = _first_tensor(output)
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor


def to_bsh_mcore(output: Any) -> torch.Tensor:
    """mcore module output ``[s, b, h]`` (THD: ``[t, 1, h]``) -> ``[b, s, h]`` (a tower's
    ``[rows, width]``: one batch)."""
    tensor = _first_tensor(output)
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.transpose(0, 1)


class HiddenCapture:
    """Context manager: record the output of every site on every forward call.

    A record is the site module's own output: the capture hook runs before the model's own forward
    hooks on that module (Qwen3-VL's deepstack features are added to a decoder layer's output by
    such a hook, after the layer, as transformers adds them in its layer loop).

    ``records[site]`` is a list with one ``[b, s, h]`` CPU tensor per call (runners that call the
    model once per sequence get one entry per sequence).
    """

    def __init__(self, sites: "OrderedDict[str, torch.nn.Module]", normalise: Callable[[Any], torch.Tensor]) -> None:
        self.sites = sites
        self.normalise = normalise
        self.records: "OrderedDict[str, list[torch.Tensor]]" = OrderedDict((name, []) for name in sites)
        self._handles: list[Any] = []

    def __enter__(self) -> "HiddenCapture":
        for name, module in self.sites.items():
            self._handles.append(module.register_forward_hook(self._hook(name), prepend=True))
        return self

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self.records[name].append(self.normalise(output).detach().to("cpu", copy=True))

        return hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
