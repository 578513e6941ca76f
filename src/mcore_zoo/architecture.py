"""``Architecture``: a registered :class:`ModelEntry` plus where it came from, with the operations a
trainer needs (convert a config, get the layer spec and weight map, build a model).

This module is imported by the registry, so it must stay light: everything heavy (torch,
megatron-core, transformers) is imported inside the methods.
"""

from __future__ import annotations

import copy

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from .entry import ModelEntry

if TYPE_CHECKING:  # pragma: no cover
    from .config.arch import ArchConfig
    from .numerics.profiles import NumericsProfile
    from .weights.rules import WeightMap


@dataclass(frozen=True)
class Architecture:
    """One architecture as the registry resolved it.

    Attributes:
        entry: the plugin's :class:`ModelEntry`.
        plugin: entry-point name of the providing plugin.
        distribution: the providing distribution (``mcore-zoo`` for built-ins).
        version: the distribution's version.
        overridden: origins of other plugins this one overrides (``override=True``).
    """

    entry: ModelEntry
    plugin: str
    distribution: str
    version: str
    overridden: tuple = field(default=())

    @property
    def name(self) -> str:
        return self.entry.architecture

    @property
    def origin(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution} {self.version}".rstrip()

    def with_overridden(self, origins: list) -> "Architecture":
        return dataclasses.replace(self, overridden=tuple(origins))

    # ------------------------------------------------------------------ contributions
    def convert(
        self,
        hf_config: Any,
        *,
        ignore_fields: Optional[Mapping[str, str]] = None,
        trust_remote_code: bool = False,
    ) -> "ArchConfig":
        """HF config (object, dict, directory or config.json) -> :class:`ArchConfig`.

        Every field of the (normalised) HF config is classified; unclassified fields or
        unsupported values raise, naming the field.
        """
        from .config.arch import ArchConfig
        from .config.normalize import normalize_with_defaults
        from .config.reader import ConfigReader
        from .errors import PluginError

        config, defaulted = normalize_with_defaults(hf_config, trust_remote_code=trust_remote_code)
        reader = ConfigReader(config, self.name, ignore_fields, defaulted=defaulted)
        arch = self.entry.resolve("converter")(reader)
        if not isinstance(arch, ArchConfig):
            raise PluginError(f"{self.origin}: converter returned {type(arch).__name__}, expected ArchConfig")
        report = reader.finish()
        return arch.replace(fields=report, hf_config=config)

    def weight_map(self, arch: "ArchConfig") -> "WeightMap":
        """The weight table for ``arch``."""
        from .errors import PluginError
        from .weights.rules import WeightMap

        wmap = self.entry.resolve("weight_rules")(arch)
        if not isinstance(wmap, WeightMap):
            raise PluginError(f"{self.origin}: weight_rules returned {type(wmap).__name__}, expected WeightMap")
        return wmap

    def layer_specs(self, arch: "ArchConfig", backend: str, numerics: "NumericsProfile", **kwargs: Any) -> Any:
        """The layer specs (``TransformerBlockSubmodules``) for ``backend`` and ``numerics``."""
        from .errors import ZooError

        if backend not in self.entry.backends:
            raise ZooError(f"{self.name} does not support backend {backend!r} (supports {self.entry.backends})")
        return self.entry.resolve("layer_spec")(arch, backend, numerics, **kwargs)

    @property
    def forward(self) -> Any:
        """The THD-packed forward: ``(model, sequences, **kw) -> PackedOutput``."""
        return self.entry.resolve("forward")

    def example_config(self) -> dict:
        """The entry's tiny example HF config (a dict), with ``architectures`` filled in."""
        from .errors import PluginError

        if not self.entry.example_config:
            raise PluginError(f"{self.origin}: {self.name} has no example_config")
        config = copy.deepcopy(dict(self.entry.example_config))
        config.setdefault("architectures", [self.name])
        config.setdefault("model_type", self.entry.model_type)
        return config

    def build_model(self, hf_config: Any, **kwargs: Any) -> Any:
        """Build the Megatron-Core model (see :func:`mcore_zoo.build_model`)."""
        from .build import build_model

        return build_model(hf_config, architecture=self, **kwargs)

    def reference_model_class(self) -> Any:
        """The transformers class used as the parity reference."""
        from .entry import resolve_ref

        return resolve_ref(self.entry.reference_class, what=f"{self.name}.hf_model_class")
