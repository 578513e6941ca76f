"""Multi-token prediction (MTP): Megatron-Core's ``MultiTokenPredictionBlock`` with the zoo's layers,
and the ``GPTModel`` whose output carries the MTP logits.

What one MTP depth ``k`` (``1 <= k <= D``) computes at position ``i`` (Megatron-Core's
``MultiTokenPredictionLayer``, which is DeepSeek-V3's definition):

    h_k[i] = Layer_k(eh_proj_k([enorm_k(Emb(t[i + k])); hnorm_k(h_{k-1}[i])]))
    logits_k[i] = head(final_layernorm_k(h_k[i]))     predicting t[i + k + 1]

with ``h_0`` the main model's output after its final norm, ``Emb`` the model's embedding and
``head`` its output layer (both shared with the main model; on a pipeline's last stage
Megatron-Core keeps a copy of the embedding, tied to the first stage's). The concatenation puts the
embedding first, as DeepSeek's checkpoints do, so ``eh_proj`` loads unchanged. ``Layer_k`` is the
architecture's own decoder layer (MLA / MoE for DeepSeek-V3, the MoE layer for GLM-4.5), built
from :func:`~mcore_zoo.specs.gpt.gpt_layer_spec`; the norms are the profile's final-norm class.

Output contract of a model built with MTP (:func:`mtp_gpt_model_class`): without ``labels`` its
forward returns ``[b, (1 + D) * s, V / tp]``: the main logits (bit for bit those of the same model
built without MTP), then depth 1's, ..., depth D's, each ``s`` positions long (the MTP logits at
position ``i`` of depth ``k`` predict token ``i + k + 1``); :func:`split_mtp_output` separates them.
With ``labels`` (Megatron's own training loop) the forward is Megatron-Core's: the main loss, the
MTP loss added through ``MTPLossAutoScaler``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.errors import ZooError
from mcore_zoo.numerics.profiles import NumericsProfile


def _inner_layer_field() -> str:
    """The name of the MTP layer's decoder-layer submodule: ``transformer_layer`` (Megatron-Core
    0.16) or ``mtp_model_layer`` (0.19); the weight map uses the former and resolves the latter
    (:func:`mcore_zoo.weights.rules.resolve_mcore_name`)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    names = {f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)}
    return "mtp_model_layer" if "mtp_model_layer" in names else "transformer_layer"


def mtp_block_spec(arch: ArchConfig, backend: str, numerics: NumericsProfile) -> Any:
    """The ``MultiTokenPredictionBlock`` spec of ``arch`` (``arch.mtp_num_layers`` depths), built on
    the last pipeline stage only (the caller passes it where ``post_process`` holds)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_zoo.specs.gpt import _pieces, gpt_layer_spec

    if not arch.mtp_num_layers:
        raise ZooError(f"{arch.architecture}: no multi-token-prediction layers to build")
    norm = _pieces(arch, backend, numerics)["final_norm"]
    if backend == "te" and numerics.pack_gemms != "each":  # (pack_gemms="each": the zoo's linears, specs/gpt.py)
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column
    else:
        column = ColumnParallelLinear
    layer = gpt_layer_spec(arch, backend, numerics, moe=arch.mtp_layer_moe)
    submodules = MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=column, layer_norm=norm, **{_inner_layer_field(): layer}
    )
    depth = ModuleSpec(module=MultiTokenPredictionLayer, submodules=submodules)
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[depth] * arch.mtp_num_layers),
    )


def split_mtp_output(output: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``[b, (1 + D) * s, ...]`` -> (main ``[b, s, ...]``, ``[depth 1, ..., depth D]``); a model
    without MTP (``depths == 0``): ``(output, [])``."""
    if not depths:
        return output, []
    if output.shape[1] % (1 + depths):
        raise ZooError(f"an MTP model's output has {output.shape[1]} positions, not a multiple of 1 + {depths}")
    parts = torch.chunk(output, 1 + depths, dim=1)
    return parts[0], list(parts[1:])


def slot_bounds(params: Any) -> Any:
    """``PackedSeqParams`` whose sequence bounds are the padded slots (``cu_seqlens_*_padded``), for
    the MTP block: Megatron-Core shifts the MTP inputs within ``cu_seqlens_q``, while a pack padded
    for sequence parallelism lays its sequences out by the padded bounds. Within a slot the real
    tokens come first and attention is causal, so the real positions see what they see with the
    real bounds; the padding positions predict nothing. Unpadded packs are returned unchanged."""
    padded = getattr(params, "cu_seqlens_q_padded", None)
    if padded is None or torch.equal(padded, params.cu_seqlens_q):
        return params
    longest = int((padded[1:] - padded[:-1]).max())
    return dataclasses.replace(params, cu_seqlens_q=padded, cu_seqlens_kv=params.cu_seqlens_kv_padded,
                               max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


#: ``_postprocess`` keywords handed on to the MTP block (those its ``forward`` accepts)
_MTP_INPUTS = ("input_ids", "position_ids", "attention_mask", "padding_mask", "rotary_pos_emb", "rotary_pos_cos",
               "rotary_pos_sin", "packed_seq_params", "sequence_len_offset")  # fmt: skip


@functools.lru_cache(maxsize=None)
def mtp_gpt_model_class() -> type:
    """``GPTModel`` whose label-free forward returns the main and the MTP logits (module docstring)."""
    from megatron.core.models.gpt import GPTModel

    class MTPGPTModel(GPTModel):
        """A ``GPTModel`` with Megatron-Core's MTP block whose label-free forward returns
        ``[b, (1 + D) * s, V / tp]`` logits: main, then each depth."""

        def _postprocess(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
            if kwargs.get("labels") is not None or kwargs.get("inference_context") is not None:
                return super()._postprocess(hidden_states=hidden_states, **kwargs)
            if kwargs.get("mtp_in_postprocess"):
                accepted = inspect.signature(self.mtp.forward).parameters
                inputs = {k: kwargs.get(k) for k in _MTP_INPUTS if k in accepted}
                inputs["packed_seq_params"] = slot_bounds(inputs.get("packed_seq_params"))
                hidden_states = self.mtp(hidden_states=hidden_states, embedding=self.embedding, **inputs,
                                         **(kwargs.get("extra_block_kwargs") or {}))  # fmt: skip
            if not self.post_process:
                return hidden_states
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            gather = kwargs.get("runtime_gather_output")
            parts = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)
            logits = [self.output_layer(part, weight=weight, runtime_gather_output=gather)[0] for part in parts]
            return torch.cat(logits, dim=0).transpose(0, 1).contiguous()

    return MTPGPTModel

