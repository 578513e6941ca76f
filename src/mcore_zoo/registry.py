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
* A plugin's import and its ``mcore_zoo_architectures`` hook each get ``MCORE_ZOO_PLUGIN_TIMEOUT``
  seconds (default 30): a plugin that blocks is recorded as a load failure (:mod:`mcore_zoo.provenance`).
* ``MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the built-in plugins (plus the entry-point
  names listed in ``MCORE_ZOO_PLUGINS=a,b``); ``MCORE_ZOO_BLOCK_PLUGINS=a,b`` blocks plugins by
  entry-point name (built-ins too).
* Built-ins come from the entry points alone: an installed (or editable) distribution publishes
  them; a source tree on ``PYTHONPATH`` without one reads the same declaration from its own
  ``pyproject.toml``. There is no second list.
* Hooks are called through the plugin manager, one plugin at a time
  (``PluginManager.subset_hook_caller``): results are attributed to their plugin, and a plugin
  whose hook raises is recorded as failed while the others keep working.
* Extensions (``mcore_zoo_extensions``) are attached to the architecture they name when it is
  looked up; two replacing the same contribution raise :class:`PluginConflictError` then.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import pluggy

from . import hookspecs
from ._version import __version__
from .architecture import Architecture, Contributed
from .config.normalize import read_json_config
from .entry import Extension, ModelEntry
from .errors import PluginConflictError, PluginError, UnknownArchitectureError
from .provenance import PluginTimeout, call_with_timeout

ENTRY_POINT_GROUP = "mcore_zoo"
DISTRIBUTION = "mcore-zoo"
ENV_DISABLE_AUTOLOAD = "MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "MCORE_ZOO_PLUGINS"
ENV_BLOCK = "MCORE_ZOO_BLOCK_PLUGINS"

