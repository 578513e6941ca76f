"""``Architecture``: a registered :class:`ModelEntry`, the extensions other plugins contribute to it,
and where each piece came from - with the operations a trainer needs (read an HF config into an
:class:`~mcore_zoo.config.arch.ArchConfig`, the layer spec, the weight map, the forward).

This module is imported by the registry, so it must stay light: everything heavy (torch,
megatron-core, transformers) is imported inside the methods. It never imports the build or any
operation (those import it).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from .entry import CONTRIBUTIONS, Extension, ModelEntry, resolve_ref
from .errors import PluginConflictError, PluginError

if TYPE_CHECKING:  # pragma: no cover
    from .config.arch import ArchConfig
    from .numerics.profiles import NumericsProfile
    from .weights.rules import WeightMap


@dataclass(frozen=True)
class Contributed:
    """An extension as the registry saw it: the extension and the origin of its plugin."""

    extension: Extension
    origin: str


@dataclass(frozen=True)
class Architecture:
    """One architecture as the registry resolved it.

    Attributes:
        entry: the owning plugin's :class:`ModelEntry`.
        plugin: entry-point name of the owning plugin.
        distribution: the owning distribution (``mcore-zoo`` for built-ins).
        version: the distribution's version.
        builtin: provided by mcore-zoo itself.
        overridden: origins of other plugins this one overrides (``override=True``).
        extensions: other plugins' :class:`~mcore_zoo.entry.Extension` objects for it.
    """

    entry: ModelEntry
    plugin: str
    distribution: str
    version: str
    builtin: bool = False
    overridden: tuple = field(default=())
    extensions: tuple = field(default=())

    def __post_init__(self) -> None:
        for name in CONTRIBUTIONS:
            replacing = [c.origin for c in self.extensions if name in c.extension.replacements()]
            if len(replacing) > 1:
                raise PluginConflictError(self.name, replacing, contribution=name)

    @property
    def name(self) -> str:
        return self.entry.architecture

    @property
    def origin(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution} {self.version}".rstrip()

    def replace(self, **changes: Any) -> "Architecture":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ provenance
    def provider_of(self, contribution: str) -> str:
        """The origin of the plugin whose ``contribution`` is used."""
        for c in self.extensions:
            if contribution in c.extension.replacements():
                return c.origin
        return self.origin

    def provenance(self) -> dict[str, str]:
        """``{contribution: origin}`` for every contribution, plus the amendments in use."""
        out = {name: self.provider_of(name) for name in CONTRIBUTIONS}
        for kind in ("amend_config", "amend_weight_map"):
            origins = [c.origin for c in self.extensions if getattr(c.extension, kind) is not None]
            if origins:
                out[kind] = ", ".join(origins)
        return out

    def contribution(self, name: str) -> Callable[..., Any]:
        """The callable used for ``name`` (an extension's replacement, else the entry's)."""
        for c in self.extensions:
            ref = c.extension.replacements().get(name)
            if ref is not None:
                return resolve_ref(ref, what=f"{self.name}.{name} ({c.origin})")
        return self.entry.resolve(name)

    def _amendments(self, kind: str) -> list[tuple[Callable[..., Any], str]]:
        return [
            (resolve_ref(getattr(c.extension, kind), what=f"{self.name}.{kind} ({c.origin})"), c.origin)
            for c in self.extensions
            if getattr(c.extension, kind) is not None
        ]

    # ------------------------------------------------------------------ contributions
    def config_from_hf(
        self,
        hf_config: Any,
        *,
        ignore_fields: Optional[Mapping[str, str]] = None,
        trust_remote_code: bool = False,
    ) -> "ArchConfig":
        """HF config (object, dict, directory or config.json) -> :class:`ArchConfig`.

        Every field of the (normalised) HF config is classified by the converter or an extension's
        ``amend_config``; unclassified fields or unsupported values raise, naming the field.
        """
        from .config.arch import ArchConfig
        from .config.normalize import normalize_with_defaults
        from .config.reader import ConfigReader

        config, defaulted = normalize_with_defaults(hf_config, trust_remote_code=trust_remote_code,
                                                    fallback_model_type=self.entry.model_type)  # fmt: skip
        reader = ConfigReader(config, self.name, ignore_fields, defaulted=defaulted)
        arch = self.contribution("converter")(reader)
        if not isinstance(arch, ArchConfig):
            raise PluginError(f"{self.provider_of('converter')}: converter returned {type(arch).__name__}, expected ArchConfig")
        changes: list[tuple[str, str, Any, Any]] = []
        for amend, origin in self._amendments("amend_config"):
            before = arch
            arch = amend(reader, arch)
            if not isinstance(arch, ArchConfig):
                raise PluginError(f"{origin}: amend_config returned {type(arch).__name__}, expected ArchConfig")
            changes += [(origin, f.name, getattr(before, f.name), getattr(arch, f.name)) for f in dataclasses.fields(arch)
                        if f.compare and getattr(before, f.name) != getattr(arch, f.name)]  # fmt: skip
        if changes:
            arch = arch.replace(amendments=tuple(changes))
        report = reader.finish()
        if arch.moe is not None:
            arch = arch.replace(moe=dataclasses.replace(arch.moe, router_weight_dtype=self._reference_router_weight_dtype()))
        return arch.replace(fields=report, hf_config=reader.config)  # with any field the reader stated

    def _reference_router_weight_dtype(self) -> str:
        """The router weight's dtype in the installed transformers reference class
        (:func:`~mcore_zoo.families.moe.config.reference_router_weight_dtype`); ``"params"`` when the class
        cannot be imported (a remote-code model, or a plugin without a reference class)."""
        from .families.moe.config import reference_router_weight_dtype

        try:
            cls = self.reference_model_class()
        except Exception:  # noqa: BLE001 - no reference class: nothing to follow
            return "params"
        return reference_router_weight_dtype(cls)

    def weight_map(self, arch: "ArchConfig") -> "WeightMap":
        """The weight table for ``arch``."""
        from .weights.rules import WeightMap

        wmap = self.contribution("weight_rules")(arch)
        if not isinstance(wmap, WeightMap):
            raise PluginError(f"{self.provider_of('weight_rules')}: weight_rules returned {type(wmap).__name__}, expected WeightMap")
        for amend, origin in self._amendments("amend_weight_map"):
            wmap = amend(arch, wmap)
            if not isinstance(wmap, WeightMap):
                raise PluginError(f"{origin}: amend_weight_map returned {type(wmap).__name__}, expected WeightMap")
        return wmap

    def layer_specs(self, arch: "ArchConfig", backend: str, numerics: "NumericsProfile", **kwargs: Any) -> Any:
        """The layer specs (``TransformerBlockSubmodules``) for ``backend`` and ``numerics``."""
        from .errors import ZooError

        if backend not in self.entry.backends:
            raise ZooError(f"{self.name} does not support backend {backend!r} (supports {self.entry.backends})")
        return self.contribution("layer_spec")(arch, backend, numerics, **kwargs)

    @property
    def forward(self) -> Callable[..., Any]:
        """The THD-packed forward: ``(handle, sequences, attention_mask=None, **options) ->
        PackedOutput`` (:data:`mcore_zoo.entry.FORWARD_CONTRACT`)."""
        return self.contribution("forward")

    def example_config(self) -> dict:
        """The entry's tiny example HF config (a dict), with ``architectures`` filled in."""
        if not self.entry.example_config:
            raise PluginError(f"{self.origin}: {self.name} has no example_config")
        config = copy.deepcopy(dict(self.entry.example_config))
        config.setdefault("architectures", [self.name])
        config.setdefault("model_type", self.entry.model_type)
        return config

    def reference_model_class(self) -> Any:
        """The transformers class used as the parity reference."""
        return resolve_ref(self.entry.reference_class, what=f"{self.name}.hf_model_class")
