"""The model handle: everything the zoo knows about a model it built, in one value.

:func:`mcore_zoo.build_model` (and the provider of :func:`mcore_zoo.model_provider`) attach one
:class:`ModelHandle` to every ``GPTModel`` chunk it builds (``chunk.mcore_zoo``). Every operation -
loading, export, re-sharding, distributed checkpoints, the packed forward - starts with
:func:`handle_of` and reads from the handle instead of re-deriving anything:

* ``architecture`` - the registered :class:`~mcore_zoo.architecture.Architecture` (the plugin
  contributions, extensions applied);
* ``arch_config`` - the converted :class:`~mcore_zoo.config.arch.ArchConfig`;
* ``options`` / ``transformer_config`` - how it was built;
* ``placement`` - the parallel sizes, this rank's coordinates and the process groups
  (:class:`~mcore_zoo.placement.Placement`, taken once at build time);
* ``chunks`` - this rank's ``GPTModel`` chunks (one, or one per virtual-pipeline stage), unwrapped;
* ``hf_source`` - the HF checkpoint the weights came from (its tokenizer files travel with exports);
* the weight map, and its rules bound to each chunk (expert-parallel offsets applied, TP axes
  checked against Megatron-Core's own ``partition_dim``), computed once;
* :meth:`ModelHandle.rule_steps` / :meth:`ModelHandle.export_steps`: each bound rule with its
  tensor reference, transform context and TP group - the plain values loading, export and refit
  take, so that none of them reaches back into the handle;
* :meth:`ModelHandle.derived`: a cache for what operations derive from the chunks once and reuse
  on every call (the rule steps, refit programs), dropped when a chunk is attached.

This module imports neither the build nor any operation, so all of them can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from .errors import ZooError
from .placement import Placement
from .weights.export import exports
from .weights.rules import (
    BoundRule, RuleStep, TransformContext, WeightMap, bind_steps, check_partition_dim, parameters_and_state_buffers,
)  # fmt: skip

if TYPE_CHECKING:  # pragma: no cover
    from .architecture import Architecture
    from .config.arch import ArchConfig
    from .config.transformer import BuildOptions
    from .numerics.profiles import NumericsProfile

HANDLE_ATTR = "mcore_zoo"


@dataclass(eq=False)
class ModelHandle:
    """One zoo-built model on this rank (see the module docstring)."""

    architecture: "Architecture"
    arch_config: "ArchConfig"
    options: "BuildOptions"
    transformer_config: Any
    placement: Placement
    hf_source: Optional[str] = None  # the HF checkpoint directory the weights were loaded from
    fp8_source: Any = None  # the Fp8Checkpoint view an FP8 checkpoint was loaded through (plan, scales)
    mxfp4_source: Any = None  # the Mxfp4Checkpoint view an MXFP4 checkpoint was loaded through (its names)
    _chunks: dict[int, torch.nn.Module] = field(default_factory=dict, repr=False)
    _weight_map: Optional[WeightMap] = field(default=None, repr=False)
    _bound: dict[int, list[BoundRule]] = field(default_factory=dict, repr=False)
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ chunks
    def attach(self, chunk: torch.nn.Module, vp_stage: Optional[int] = None) -> torch.nn.Module:
        """Record ``chunk`` as virtual-pipeline stage ``vp_stage`` (0 without VPP) of this model."""
        setattr(chunk, HANDLE_ATTR, self)
        self._chunks[vp_stage or 0] = chunk
        self._bound.pop(id(chunk), None)
        self._derived.clear()
        return chunk

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """This rank's chunks in virtual-pipeline order."""
        return [self._chunks[k] for k in sorted(self._chunks)]

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    # ------------------------------------------------------------------ shortcuts
    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def numerics(self) -> "NumericsProfile":
        return self.options.numerics

    @property
    def params_dtype(self) -> torch.dtype:
        return self.options.params_dtype

    @property
    def head(self) -> str:
        """The output head: ``"lm"`` or ``"value"`` (a critic)."""
        return getattr(self.options, "head", "lm")

    # ------------------------------------------------------------------ weights
    @property
    def weight_map(self) -> WeightMap:
        if self._weight_map is None:
            wmap = self.architecture.weight_map(self.arch_config)
            if self.head == "value":
                from .weights.heads import with_value_head

                wmap = with_value_head(wmap, init=self.options.value_head_init)
            self._weight_map = wmap
        return self._weight_map

    def transform_context(self, bound: Optional[BoundRule] = None) -> TransformContext:
        """What the weight transforms need: the architecture and this rank's TP slot for ``bound``
        (expert tensor parallelism for expert rules, dense TP otherwise, and without a rule)."""
        return self._tp_splits()[bound is not None and bound.is_expert][0]

    def _tp_splits(self) -> dict[bool, tuple[TransformContext, Any]]:
        """``{expert: (transform context, TP group)}`` of this rank's two tensor-parallel splits:
        expert tensor parallelism for expert rules (``True``), dense TP otherwise."""
        p = self.placement
        return {False: (TransformContext(self.arch_config, p.tp_rank, p.tp), p.groups.tp),
                True: (TransformContext(self.arch_config, p.etp_rank, p.etp), p.groups.etp)}  # fmt: skip

    def rule_steps(self, chunk: torch.nn.Module) -> list[RuleStep]:
        """Every bound rule of ``chunk`` (:meth:`bound_rules`) as a :class:`RuleStep`: its tensor
        reference, transform context, chunk, virtual stage and TP group, made once (cached until a
        chunk is attached) and handed to loading and export as plain values."""
        key = ("rule_steps", id(chunk))
        if key not in self._derived:
            stage = next((i for i, c in enumerate(self.chunks) if c is chunk), 0)
            splits = self._tp_splits()
            p, moe = self.placement, self.arch_config.moe
            per_rank = 0 if moe is None else moe.num_experts // p.ep
            bound = self.bound_rules(chunk)
            self._derived[key] = bind_steps(bound, chunk, stage, splits, ep=p.ep, ep_rank=p.ep_rank, per_rank=per_rank)
        return self._derived[key]

    def export_steps(self) -> list[RuleStep]:
        """The rule steps this rank's chunks export, in model order (chunk by chunk): what every
        export and refit of the model reads (:func:`mcore_zoo.weights.export.exports` decides)."""
        if "export_steps" not in self._derived:
            self._derived["export_steps"] = [s for chunk in self.chunks for s in self.rule_steps(chunk) if exports(s.bound, chunk)]
        return self._derived["export_steps"]

    def bound_rules(self, chunk: torch.nn.Module) -> list[BoundRule]:
        """The weight rules bound to ``chunk`` (cached): local layer / expert indices mapped to
        global HF ones, and each rule's tensor-parallel axes checked against the parameter's own
        ``partition_dim`` (Megatron-Core and Transformer Engine set it on every split parameter)."""
        key = id(chunk)
        if key not in self._bound:
            moe = self.arch_config.moe
            local = None if moe is None else moe.num_experts // self.placement.ep
            offset = 0 if local is None else self.placement.ep_rank * local
            parameters, buffers = parameters_and_state_buffers(chunk)  # one walk for the rules and the names
            self._derived[("parameter_names", key)] = tuple(parameters)
            self._bound[key] = self.weight_map.bind(chunk, expert_offset=offset, num_local_experts=local, check=True,
                                                    tensors={**parameters, **buffers})  # fmt: skip
        return self._bound[key]

    def parameter_names(self, chunk: torch.nn.Module) -> tuple[str, ...]:
        """The names of ``chunk``'s parameters, in ``named_parameters()`` order (cached until a chunk is
        attached): what :func:`~mcore_zoo.weights.load.plan_load` checks every rule covers."""
        return self.derived(("parameter_names", id(chunk)), lambda: tuple(n for n, _ in chunk.named_parameters()))

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed on the first call for ``key`` and kept until a chunk is attached
        (what an operation derives from the chunks' structure - never from parameter values)."""
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = make()
            return value

    # ------------------------------------------------------------------ checks
    def check_current(self) -> None:
        """Raise :class:`~mcore_zoo.errors.LayoutError` when the running parallel state is not the
        one this model was built for, or this rank's chunks are incomplete;
        :class:`~mcore_zoo.errors.NotOnThisRankError` when this rank holds no part of the model
        (placed on other ranks of the job)."""
        from .errors import LayoutError

        self.placement.check_holds_model(self.arch_config.architecture)
        self.placement.check_still_current()
        if len(self._chunks) != self.placement.vpp:
            raise LayoutError(
                f"{self.arch_config.architecture}: {self.placement.vpp} virtual-pipeline chunk(s) per stage,"
                f" {len(self._chunks)} built"
            )


class ModelOnOtherRanks(torch.nn.Module):
    """What :func:`mcore_zoo.build_model` returns on a rank outside the ranks a model is placed on
    (``ranks=``): a module without parameters that carries the model's handle (architecture,
    config, placement; no chunks). Operations on it raise
    :class:`~mcore_zoo.errors.NotOnThisRankError`, except :func:`mcore_zoo.copy_weights` into it:
    this rank takes part in the source's collectives and receives nothing."""

    def __init__(self, handle: ModelHandle) -> None:
        super().__init__()
        setattr(self, HANDLE_ATTR, handle)  # the handle records no chunk on this rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        handle = getattr(self, HANDLE_ATTR)
        handle.placement.check_holds_model(handle.arch_config.architecture)


def unwrap(model: Any) -> torch.nn.Module:
    """Strip DDP / Float16Module-style wrappers (``.module`` chains)."""
    while not hasattr(model, HANDLE_ATTR) and hasattr(model, "module"):
        model = model.module
    return model


def handle_of(model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]]) -> ModelHandle:
    """The :class:`ModelHandle` of a zoo-built model: a chunk (wrapped or not), the list of this
    rank's chunks, or the handle itself."""
    if isinstance(model, ModelHandle):
        return model
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    handle = getattr(unwrap(first), HANDLE_ATTR, None)
    if not isinstance(handle, ModelHandle):
        raise ZooError("this model was not built by mcore_zoo (no model handle attached)")
    return handle


__all__ = ["ModelHandle", "ModelOnOtherRanks", "handle_of", "unwrap", "check_partition_dim", "HANDLE_ATTR"]
