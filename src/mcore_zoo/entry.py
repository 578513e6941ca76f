"""``ModelEntry``: everything one HF architecture contributes to the zoo.

A plugin returns one entry per architecture from its ``mcore_zoo_architectures`` hook. The entry is
data: names of callables (``"package.module:attr"`` strings, resolved on first use) so that
listing plugins imports neither Megatron-Core nor Transformer Engine. The zoo core owns building,
sharding, IO, packing, parity and the CLI; an entry only describes the architecture.

The four contributions:

* ``converter`` - ``(reader: ConfigReader) -> ArchConfig``. Reads every field of the HF config
  through the reader, which records it as mapped / ignored (with a reason) / rejected; the zoo
  refuses configs with fields nobody classified.
* ``layer_spec`` - ``(arch: ArchConfig, backend: str, numerics: NumericsProfile) -> LayerSpecs``.
  Most architectures use the zoo's generic GPT layer spec (the default).
* ``weight_rules`` - ``(arch: ArchConfig) -> list[Rule]``: the one declarative HF <-> mcore table
  from which loading, export, TP/PP/EP sharding, coverage checks and round-trip tests all derive.
* ``forward`` - the THD-packed forward (default: the zoo's generic one,
  :func:`mcore_zoo.distributed.forward.generic_forward`); see :data:`FORWARD_CONTRACT`.

A plugin that does not own an architecture can still change one piece of it with an
:class:`Extension` (hook ``mcore_zoo_extensions``): replace one contribution, or amend the config
conversion / weight map the owner produces.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from .errors import PluginError

#: A callable, or the string ``"package.module:attr"`` naming one (resolved lazily).
CallableRef = Union[str, Callable[..., Any]]

_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

BACKENDS = ("te", "local", "portable")

#: the contributions an entry makes and an extension may replace
CONTRIBUTIONS = ("converter", "weight_rules", "layer_spec", "forward")

#: What a ``forward`` contribution receives and returns (documented in docs/adding-a-model.md).
FORWARD_CONTRACT = """\
forward(handle, sequences, attention_mask=None, **options) -> PackedOutput

handle     the ModelHandle of the model (chunks, arch_config, placement, numerics, weight map)
sequences  1-D token tensors, a padded [B, S] batch with attention_mask, or a PackedBatch
options    those of mcore_zoo.packed_forward (seq_format, return_logits, return_logprobs, align,
           num_microbatches, max_tokens_per_microbatch, broadcast, pad_token_id, temperature); pass unknown
           ones on to generic_forward or raise TypeError
returns    PackedOutput with per-sequence results in input order, on every rank of the
           model-parallel group (broadcast=True) or on the last pipeline stage
