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
* ``forward`` - the THD-packed forward (default: the zoo's generic one).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from .errors import PluginError

#: A callable, or the string ``"package.module:attr"`` naming one (resolved lazily).
CallableRef = Union[str, Callable[..., Any]]

_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

BACKENDS = ("te", "local", "portable")


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
    forward: CallableRef = "mcore_zoo.packing:packed_forward"
    example_config: Optional[Mapping[str, Any]] = None
    hf_model_class: Optional[str] = None
    backends: tuple = BACKENDS
    override: bool = False
    description: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.architecture or not isinstance(self.architecture, str):
            raise PluginError(f"ModelEntry.architecture must be a non-empty string, got {self.architecture!r}")
        for name in ("converter", "weight_rules", "layer_spec", "forward"):
            ref = getattr(self, name)
            if isinstance(ref, str):
                if not _REF_RE.match(ref):
                    raise PluginError(
                        f"{self.architecture}: ModelEntry.{name}={ref!r} is not 'package.module:attribute'"
                    )
            elif not callable(ref):
                raise PluginError(f"{self.architecture}: ModelEntry.{name} must be callable or a reference")
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
