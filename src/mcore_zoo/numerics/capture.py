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

Every captured tensor is normalised to ``[batch, seq, hidden]`` (mcore's ``[s, b, h]`` is
transposed; a THD pack ``[t, 1, h]`` becomes ``[1, t, h]``) and detached to the CPU; runners cut it
into per-sequence ``[len_i, hidden]`` pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

SITE_ORDER_HINT = "embedding, layer.0 .. layer.N-1, final_norm"


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    raise TypeError(f"cannot find the hidden states in a module output of type {type(output).__name__}")


def _hf_decoder_layers(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    inner = getattr(model, "model", None)
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
    sites: OrderedDict[str, torch.nn.Module] = OrderedDict()
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None:
        sites["embedding"] = embed
    layers = _hf_decoder_layers(model)
    for i, layer in enumerate(layers or []):
        sites[f"layer.{i}"] = layer
    norm = getattr(getattr(model, "model", None), "norm", None)
    if isinstance(norm, torch.nn.Module):
        sites["final_norm"] = norm
    return sites


def mcore_sites(model: torch.nn.Module) -> "OrderedDict[str, torch.nn.Module]":
    """Capture sites of a Megatron-Core ``GPTModel`` (this pipeline stage's part of them)."""
    sites: OrderedDict[str, torch.nn.Module] = OrderedDict()
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
    """HF module output -> ``[b, s, h]``."""
    return _first_tensor(output)


def to_bsh_mcore(output: Any) -> torch.Tensor:
    """mcore module output ``[s, b, h]`` (THD: ``[t, 1, h]``) -> ``[b, s, h]``."""
    return _first_tensor(output).transpose(0, 1)


class HiddenCapture:
    """Context manager: record the output of every site on every forward call.

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
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self.records[name].append(self.normalise(output).detach().to("cpu", copy=True))

        return hook

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