Under PP / VPP / CP every rank of the model-parallel group calls it with the same sequences; it
must issue the same collectives on every rank (wrap generic_forward, or use
mcore_zoo.distributed.forward's pieces: pack, micro-batches, the schedule, the gathers).
"""


def _check_architecture_name(what: str, name: Any) -> None:
    if not name or not isinstance(name, str):
        raise PluginError(f"{what}.architecture must be a non-empty string, got {name!r}")


def _check_ref(architecture: str, what: str, ref: Any) -> None:
    if isinstance(ref, str):
        if not _REF_RE.match(ref):
            raise PluginError(f"{architecture}: {what}={ref!r} is not 'package.module:attribute'")
    elif not callable(ref):
        raise PluginError(f"{architecture}: {what} must be callable or a 'package.module:attribute' reference")


def resolve_ref(ref: CallableRef, *, what: str = "reference") -> Any:
    """Import and return the object named by ``"module:attr"`` (or return a callable as is)."""
    if not isinstance(ref, str):
        return ref
    if not _REF_RE.match(ref):
        raise PluginError(f"{what} {ref!r} is not of the form 'package.module:attribute'")
    module_name, attr_path = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what} {ref!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{what} {ref!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


@dataclass(frozen=True)
class ModelEntry:
    """What one HF causal-LM architecture contributes.

    Attributes:
        architecture: the HF ``architectures[0]`` string, e.g. ``"LlamaForCausalLM"``.
        model_type: the HF ``model_type`` (``"llama"``), used when a config has no ``architectures``.
        converter: ``(ConfigReader) -> ArchConfig``; see :mod:`mcore_zoo.config`.
        weight_rules: ``(ArchConfig) -> list[Rule]``; see :mod:`mcore_zoo.weights.rules`.
        layer_spec: ``(ArchConfig, backend, NumericsProfile) -> LayerSpecs``.
        forward: THD-packed forward, ``(model, batch, **kw) -> PackedOutput``.
        example_config: a tiny HF config (dict) of this architecture: the embedded default for
            the CLI, the conformance suite and parity runs. Random weights must make sense at it.
        hf_model_class: ``"transformers:LlamaForCausalLM"``-style reference for parity runs;
            defaults to ``transformers:<architecture>``.
        backends: the layer-spec backends the architecture supports.
        override: take over an architecture another plugin also registers (exactly one may).
        description: one line for ``mcore-zoo list``.
    """

    architecture: str
    model_type: str
    converter: CallableRef
    weight_rules: CallableRef
    layer_spec: CallableRef = "mcore_zoo.specs.gpt:gpt_layer_specs"
    forward: CallableRef = "mcore_zoo.distributed.forward:generic_forward"
    example_config: Optional[Mapping[str, Any]] = None
    hf_model_class: Optional[str] = None
    backends: tuple = BACKENDS
    override: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        _check_architecture_name("ModelEntry", self.architecture)
        for name in CONTRIBUTIONS:
            _check_ref(self.architecture, f"ModelEntry.{name}", getattr(self, name))
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise PluginError(f"{self.architecture}: unknown backends {sorted(unknown)}; known: {BACKENDS}")

    # -- resolved callables -------------------------------------------------------------
    def resolve(self, name: str) -> Callable[..., Any]:
        """Resolve one of the callable fields (``converter``, ``weight_rules``, ...)."""
        return resolve_ref(getattr(self, name), what=f"{self.architecture}.{name}")

    @property
    def reference_class(self) -> str:
        return self.hf_model_class or f"transformers:{self.architecture}"

    def replace(self, **changes: Any) -> "ModelEntry":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Extension:
    """One plugin's change to an architecture that another plugin provides.

    Replacements (at most one plugin may replace each contribution of an architecture; two are a
    :class:`~mcore_zoo.errors.PluginConflictError` naming both):

    * ``converter``, ``weight_rules``, ``layer_spec``, ``forward`` - as in :class:`ModelEntry`.

    Amendments (any number, applied in plugin-name order after the owner's contribution):

    * ``amend_config`` - ``(reader: ConfigReader, arch: ArchConfig) -> ArchConfig``: classify HF
      config fields the owner does not know (``reader.map`` / ``reader.ignore`` / ...) and adjust
      the converted config.
    * ``amend_weight_map`` - ``(arch: ArchConfig, wmap: WeightMap) -> WeightMap``: add rules (say,
      a value head) or ignore patterns.
    """

    architecture: str
    converter: Optional[CallableRef] = None
    weight_rules: Optional[CallableRef] = None
    layer_spec: Optional[CallableRef] = None
    forward: Optional[CallableRef] = None
    amend_config: Optional[CallableRef] = None
    amend_weight_map: Optional[CallableRef] = None
    description: str = ""

    def __post_init__(self) -> None:
        _check_architecture_name("Extension", self.architecture)
        fields = CONTRIBUTIONS + ("amend_config", "amend_weight_map")
        if all(getattr(self, name) is None for name in fields):
            raise PluginError(f"Extension for {self.architecture} changes nothing")
        for name in fields:
            if getattr(self, name) is not None:
                _check_ref(self.architecture, f"Extension.{name}", getattr(self, name))

    def replacements(self) -> dict[str, CallableRef]:
        """``{contribution: callable}`` for the contributions this extension replaces."""
        return {name: getattr(self, name) for name in CONTRIBUTIONS if getattr(self, name) is not None}
