"""Weight tables of MoE decoders: HF per-expert tensors <-> Megatron-Core's experts.

mcore names (``SequentialMLP``, the ``local`` / ``portable`` backends and TE's sequential experts;
the canonical names of the table):

* ``mlp.router.weight`` (and the ``expert_bias`` buffer of sigmoid routers, which is not a
  parameter: see :func:`expert_bias_rules`) <- HF ``mlp.gate.weight``;
* ``mlp.experts.local_experts.{expert}.linear_fc1.weight`` <- ``[gate; up]`` of HF expert ``{expert}``
  (the ``GATE_UP`` transform, split per half across expert-TP ranks);
* ``mlp.experts.local_experts.{expert}.linear_fc2.weight`` <- HF ``down`` of the expert;
* ``mlp.shared_experts.linear_fc1/2.weight`` (+ ``gate_weight``) <- HF shared expert (+ its gate).

``{expert}`` is local on the mcore side (``local_experts.{i}`` of this expert-parallel rank) and
global on the HF side; :meth:`WeightMap.bind` maps them with the rank's expert offset, so an EP rank
reads only its own experts' tensors. Expert rules are sharded over expert-TP, not dense TP.

Grouped experts (numerics knob ``grouped_experts``, Megatron-Core's ``TEGroupedMLP``: one Transformer
Engine ``GroupedLinear`` per projection) hold local expert ``i`` as ``mlp.experts.linear_fc1.weight{i}``
``[2 * I / etp, H]`` (this expert-TP rank's rows of gate, then of up: the sequential layout) and
``mlp.experts.linear_fc2.weight{i}`` ``[H, I / etp]`` (``bias{i}`` likewise where the model has
biases). The same rules serve them: :meth:`WeightMap.bind` resolves each sequential name to its
grouped one (:func:`~mcore_zoo.weights.rules.grouped_expert_name`) when the model has that, so
loading, the EP / expert-TP sharding, export and the rollout paths are the sequential ones.

Plugins build their tables from these pieces (through :mod:`mcore_zoo.plugin_api`): Qwen's naming
is :func:`moe_decoder_weight_map`; another naming is one call of :func:`routed_expert_rules` with its
names (Mixtral: ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``); DeepSeek's layout (GLM-4.5
too) is :func:`deepseek_moe_rules`.

HF checkpoints store experts per expert (``experts.{e}.gate_proj.weight``: what published
checkpoints and transformers 5's ``save_pretrained`` write; transformers 5 fuses them into 3-D
``gate_up_proj`` / ``down_proj`` parameters only in memory) - except gpt-oss, whose checkpoints hold
every expert of a layer in one stacked tensor (``mlp.experts.gate_up_proj [E, H, 2I]``, gate and up
in alternating columns; ``down_proj [E, I, H]``; their biases ``[E, 2I]`` / ``[E, H]``):
:func:`stacked_expert_rules` reads expert ``e``'s slice of each (``Source.expert_axis``), so an EP
rank still reads only its own experts, and export stacks the slices back. Qwen3-VL-MoE's checkpoints
stack them too, without biases and with gate and up in contiguous halves
(:func:`stacked_transposed_expert_rules`).
"""

from __future__ import annotations

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.weights.dense import HF_LAYER, LAYER, decoder_weight_map, gated_mlp_rules
from mcore_zoo.weights.rules import (
    GATE_UP, STACKED_EXPERT, STACKED_EXPERT_T, STACKED_GATE_UP, STACKED_GATE_UP_HALVES, Rule, Source, WeightMap,
    replicated, rule,
)  # fmt: skip

EXPERT = LAYER + "mlp.experts.local_experts.{expert}."


def routed_expert_rules(arch: ArchConfig, *, hf_moe: str = "mlp.", gate: str = "gate_proj", up: str = "up_proj",
                        down: str = "down_proj", router: str = "gate") -> list[Rule]:  # fmt: skip
    """Router + per-expert gated MLPs (HF ``{hf_moe}experts.{e}.{gate,up,down}.weight``)."""
    m = HF_LAYER + hf_moe
    e = m + "experts.{expert}."
    return [
        rule(LAYER + "mlp.router.weight", m + router + ".weight", layer_kind="moe"),
        rule(EXPERT + "linear_fc1.weight", [e + gate + ".weight", e + up + ".weight"], tp_axis=0, transform=GATE_UP),
        rule(EXPERT + "linear_fc2.weight", e + down + ".weight", tp_axis=1),
    ]


