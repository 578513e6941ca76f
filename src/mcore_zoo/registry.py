"""Plugin registry: which architectures exist, and which plugin provides each.

Plugins are discovered through the entry-point group ``mcore_zoo`` (built-in architectures
included: mcore-zoo's own distribution registers them there exactly as a third-party package
would). Loading imports plugin modules only - never Megatron-Core or Transformer Engine - so
listing is cheap.

Behaviour:

* A plugin that fails to import, implements an unknown hook, lacks the required hook or returns
  something other than ``ModelEntry`` objects is *recorded* (``Registry.failures()``) and shown by
  ``mcore-zoo plugins``; the other plugins keep working, and an unknown-architecture error lists it.
* Two plugins claiming one architecture: :class:`~mcore_zoo.errors.PluginConflictError` (naming both
  plugins and distributions) when that architecture is looked up, and the conflict is shown by
  ``mcore-zoo plugins`` / ``list``, unless exactly one entry says ``override=True``.
* ``MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the built-in plugins (plus the entry-point
  names listed in ``MCORE_ZOO_PLUGINS=a,b``); ``MCORE_ZOO_BLOCK_PLUGINS=a,b`` blocks plugins by
  entry-point name (built-ins too).
* Running from a source tree (no installed ``mcore-zoo`` distribution, e.g. ``PYTHONPATH=src``),
  the built-in plugins are registered from :data:`BUILTIN_PLUGINS` through the same hook.
"""

from __future__ import annotations

import importlib
import os
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable, Mapping, Optional

import pluggy

from . import hookspecs
from .architecture import Architecture
from .config.normalize import read_json_config
from .entry import ModelEntry
from .errors import PluginConflictError, PluginError, UnknownArchitectureError

ENTRY_POINT_GROUP = "mcore_zoo"
DISTRIBUTION = "mcore-zoo"
ENV_DISABLE_AUTOLOAD = "MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "MCORE_ZOO_PLUGINS"
ENV_BLOCK = "MCORE_ZOO_BLOCK_PLUGINS"

#: Built-in plugins: entry-point name -> module. ``pyproject.toml`` declares the same entry points
#: (a test keeps the two equal); this table is used only when running from a source tree.
BUILTIN_PLUGINS: dict[str, str] = {
    "llama": "mcore_zoo.plugins.llama",
    "mistral": "mcore_zoo.plugins.mistral",
    "qwen2": "mcore_zoo.plugins.qwen2",
    "qwen3": "mcore_zoo.plugins.qwen3",
    "qwen3_moe": "mcore_zoo.plugins.qwen3_moe",
    "qwen2_moe": "mcore_zoo.plugins.qwen2_moe",
    "mixtral": "mcore_zoo.plugins.mixtral",
    "glm4_moe": "mcore_zoo.plugins.glm4_moe",
}


@dataclass
class PluginRecord:
    """One plugin as the registry saw it.

    ``status`` is ``"loaded"``, ``"failed"`` (``error`` says why), ``"blocked"`` or ``"disabled"``
    (autoload off and not listed in ``MCORE_ZOO_PLUGINS``).
    """

    name: str
    module: str
    distribution: str
    version: str
    builtin: bool
    status: str = "pending"
    error: Optional[str] = None
    architectures: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        return f"plugin {self.name!r} ({self.distribution} {self.version})"

    def describe_failure(self) -> str:
        return f"{self.origin}: {self.error}"


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _package_version() -> str:
    from . import __version__

    return __version__