HOOKS = ("mcore_zoo_architectures", "mcore_zoo_extensions")
#: More items than any plugin contributes: a hook that yields without end is stopped here.
MAX_HOOK_ITEMS = 10_000


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
    extensions: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        return f"plugin {self.name!r} ({self.distribution} {self.version})"

    def describe_failure(self) -> str:
        return f"{self.origin}: {self.error}"


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


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
        self._extensions: dict[str, list[Contributed]] = {}
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
            # a source tree's own pyproject.toml is the built-in list of the code being imported; an
            # installed distribution's metadata may be another tree's (PYTHONPATH=src over an install)
            # or stale (an editable install made before an entry point was added). Built-ins register
            # first, so that a third-party plugin cannot take a built-in's name.
            declared = source_tree_entry_points() if self.builtins else None
            if declared is not None:
                self._load_source_tree_builtins(declared)
            seen_builtin = set()
            for ep in eps:
                dist = self._dist_name(ep)
                builtin = dist == DISTRIBUTION
                if builtin and (not self.builtins or declared is not None):
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
            if self.builtins and declared is None and not seen_builtin:
                record = PluginRecord(name="builtins", module="mcore_zoo.plugins", distribution=DISTRIBUTION,
                                      version=f"{__version__} (not installed)", builtin=True, status="failed")  # fmt: skip
                record.error = (
                    "the built-in architectures are registered through mcore-zoo's entry points, and neither an"
                    " installed mcore-zoo distribution nor the source tree's pyproject.toml provides them:"
                    " install the package (pip install -e .)"
                )
                self._remember(record)
            return self

    def _load_source_tree_builtins(self, declared: dict[str, str]) -> None:
        """The imported package sits in a source tree (``PYTHONPATH=src``, an editable install):
        register the built-ins from the entry points that the tree's own ``pyproject.toml`` declares -
        the same single list an install would publish (``declared``: entry-point name -> module)."""
        for name, value in sorted(declared.items()):
            ep = metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)
            record = PluginRecord(name=name, module=value, distribution=DISTRIBUTION,
                                  version=f"{__version__} (source tree)", builtin=True)  # fmt: skip
            self._load_one(record, ep.load)

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
            plugin = call_with_timeout(loader, f"import of {record.module!r}")
        except PluginTimeout as exc:
            record.status = "failed"
            record.error = str(exc)
            return
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
        implemented = {impl.plugin_name for name in HOOKS for impl in getattr(self._pm.hook, name).get_hookimpls()}
        if record.name not in implemented:
            self._pm.unregister(name=record.name)
            record.status = "failed"
            record.error = f"implements none of the hooks {', '.join(HOOKS)}"
            return
        try:
            entries = self._call(record.name, "mcore_zoo_architectures", ModelEntry)
            extensions = self._call(record.name, "mcore_zoo_extensions", Extension)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._pm.unregister(name=record.name)
            record.status = "failed"
            record.error = f"{getattr(exc, 'hook', 'a hook')} raised {type(exc).__name__}: {exc}"
            return
        record.status = "loaded"
        for entry in entries:
            record.architectures.append(entry.architecture)
            self._claims.setdefault(entry.architecture, []).append(
                Architecture(entry=entry, plugin=record.name, distribution=record.distribution,
                             version=record.version, builtin=record.builtin)  # fmt: skip
            )
        for extension in extensions:
            record.extensions.append(extension.architecture)
            self._extensions.setdefault(extension.architecture, []).append(Contributed(extension, record.origin))

    def _call(self, plugin_name: str, hook: str, kind: type) -> list[Any]:
        """Call ``hook`` of one plugin through the plugin manager; its results, type-checked."""
        others = [p for name, p in self._pm.list_name_plugin() if name != plugin_name]
        try:
            caller = self._pm.subset_hook_caller(hook, remove_plugins=others)

            def consumed() -> list[Any]:  # the results are read under the timeout too (a generator may not end)
                out: list[Any] = []
                for result in caller():
                    for item in result or []:
                        out.append(item)
                        if len(out) > MAX_HOOK_ITEMS:
                            raise PluginError(f"{hook} returned more than {MAX_HOOK_ITEMS} items")
                return out

            items = call_with_timeout(consumed, f"{plugin_name}'s {hook} hook")
            for item in items:
                if not isinstance(item, kind):
                    raise PluginError(f"{hook} returned {type(item).__name__}, expected {kind.__name__}")
        except BaseException as exc:
            exc.hook = hook  # type: ignore[attr-defined]
            raise
        return items

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
        extensions = tuple(sorted(self._extensions.get(architecture, []), key=lambda c: c.origin))
        if len(claims) == 1:
            return claims[0].replace(extensions=extensions)
        winners = [c for c in claims if c.entry.override]
        if len(winners) == 1:
            losers = tuple(c.origin for c in claims if c is not winners[0])
            return winners[0].replace(overridden=losers, extensions=extensions)
        raise PluginConflictError(architecture, [c.origin for c in claims])

    def unclaimed_extensions(self) -> dict[str, list[str]]:
        """Extensions for architectures no loaded plugin provides: ``{architecture: [origins]}``."""
        self.load()
        return {a: [c.origin for c in cs] for a, cs in self._extensions.items() if a not in self._claims}

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


def source_tree_entry_points() -> Optional[dict[str, str]]:
    """``[project.entry-points.mcore_zoo]`` of the ``pyproject.toml`` beside this source tree
    (``src/mcore_zoo`` -> the project root), or ``None`` when there is none."""
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None
    try:
        project = tomllib.loads(path.read_text())["project"]
        return dict(project["entry-points"][ENTRY_POINT_GROUP])
    except (OSError, KeyError, ValueError):
        return None


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


def lookup(source: Any) -> Architecture:
    """Find the architecture for ``source`` in the process-wide registry.

    ``source`` may be an architecture name (``"LlamaForCausalLM"``), an HF ``PretrainedConfig``, a
    config dict, a checkpoint directory or a ``config.json`` path. Raises
    :class:`~mcore_zoo.errors.UnknownArchitectureError` (listing supported architectures and plugin
    load failures) or :class:`~mcore_zoo.errors.PluginConflictError`.
    """
    return get_registry().lookup(source)
