"""Weight rules of gated DeltaNet layers and of the gated full attention (Qwen3-Next checkpoint layout).

Linear-attention layers (``layer_types`` ``linear_attention``), HF ``model.layers.{layer}.linear_attn.``
<-> Megatron-Core ``decoder.layers.{layer}.self_attention.`` (:class:`~.spec.PortableGatedDeltaNet`
keeps the checkpoint's layout, so at one rank every rule is one tensor unchanged). Under tensor
parallelism each rank holds its heads as the layer computes them: the head-interleaved fused
projections (``in_proj_qkvz``, ``in_proj_ba``: per key head its rows) and the per-head
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias`` split into contiguous row
chunks; the ``[q; k; v]`` channels of ``conv1d`` and ``in_proj_qkv`` split part by part
(:data:`QKV_CHANNELS`: each rank its q, its k, its v); ``out_proj`` by its input columns; the gated
norm's weight whole:

=====================  =====================  =========================================
HF                     Megatron-Core          shape
=====================  =====================  =========================================
``in_proj_qkvz``       ``in_proj_qkvz``       ``[2 * key_dim + 2 * value_dim, hidden]``
``in_proj_ba``         ``in_proj_ba``         ``[2 * value heads, hidden]``
``conv1d.weight``      ``conv1d.weight``      ``[2 * key_dim + value_dim, 1, width]``
``A_log``, ``dt_bias`` same                   ``[value heads]``
``norm.weight``        ``norm.weight``        ``[value_head_dim]`` (gated RMSNorm)
``out_proj``           ``out_proj``           ``[hidden, value_dim]``
=====================  =====================  =========================================

Qwen3.5's split layout (``projections="split"``) has ``in_proj_qkv`` ``[2 * key_dim + value_dim,
hidden]``, ``in_proj_z`` ``[value_dim, hidden]``, ``in_proj_b`` and ``in_proj_a`` ``[value heads,
hidden]`` in place of the two fused projections; the other tensors are the same.

Full-attention layers: ``q_proj`` holds per head ``[query (head_dim); gate (head_dim)]``; Megatron-Core's
``linear_qkv`` with ``attention_output_gate`` holds per query group ``[its queries; their gates;
key; value]`` (:data:`GATED_QKV`); ``o_proj``, ``q_norm`` / ``k_norm`` as in the dense table. The
rules of each kind carry ``layer_kind`` ``linear_attention`` / ``full_attention``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.weights.dense import HF_LAYER, LAYER, attention_rules
from mcore_zoo.weights.rules import (
    Rule, Transform, TransformContext, WeightMap, column_parallel, replicated, row_parallel, split_rows,
)  # fmt: skip

#: the input projections of each layout (:attr:`~mcore_zoo.config.arch.GatedDeltaNetSpec.projections`)
PROJECTION_TENSORS = {
    "fused": ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    "split": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
}
#: the tensors every layout shares
SHARED_TENSORS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def linear_tensors(projections: str) -> tuple:
    """The linear-attention layer's tensor names (the same on both sides) for a projection layout."""
    return PROJECTION_TENSORS[projections] + SHARED_TENSORS


class FuseGatedQKV(Transform):
    """HF ``q_proj`` (per head ``[query; gate]``), ``k_proj``, ``v_proj`` <-> Megatron-Core's gated
    ``linear_qkv``: per query group its ``heads_per_group`` queries, their gates, its key, its value.
    Works on a tensor-parallel chunk of whole query groups."""

    name = "gated-qkv-interleave"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        q, k, v = pieces
        hd, per_group = ctx.arch.head_dim, ctx.arch.heads_per_group
        groups = k.shape[0] // hd
        rest = q.shape[1:]
        q = q.reshape(groups, per_group, 2, hd, *rest)
        query = q[:, :, 0].reshape(groups, per_group * hd, *rest)
        gate = q[:, :, 1].reshape(groups, per_group * hd, *rest)
        return torch.cat([query, gate, k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)], dim=1).reshape(-1, *rest)

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        hd, per_group = ctx.arch.head_dim, ctx.arch.heads_per_group
        rows = per_group * hd
        rest = tensor.shape[1:]
        t = tensor.reshape(-1, 2 * rows + 2 * hd, *rest)
        groups = t.shape[0]
        query = t[:, :rows].reshape(groups, per_group, 1, hd, *rest)
        gate = t[:, rows:2 * rows].reshape(groups, per_group, 1, hd, *rest)
        q = torch.cat([query, gate], dim=2).reshape(-1, *rest)
        return [q, t[:, 2 * rows:2 * rows + hd].reshape(-1, *rest), t[:, 2 * rows + hd:].reshape(-1, *rest)]


GATED_QKV = FuseGatedQKV()


