"""How an inference engine names, fuses and shards HF tensors: an :class:`EngineFormat`.

An engine rarely keeps the checkpoint's tensors as they are. vLLM fuses ``q_proj`` / ``k_proj`` /
``v_proj`` into one ``qkv_proj`` parameter (each tensor-parallel rank holds ``[q_r; k_r; v_r]``),
``gate_proj`` / ``up_proj`` into ``gate_up_proj`` (``[gate_r; up_r]``), stacks the routed experts of
a layer into ``w13_weight`` ``[E, 2 * I / tp, H]`` (gate then up) and ``w2_weight``
``[E, H, I / tp]``, and pads the vocabulary of the embedding and the output layer to a multiple of
64 rows before splitting it (padding rows are zero).

An engine format says only that - the engine's *fusion map*. Everything per architecture (which HF tensors
exist, their shapes, which axis each is split along) comes from the zoo's weight rules, so a new
architecture needs no new table here. :func:`mcore_zoo.rollout.plan_refit` combines the two.

Two layouts ship:

* :data:`VLLM` - vLLM 0.26's own parameter names and shard order (``hf_to_vllm_mapper`` /
  ``orig_to_new_stacked`` of ``llama.py``, ``qwen2.py``, ``qwen3_moe.py``, ``qwen2_moe.py``,
  ``mixtral.py``, ``glm4_moe.py``, ``qwen3_next.py``, ``qwen3_5.py`` (the gated DeltaNet's split
  projections stacked as ``in_proj_qkvz`` / ``in_proj_ba``), the ``orig_to_new_prefix`` of
  ``qwen3_vl.py`` and ``qwen2_5_vl.py`` (a vision-language checkpoint's language model and vision
  tower; the tower is replicated over tensor parallelism, as vLLM keeps it with
  ``mm_encoder_tp_mode="data"``), and ``stacked_params_mapping``
  of ``deepseek_v2.py`` for MLA's ``fused_qkv_a_proj`` and the DSA indexer's ``wk_weights_proj``
  (DeepSeek-V3.2, GLM-5); ``RoutedExperts.build_expert_params_mapping`` and ``_load_w13`` for the
  experts; ``DEFAULT_VOCAB_PADDING_SIZE`` of ``vocab_parallel_embedding.py``), and ``gpt_oss.py``
  (``hf_to_vllm_mapper`` and ``_load_weights_other``, bf16 weights) for experts whose HF tensors
  stack every expert of a layer (:class:`StackedExpertLayout`).
* :data:`HF_NAMES` - HF names, whole tensors, no fusion: for engines that fuse and split on their
  side (SGLang's ``update_weights_from_tensor``, vLLM's own ``load_weights``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Container, Iterable, Optional, Union


@dataclass(frozen=True)
class Fusion:
    """HF tensors whose name ends in ``hf_suffix`` become part ``shard`` of the engine tensor named
    with ``engine_suffix`` instead (vLLM's ``orig_to_new_stacked``: ``".q_proj": (".qkv_proj", "q")``).

    ``order`` lists the shard ids of the engine tensor in the order they sit along its first axis
    on every tensor-parallel rank (``("q", "k", "v")``, ``(0, 1)``).

    ``requires``: the fusion applies only where the module also has this HF sibling (same stem,
    this suffix instead). vLLM's DeepSeek attention fuses ``kv_a_proj_with_mqa`` into
    ``fused_qkv_a_proj`` only next to a ``q_a_proj`` (``q_lora_rank`` set), and keeps MLA's
    ``q_proj`` unfused (no ``k_proj`` beside it).
    """

    hf_suffix: str
    engine_suffix: str
    shard: Union[str, int]
    order: tuple[Union[str, int], ...]
    requires: str = ""


@dataclass(frozen=True)
class ExpertFusion:
    """Routed experts stacked per layer: the HF tensor ``{prefix}experts.{e}.{proj}.weight``
    becomes row-block ``shard`` of ``engine[e]`` where ``engine`` is
    ``{prefix}experts.{engine_param}`` (vLLM: ``w13_weight`` for gate (``w1``) and up (``w3``),
    ``w2_weight`` for down (``w2``))."""

    projections: tuple[tuple[str, str, str], ...]  # (HF role, engine parameter, shard id)
    order: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (engine parameter, shard ids in row order)


@dataclass(frozen=True)
class StackedExpertLayout:
    """How the engine stores routed experts whose HF tensors already stack every expert of a layer
    (gpt-oss: ``mlp.experts.gate_up_proj [E, H, 2I]`` with gate and up in alternating columns,
    ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``).

    ``params``: HF tensor leaf -> engine parameter (``("gate_up_proj", "w13_weight")``), named
    ``{prefix}experts.{EngineFormat.experts_prefix}{param}``. Each expert's slice is split over
    tensor parallelism along the axis the zoo's rule splits it (a contiguous run of the interleaved
    gate / up columns - gate and up stay interleaved -, the down projection's rows) and a 2-D slice
    is transposed (the HF tensor holds ``x @ w``'s ``[in, out]``, the engine ``[out, in]``):
    ``w13_weight [E, 2I / tp, H]``, ``w13_bias [E, 2I / tp]``, ``w2_weight [E, H, I / tp]``.
    ``unsplit_on_first_rank``: a stacked tensor the rule does not split (the down bias, added once
    after the experts' outputs are summed over tensor parallelism) is whole on engine rank 0 and
    zeros on the others (vLLM's ``w2_bias``)."""

    params: tuple[tuple[str, str], ...]
    unsplit_on_first_rank: bool = True


@dataclass(frozen=True)
class EngineFormat:
    """An inference engine's naming, fusion and sharding of HF tensors (see module docstring).

    Attributes:
        name: shown in plans and errors.
        fusions: dense fusions (``q/k/v -> qkv_proj``, ``gate/up -> gate_up_proj``).
        experts: how routed experts are stacked (``None``: per-expert HF tensors are kept).
        experts_prefix: what the engine inserts between ``experts.`` and the stacked parameter name
            (vLLM 0.26: ``routed_experts.``).
        vocab_padding: the engine pads the vocabulary (embedding, output layer) to a multiple of
            this many rows before splitting it over tensor parallelism (``0``: no padding).
        presplit: the engine wants each tensor-parallel rank's shard (``True``) or whole tensors
            that it splits itself (``False``).
        replicated: HF module suffixes (``".q_a_proj"``) the engine keeps whole on every
            tensor-parallel rank even where the trainer splits them (vLLM's MLA down-projections
            are ``ReplicatedLinear`` / ``disable_tp``; Megatron-Core may shard them).
        prefixes: ``(HF prefix, engine prefix)`` pairs for checkpoints laid out with the first
            pair's HF prefix (vLLM's ``orig_to_new_prefix`` of Qwen3-VL-style vision-language
            models: ``model.language_model.`` -> ``language_model.model.``, ``lm_head.`` ->
            ``language_model.lm_head.``): in such a model an engine tensor whose name starts
            with an HF prefix is named with its engine prefix instead (the first pair that
            matches); other models keep their names.
        stacked_experts: how the engine stores experts whose HF tensors stack every expert of a
            layer (``None``: it takes no such tensors pre-split).
        architecture_renames: ``(HF architecture, ((HF substring, engine substring), ...))``: the
            renames of that architecture's engine model class, applied to every engine tensor
            name of such a model (vLLM's ``gpt_oss.py``: ``.self_attn.`` -> ``.attn.``).
        architecture_prefixes: ``(HF architecture, ((HF prefix, engine prefix), ...))``: the
            prefix table of that architecture's engine model class, used instead of
            :attr:`prefixes` for every tensor of such a model (the first pair that matches; vLLM's
            ``orig_to_new_prefix`` of ``qwen2_5_vl.py``, whose checkpoints keep the language model
            under ``model.`` and the tower under ``visual.``).
        expert_parallel: routed experts are split over the engine's ranks whole - vLLM's
            ``enable_expert_parallel`` over its TP group (expert TP 1) - instead of by rows, placed
            ``"linear"`` (contiguous runs, the first ``E % N`` ranks one more) or ``"round_robin"``
            (expert ``e`` on rank ``e % N``) as vLLM's ``expert_placement_strategy``
            (:func:`expert_owner`); ``None``: every rank holds every expert's row shard.
    """

    name: str
    fusions: tuple[Fusion, ...] = ()
    experts: Optional[ExpertFusion] = None
    experts_prefix: str = ""
    vocab_padding: int = 0
    presplit: bool = True
    replicated: tuple[str, ...] = ()
    prefixes: tuple[tuple[str, str], ...] = ()
    stacked_experts: Optional[StackedExpertLayout] = None
    architecture_renames: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    architecture_prefixes: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    expert_parallel: Optional[str] = None

    def prefixes_for(self, architecture: str, hf_names: Iterable[str]) -> tuple[tuple[str, str], ...]:
        """The ``(HF prefix, engine prefix)`` pairs that name a model's engine tensors: the
        architecture's own table (:attr:`architecture_prefixes`), else :attr:`prefixes` where they
        apply to these HF tensors (:meth:`renames`), else none."""
        own = next((pairs for arch, pairs in self.architecture_prefixes if arch == architecture), None)
        if own is not None:
            return own
        return self.prefixes if self.renames(hf_names) else ()

    def renames_for(self, architecture: str) -> tuple[tuple[str, str], ...]:
        """The substring renames of ``architecture``'s engine model class (:attr:`architecture_renames`)."""
        return next((pairs for arch, pairs in self.architecture_renames if arch == architecture), ())

    def stacked_expert_name(self, hf_name: str) -> Optional[str]:
        """The engine parameter of a stacked-experts HF tensor (``...mlp.experts.gate_up_proj`` ->
        ``...mlp.experts.routed_experts.w13_weight``), or ``None`` where :attr:`stacked_experts`
        does not name it."""
        stem, _, leaf = hf_name.rpartition(".")
        if self.stacked_experts is None or not stem.endswith("experts"):
            return None
        param = dict(self.stacked_experts.params).get(leaf)
        return None if param is None else f"{stem}.{self.experts_prefix}{param}"

    def renames(self, hf_names: Iterable[str]) -> bool:
        """Whether :attr:`prefixes` apply to a model with these HF tensors (one of them starts with
        the first pair's HF prefix)."""
        return bool(self.prefixes) and any(n.startswith(self.prefixes[0][0]) for n in hf_names)

    def engine_name(self, name: str, renamed: Union[bool, tuple[tuple[str, str], ...]],
                    substrings: tuple[tuple[str, str], ...] = ()) -> str:  # fmt: skip
        """The engine's name for a tensor named ``name`` after fusion: ``substrings``
        (:meth:`renames_for` the model's architecture), then the prefix pairs ``renamed``
        (:meth:`prefixes_for` the model; ``True``: :attr:`prefixes`, ``False``: none)."""
        for old, new in substrings:
            name = name.replace(old, new)
        pairs = (self.prefixes if renamed else ()) if isinstance(renamed, bool) else renamed
        for hf_prefix, engine_prefix in pairs:
            if name.startswith(hf_prefix):
                return engine_prefix + name[len(hf_prefix):]
        return name

    def replicates(self, hf_name: str) -> bool:
        """Whether the engine keeps this HF tensor whole on every tensor-parallel rank."""
        stem = "." + hf_name.rpartition(".")[0]
        return any(stem.endswith(suffix) for suffix in self.replicated)

    def fusion_for(self, hf_name: str, hf_names: Container[str] = ()) -> Optional[tuple[str, Fusion]]:
        """``(engine_name, fusion)`` for an HF tensor that the engine fuses, else ``None``.
        ``hf_names``: every HF tensor of the model (a fusion with ``requires`` looks its sibling
        up there; without them such a fusion never applies)."""
        stem, dot, leaf = hf_name.rpartition(".")  # leaf: weight / bias
        for f in self.fusions:
            if ("." + stem).endswith(f.hf_suffix):
                base = stem[: len(stem) - len(f.hf_suffix) + 1]
                if f.requires and base + f.requires[1:] + ".weight" not in hf_names:
                    continue
                return base + f.engine_suffix[1:] + dot + leaf, f
        return None

    def expert_for(self, hf_name: str, roles: dict[str, str]) -> Optional[tuple[str, int, str, tuple[str, ...]]]:
        """``(engine_name, expert, shard_id, order)`` for a routed-expert HF tensor. ``roles``:
        HF projection name -> role (``gate`` / ``up`` / ``down``), from the zoo's expert rule."""
        if self.experts is None:
            return None
        m = _EXPERT.fullmatch(hf_name)
        if m is None or m.group("proj") not in roles:
            return None
        role = roles[m.group("proj")]
        for want, param, shard in self.experts.projections:
            if want == role:
                name = f"{m.group('prefix')}experts.{self.experts_prefix}{param}"
                return name, int(m.group("expert")), shard, dict(self.experts.order)[param]
        return None


EXPERT_PLACEMENTS = ("linear", "round_robin")


def expert_owner(expert: int, experts: int, ranks: int, placement: str) -> tuple[int, int]:
    """``(engine rank, local index)`` of routed expert ``expert`` of ``experts`` split whole over
    ``ranks`` engine ranks (vLLM 0.26's ``determine_expert_map``: ``"linear"`` gives rank ``r`` a
    contiguous run of ``E // N`` experts, one more for the first ``E % N`` ranks; ``"round_robin"``
    gives it experts ``r, r + N, ...``)."""
    if placement == "linear":
        base, extra = divmod(experts, ranks)
        big = extra * (base + 1)  # the first ``extra`` ranks' experts
        if expert < big:
            return expert // (base + 1), expert % (base + 1)
        rank = extra + (expert - big) // base
        return rank, expert - (rank * base + min(rank, extra))
    if placement == "round_robin":
        return expert % ranks, expert // ranks
    raise ValueError(f"expert placement {placement!r} (one of {', '.join(EXPERT_PLACEMENTS)})")


_EXPERT = re.compile(r"(?P<prefix>.*\.)experts\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight")

_QKV = ("q", "k", "v")
_GATE_UP = (0, 1)
_QKV_A = (0, 1)
_QKV_Z = ("qkv", "z")
_BA = (0, 1)
_WK_WEIGHTS = (0, 1)

#: vLLM 0.26 (the ``hf_to_vllm_mapper`` / ``stacked_params_mapping`` tables of its Llama / Qwen /
#: Mixtral / GLM-4.5 / DeepSeek-V2 model files)
VLLM = EngineFormat(
    name="vllm",
    fusions=(
        Fusion(".q_proj", ".qkv_proj", "q", _QKV, requires=".k_proj"),
        Fusion(".k_proj", ".qkv_proj", "k", _QKV),
        Fusion(".v_proj", ".qkv_proj", "v", _QKV),
        Fusion(".gate_proj", ".gate_up_proj", 0, _GATE_UP),
        Fusion(".up_proj", ".gate_up_proj", 1, _GATE_UP),
        # MLA (``deepseek_v2.py``): replicated, [q_a; kv_a] when the attention has q_a_proj
        Fusion(".q_a_proj", ".fused_qkv_a_proj", 0, _QKV_A),
        Fusion(".kv_a_proj_with_mqa", ".fused_qkv_a_proj", 1, _QKV_A, requires=".q_a_proj"),
        # gated DeltaNet with split projections (Qwen3.5, ``qwen3_5.py``): [q; k; v; z] and [b; a]
        # on every tensor-parallel rank (Qwen3-Next's fused in_proj_qkvz / in_proj_ba stay as they are)
        Fusion(".in_proj_qkv", ".in_proj_qkvz", "qkv", _QKV_Z),
        Fusion(".in_proj_z", ".in_proj_qkvz", "z", _QKV_Z),
        Fusion(".in_proj_b", ".in_proj_ba", 0, _BA),
        Fusion(".in_proj_a", ".in_proj_ba", 1, _BA),
        # DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5; ``deepseek_v2.py``'s
        # ``Indexer``): wk and weights_proj in one replicated ``wk_weights_proj`` ([wk; weights_proj]);
        # wq_b a replicated linear and k_norm a LayerNorm under their HF names
        Fusion(".indexer.wk", ".indexer.wk_weights_proj", 0, _WK_WEIGHTS),
        Fusion(".indexer.weights_proj", ".indexer.wk_weights_proj", 1, _WK_WEIGHTS),
    ),
    experts=ExpertFusion(
        projections=(("gate", "w13_weight", "w1"), ("up", "w13_weight", "w3"), ("down", "w2_weight", "w2")),
        order=(("w13_weight", ("w1", "w3")), ("w2_weight", ("w2",))),
    ),
    experts_prefix="routed_experts.",
    vocab_padding=64,
    replicated=(".q_a_proj", ".kv_a_proj_with_mqa", ".indexer.wq_b", ".indexer.wk", ".indexer.weights_proj"),
    # vision-language checkpoints laid out as Qwen3-VL's (``qwen3_vl.py``'s mapper, which Qwen3-VL-MoE
    # and Qwen3.5 share): the language model and the tower
    prefixes=(("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
              ("lm_head.", "language_model.lm_head.")),  # fmt: skip
    # Qwen2.5-VL (``qwen2_5_vl.py``'s mapper): its checkpoints keep the language model under ``model.``
    # and the tower under ``visual.`` (vLLM's name too); the tower's fused ``attn.qkv`` keeps its name,
    # its ``mlp.gate_proj`` / ``up_proj`` become ``gate_up_proj`` as the language model's do
    architecture_prefixes=(("Qwen2_5_VLForConditionalGeneration", (
        ("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))),),  # fmt: skip
    # gpt-oss (``gpt_oss.py``): stacked experts transposed, the down bias on rank 0 only
    stacked_experts=StackedExpertLayout(
        params=(("gate_up_proj", "w13_weight"), ("gate_up_proj_bias", "w13_bias"), ("down_proj", "w2_weight"),
                ("down_proj_bias", "w2_bias")),
    ),
    architecture_renames=(("GptOssForCausalLM", ((".self_attn.", ".attn."), (".embed_tokens.", ".embedding."))),),
)

#: HF names, whole tensors (the engine fuses and splits: SGLang, vLLM ``load_weights``)
HF_NAMES = EngineFormat(name="hf", presplit=False)

#: :data:`VLLM` with ``enable_expert_parallel=True`` over the engine's TP group: each engine rank
#: holds its experts whole (``w13_weight [E_r, 2I, H]``), placed as vLLM's default ``linear``
#: strategy places them (``round_robin``: :data:`VLLM_EP_ROUND_ROBIN`)
VLLM_EP = replace(VLLM, name="vllm-ep", expert_parallel="linear")
VLLM_EP_ROUND_ROBIN = replace(VLLM, name="vllm-ep-round-robin", expert_parallel="round_robin")

ENGINE_FORMATS = {"vllm": VLLM, "vllm-ep": VLLM_EP, "vllm-ep-round-robin": VLLM_EP_ROUND_ROBIN, "hf": HF_NAMES}


def get_engine_format(engine_format: Union[str, EngineFormat]) -> EngineFormat:
    if isinstance(engine_format, EngineFormat):
        return engine_format
    try:
        return ENGINE_FORMATS[engine_format]
    except KeyError:
        raise ValueError(f"unknown engine format {engine_format!r} (known: {', '.join(sorted(ENGINE_FORMATS))})") from None


__all__ = ["EngineFormat", "Fusion", "ExpertFusion", "StackedExpertLayout", "VLLM", "VLLM_EP", "VLLM_EP_ROUND_ROBIN", "HF_NAMES",
           "ENGINE_FORMATS", "get_engine_format", "expert_owner", "EXPERT_PLACEMENTS"]