class Registry:
    """The set of architectures available in this process.

    Args:
        autoload: load third-party plugins from entry points (default: unless
            ``MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD`` is set). Built-ins always load unless blocked.
        blocked: entry-point names not to load (added to ``MCORE_ZOO_BLOCK_PLUGINS``).
        builtins: register the built-in architectures (default True).
    """

    def __init__(
        self,
        *,
        autoload: Optional[bool] = None,
        blocked: Iterable[str] = (),
        builtins: bool = True,
    ) -> None:
        self.autoload = (not _env_flag(ENV_DISABLE_AUTOLOAD)) if autoload is None else autoload
        self.explicit = set(_env_list(ENV_PLUGINS))
        self.blocked = set(_env_list(ENV_BLOCK)) | set(blocked)
        self.builtins = builtins
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginRecord] = {}
        self._claims: dict[str, list[Architecture]] = {}
        self._loaded = False
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ loading
    def load(self) -> "Registry":
        """Discover and load plugins (idempotent)."""
        with self._lock:
            if self._loaded:
                return self
            self._loaded = True
            eps = sorted(
                metadata.entry_points(group=ENTRY_POINT_GROUP),
                key=lambda ep: (self._dist_name(ep) != DISTRIBUTION, ep.name),
            )
            seen_builtin = set()
            for ep in eps:
                dist = self._dist_name(ep)
                builtin = dist == DISTRIBUTION
                if builtin and not self.builtins:
                    continue
                record = PluginRecord(
                    name=ep.name,
                    module=ep.value,
                    distribution=dist,
                    version=self._dist_version(ep),
                    builtin=builtin,
                )
                if builtin:
                    seen_builtin.add(ep.name)
                if not builtin and not self.autoload and ep.name not in self.explicit:
                    record.status = "disabled"
                    self._remember(record)
                    continue
                self._load_one(record, ep.load)
            if self.builtins:
                for name, module in BUILTIN_PLUGINS.items():
                    if name in seen_builtin:
                        continue
                    record = PluginRecord(
                        name=name,
                        module=module,
                        distribution=DISTRIBUTION,
                        version=f"{_package_version()} (source tree)",
                        builtin=True,
                    )
                    self._load_one(record, lambda module=module: importlib.import_module(module))
            return self

    def register(
        self,
        plugin: Any,
        name: str,
        *,
        distribution: str = "<registered at runtime>",
        version: str = "",
    ) -> PluginRecord:
        """Register a plugin object (module, class instance) directly, e.g. from a trainer or test.

        Goes through the same validation as entry-point plugins; returns the record (check
        ``record.status``) instead of raising so that callers see failures the same way.
        """
        self.load()
        record = PluginRecord(
            name=name, module=repr(plugin), distribution=distribution, version=version, builtin=False
        )
        with self._lock:
            self._load_one(record, lambda: plugin)
        return record

    def _remember(self, record: PluginRecord) -> None:
        key = record.name
        if key in self.plugins and self.plugins[key] is not record:
            key = f"{record.name}@{record.distribution}"
        self.plugins[key] = record

    def _load_one(self, record: PluginRecord, loader: Any) -> None:
        self._remember(record)
        if record.name in self.blocked:
            record.status = "blocked"
            return
        try:
            plugin = loader()
        except BaseException as exc:  # an import may raise anything, SystemExit included
            if isinstance(exc, KeyboardInterrupt):
                raise
            record.status = "failed"
            record.error = f"import of {record.module!r} raised {type(exc).__name__}: {exc}"
            record.error += "\n" + "".join(traceback.format_exception(exc)[-3:]).rstrip()
            return
        existing = self._pm.get_plugin(record.name)
        if existing is not None:
            other = next(
                (r for r in self.plugins.values() if r.name == record.name and r.status == "loaded"), None
            )
            who = other.origin if other else "another plugin"
            record.status = "failed"
            record.error = f"plugin name {record.name!r} is already taken by {who}"
            return
        try:
            self._pm.register(plugin, name=record.name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self._pm.unregister(name=record.name)
            record.status = "failed"
            record.error = f"invalid hook implementation: {exc}"
            return
        except ValueError as exc:
            record.status = "failed"
            record.error = str(exc)
            return
        impls = [
            impl
            for impl in self._pm.hook.mcore_zoo_architectures.get_hookimpls()
            if impl.plugin_name == record.name
        ]
        if not impls:
            self._pm.unregister(name=record.name)
            record.status = "failed"
            record.error = "does not implement the required hook mcore_zoo_architectures"
            return
        try:
            entries = list(impls[0].function())
            for entry in entries:
                if not isinstance(entry, ModelEntry):
                    raise PluginError(
                        f"mcore_zoo_architectures returned {type(entry).__name__}, expected ModelEntry"
                    )
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._pm.unregister(name=record.name)
            record.status = "failed"
            record.error = f"mcore_zoo_architectures raised {type(exc).__name__}: {exc}"
            return
        record.status = "loaded"
        for entry in entries:
            record.architectures.append(entry.architecture)
            self._claims.setdefault(entry.architecture, []).append(
                Architecture(
                    entry=entry,
                    plugin=record.name,
                    distribution=record.distribution,
                    version=record.version,
                )
            )

    @staticmethod
    def _dist_name(ep: metadata.EntryPoint) -> str:
        dist = getattr(ep, "dist", None)
        return dist.metadata["Name"] if dist is not None else "<unknown distribution>"

    @staticmethod
    def _dist_version(ep: metadata.EntryPoint) -> str:
        dist = getattr(ep, "dist", None)
        return dist.version if dist is not None else ""

    # ------------------------------------------------------------------ queries
    def failures(self) -> list[PluginRecord]:
        self.load()
        return [r for r in self.plugins.values() if r.status == "failed"]

    def conflicts(self) -> dict[str, list[Architecture]]:
        """Architectures claimed by several plugins that no single ``override=True`` resolves."""
        self.load()
        return {
            arch: claims
            for arch, claims in self._claims.items()
            if len(claims) > 1 and sum(c.entry.override for c in claims) != 1
        }

    def architectures(self) -> list[str]:
        """All claimed architecture names, sorted (conflicted ones included)."""
        self.load()
        return sorted(self._claims)

    def get(self, architecture: str) -> Architecture:
        """The provider of ``architecture``; raises if unknown or conflicted."""
        self.load()
        claims = self._claims.get(architecture)
        if not claims:
            raise UnknownArchitectureError(
                architecture,
                supported=self.architectures(),
                load_failures=[r.describe_failure().splitlines()[0] for r in self.failures()],
            )
        if len(claims) == 1:
            return claims[0]
        winners = [c for c in claims if c.entry.override]
        if len(winners) == 1:
            losers = [c.origin for c in claims if c is not winners[0]]
            return winners[0].with_overridden(losers)
        raise PluginConflictError(architecture, [c.origin for c in claims])

    def by_model_type(self, model_type: str) -> list[str]:
        self.load()
        return sorted(a for a, cs in self._claims.items() if any(c.entry.model_type == model_type for c in cs))

    def lookup(self, source: Any) -> Architecture:
        """Resolve an architecture name, HF config (object or dict), or checkpoint dir / config.json."""
        if isinstance(source, Architecture):
            return source
        if isinstance(source, ModelEntry):
            return Architecture(entry=source, plugin="<direct>", distribution="<direct>", version="")
        config = read_config_dict(source) if not _is_architecture_name(source) else None
        if config is None:
            return self.get(str(source))
        names = list(config.get("architectures") or [])
        for name in names:
            if name in self.architectures():
                return self.get(name)
        if not names and config.get("model_type"):
            matches = self.by_model_type(config["model_type"])
            if len(matches) == 1:
                return self.get(matches[0])
        requested = names[0] if names else f"model_type={config.get('model_type')!r}"
        return self.get(requested)


def _is_architecture_name(source: Any) -> bool:
    return isinstance(source, str) and "/" not in source and not source.endswith(".json") and not os.path.exists(source)


def read_config_dict(source: Any) -> dict[str, Any]:
    """An HF config as a plain dict, from a config object, a dict, a directory or a JSON file.

    Reads JSON directly (no transformers import, no remote code).
    """
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict") and callable(source.to_dict):
        return dict(source.to_dict())
    return read_json_config(source)


_DEFAULT: Optional[Registry] = None
_DEFAULT_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (configured from the environment on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Registry()
        return _DEFAULT.load()


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` rediscovers plugins."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        _DEFAULT = None


def lookup(source: Any) -> Architecture:
    """Find the architecture for ``source`` in the process-wide registry.

    ``source`` may be an architecture name (``"LlamaForCausalLM"``), an HF ``PretrainedConfig``, a
    config dict, a checkpoint directory or a ``config.json`` path. Raises
    :class:`~mcore_zoo.errors.UnknownArchitectureError` (listing supported architectures and plugin
    load failures) or :class:`~mcore_zoo.errors.PluginConflictError`.
    """
    return get_registry().lookup(source)