def gated_attention_rules(arch: ArchConfig) -> list[Rule]:
    """The full-attention layers' rules: the dense table's attention rules in those layers only, the
    q rows laid out by :data:`GATED_QKV` when the attention gates its output."""
    if not arch.attention_output_gate:
        return attention_rules(arch, layer_kind="full_attention")
    return attention_rules(arch, layer_kind="full_attention", qkv_transform=GATED_QKV,
                           qkv_note="q_proj rows per head [query; gate] -> per group [queries; gates; key; value]")  # fmt: skip


class QKVChannels(Transform):
    """The ``[q; k; v]`` channels of the convolution (and of Qwen3.5's ``in_proj_qkv``) from their
    three parts; on a tensor-parallel chunk, this rank's q, k and v heads in that order. The part
    sizes follow the tensor's rows (``key_dim : key_dim : value_dim``), whole or a chunk."""

    name = "qkv-channels"

    def fuse(self, pieces: Sequence[torch.Tensor], ctx: TransformContext) -> torch.Tensor:
        return torch.cat(list(pieces), dim=0)

    def split(self, tensor: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        spec = ctx.arch.gated_deltanet
        key = tensor.shape[0] * spec.key_dim // spec.conv_dim
        return list(torch.split(tensor, [key, key, tensor.shape[0] - 2 * key], dim=0))

    def views(self, out: torch.Tensor, ctx: TransformContext) -> list[torch.Tensor]:
        return self.split(out, ctx)


QKV_CHANNELS = QKVChannels()
#: tensors split into contiguous row chunks (whole heads per rank), and the row-parallel one
ROW_CHUNKED = ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_z.weight", "in_proj_b.weight",
               "in_proj_a.weight", "A_log", "dt_bias")  # fmt: skip
QKV_CHANNEL_TENSORS = ("conv1d.weight", "in_proj_qkv.weight")


def gated_deltanet_rules(arch: ArchConfig) -> list[Rule]:
    """The linear-attention layers' rules (module docstring), split by head over tensor-parallel ranks."""
    spec, kind = arch.gated_deltanet, "linear_attention"
    rules = []
    for name in linear_tensors(spec.projections):
        mcore, hf = LAYER + "self_attention." + name, HF_LAYER + "linear_attn." + name
        if name in QKV_CHANNEL_TENSORS:
            parts = split_rows(hf, [spec.key_dim, spec.key_dim, spec.value_dim], tp_axis=0)
            rules.append(Rule(mcore, parts, QKV_CHANNELS, layer_kind=kind, note="[q; k; v] channels, split part by part"))
        elif name in ROW_CHUNKED:
            rules.append(column_parallel(mcore, hf, layer_kind=kind))
        elif name == "out_proj.weight":
            rules.append(row_parallel(mcore, hf, layer_kind=kind))
        else:
            rules.append(replicated(mcore, hf, layer_kind=kind))
    return rules


def hybrid_attention_rules(arch: ArchConfig) -> list[Rule]:
    """The token mixers' rules of a model with gated DeltaNet layers: linear and full attention."""
    return gated_deltanet_rules(arch) + gated_attention_rules(arch)


def gated_deltanet_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen3-Next's and Qwen3.5's table: embedding, head, per layer the norms, the token mixer of its kind
    (:func:`hybrid_attention_rules`) and the dense MLP or the MoE block (Qwen-MoE naming, sigmoid-gated
    shared expert); a dropped MTP layer's ``mtp.*`` tensors ignored."""
    from mcore_zoo.families.moe.weights import routed_expert_rules, shared_expert_rules
    from mcore_zoo.weights.dense import decoder_weight_map, gated_mlp_rules

    from .config import dropped_mtp_ignored

    if arch.moe is None:
        mlp = gated_mlp_rules(arch)
    else:
        mlp = gated_mlp_rules(arch, layer_kind="dense") + routed_expert_rules(arch) + shared_expert_rules(arch)
    return decoder_weight_map(arch, mlp, attention=hybrid_attention_rules(arch), ignored=dropped_mtp_ignored(arch))


def language_model_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen3.5's vision-language checkpoints (``*ForConditionalGeneration``): the table of
    :func:`gated_deltanet_weight_map` under ``model.language_model.``, the vision tower's tensors
    ignored by name (:func:`mcore_zoo.weights.language_model.language_model_weight_map`)."""
    from mcore_zoo.weights.language_model import language_model_weight_map as under_language_model

    return under_language_model(gated_deltanet_weight_map(arch))


def vision_language_weight_map(arch: ArchConfig) -> WeightMap:
    """Qwen3.5's vision-language checkpoints with the vision tower built (``arch.vision``): the
    table of :func:`gated_deltanet_weight_map` under ``model.language_model.``, the tower's tensors
    under ``model.visual.`` (:func:`mcore_zoo.families.vision_language.weights.vision_language_weight_map`)."""
    from mcore_zoo.families.vision_language.weights import vision_language_weight_map as with_tower

    return with_tower(gated_deltanet_weight_map(arch))