def shared_expert_rules(arch: ArchConfig, *, hf_shared: str = "mlp.shared_expert.",
                        hf_gate: str = "mlp.shared_expert_gate.weight") -> list[Rule]:  # fmt: skip
    """The always-on shared expert (Qwen2-MoE ``shared_expert`` + ``shared_expert_gate``, GLM-4.5 /
    DeepSeek ``shared_experts``) -> mcore ``SharedExpertMLP`` (dense tensor parallelism)."""
    moe = arch.moe
    if moe is None or moe.shared_expert_ffn_hidden_size is None:
        return []
    s = HF_LAYER + hf_shared
    rules = [
        rule(LAYER + "mlp.shared_experts.linear_fc1.weight", [s + "gate_proj.weight", s + "up_proj.weight"],
             tp_axis=0, transform=GATE_UP, layer_kind="moe"),  # fmt: skip
        rule(LAYER + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight", tp_axis=1, layer_kind="moe"),
    ]
    if moe.shared_expert_gate:
        rules.append(rule(LAYER + "mlp.shared_experts.gate_weight", HF_LAYER + hf_gate, layer_kind="moe"))
    return rules


def moe_decoder_weight_map(arch: ArchConfig) -> WeightMap:
    """Embedding, attention, norms, dense MLPs on dense layers, router + experts (+ shared expert)
    on MoE layers (Qwen3-MoE / Qwen2-MoE naming)."""
    mlp = gated_mlp_rules(arch, layer_kind="dense") + routed_expert_rules(arch) + shared_expert_rules(arch)
    return decoder_weight_map(arch, mlp)


def router_expert_bias_rule() -> Rule:
    """HF ``mlp.gate.e_score_correction_bias`` -> the router's ``expert_bias`` buffer (GLM-4.5,
    DeepSeek-V3)."""
    return rule(LAYER + "mlp.router.expert_bias", HF_LAYER + "mlp.gate.e_score_correction_bias", layer_kind="moe",
                note="buffer: added to the sigmoid scores to choose experts, not to weight them")


def deepseek_moe_rules(arch: ArchConfig) -> list[Rule]:
    """The MLP rules of a DeepSeek-style MoE decoder (DeepSeek-V2 / V3, GLM-4.5): dense MLPs on the
    dense layers; router (+ ``e_score_correction_bias`` when the router has an expert bias), routed
    experts and the shared experts (``mlp.shared_experts.*``, no gate) on the MoE layers. A dense
    model (``arch.moe`` ``None``) gets the plain gated MLP."""
    if arch.moe is None:
        return gated_mlp_rules(arch)
    rules = gated_mlp_rules(arch, layer_kind="dense") + routed_expert_rules(arch)
    if arch.moe.router_expert_bias:
        rules.append(router_expert_bias_rule())
    return rules + shared_expert_rules(arch, hf_shared="mlp.shared_experts.")


def stacked_expert_rules(arch: ArchConfig, *, hf_moe: str = "mlp.", router: str = "router") -> list[Rule]:
    """Router (weight and bias) and experts whose HF tensors stack every expert of a layer, gate and
    up in alternating columns of ``x @ w`` weights, with biases (gpt-oss): ``{hf_moe}experts.gate_up_proj
    [E, H, 2I]`` / ``gate_up_proj_bias [E, 2I]`` -> ``linear_fc1.weight`` / ``.bias`` (expert-TP
    splits the columns), ``down_proj [E, I, H]`` -> ``linear_fc2.weight`` (split by its rows),
    ``down_proj_bias [E, H]`` -> ``linear_fc2.bias`` (replicated), ``{router}.weight`` / ``.bias``."""
    m = HF_LAYER + hf_moe
    x = m + "experts."
    return [
        replicated(LAYER + "mlp.router.weight", m + router + ".weight", layer_kind="moe"),
        replicated(LAYER + "mlp.router.bias", m + router + ".bias", layer_kind="moe"),
        Rule(EXPERT + "linear_fc1.weight", (Source(x + "gate_up_proj", 2, expert_axis=0),), STACKED_GATE_UP),
        Rule(EXPERT + "linear_fc1.bias", (Source(x + "gate_up_proj_bias", 1, expert_axis=0),), STACKED_GATE_UP),
        Rule(EXPERT + "linear_fc2.weight", (Source(x + "down_proj", 1, expert_axis=0),), STACKED_EXPERT_T),
        Rule(EXPERT + "linear_fc2.bias", (Source(x + "down_proj_bias", None, expert_axis=0),), STACKED_EXPERT),
    ]


def stacked_transposed_expert_rules(arch: ArchConfig, *, hf_moe: str = "mlp.", router: str = "gate") -> list[Rule]:
    """Router and experts whose HF tensors stack every expert of a layer as ``x @ w`` reads them,
    gate and up in contiguous halves, no biases (Qwen3-VL-MoE's checkpoints):
    ``{hf_moe}experts.gate_up_proj [E, H, 2I]`` (gate columns, then up columns) -> the expert's
    ``linear_fc1.weight [2I, H]`` (its transpose: gate rows, then up rows), ``down_proj [E, I, H]``
    -> ``linear_fc2.weight [H, I]`` (split by its rows over expert TP), ``{router}.weight``. The
    gate / up halves are not split over expert tensor parallelism yet (refused by name)."""
    m = HF_LAYER + hf_moe
    x = m + "experts."
    return [
        rule(LAYER + "mlp.router.weight", m + router + ".weight", layer_kind="moe"),
        Rule(EXPERT + "linear_fc1.weight", (Source(x + "gate_up_proj", 2, expert_axis=0),), STACKED_GATE_UP_HALVES,
             layer_kind="moe"),  # fmt: skip
        Rule(EXPERT + "linear_fc2.weight", (Source(x + "down_proj", 1, expert_axis=0),), STACKED_EXPERT_T,
             layer_kind="moe"),  # fmt: skip
    ]


def sink_rule(*, hf_attn: str = "self_attn.") -> Rule:
    """Attention sinks (a learned logit per head, gpt-oss ``self_attn.sinks [heads]``) ->
    ``core_attention.softmax_offset`` (split over tensor parallelism with the heads)."""
    return rule(LAYER + "self_attention.core_attention.softmax_offset", HF_LAYER + hf_attn + "sinks", tp_axis=0)


def gpt_oss_weight_map(arch: ArchConfig) -> WeightMap:
    """gpt-oss: attention with q/k/v/o biases and sinks, every layer's MLP the stacked-experts MoE
    with router bias (:func:`stacked_expert_rules`)."""
    from mcore_zoo.weights.dense import attention_rules

    return decoder_weight_map(arch, stacked_expert_rules(arch), attention=[*attention_rules(arch), sink_rule()])
