"""Errors raised by mcore-zoo.

Every error names what it is about: the architecture, the config field and its value, the tensor
and its shapes, the plugin and its distribution. All derive from :class:`ZooError` so that a
trainer can catch the whole family in one place.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def _bullets(items: Iterable[str], limit: int = 40) -> str:
    items = list(items)
    shown = "\n".join(f"  - {item}" for item in items[:limit])
    if len(items) > limit:
        shown += f"\n  ... and {len(items) - limit} more"
    return shown


class ZooError(Exception):
    """Base class of every error mcore-zoo raises on purpose."""


# --------------------------------------------------------------------------- registry


class UnknownArchitectureError(ZooError, LookupError):
    """No registered plugin provides the requested architecture."""

    def __init__(self, requested: str, supported: Sequence[str], load_failures: Sequence[str] = ()):
        self.requested = requested
        self.supported = list(supported)
        self.load_failures = list(load_failures)
        msg = f"no mcore-zoo plugin provides architecture {requested!r}.\nSupported architectures:\n"
        msg += _bullets(self.supported) if self.supported else "  (none registered)"
        if self.load_failures:
            msg += "\nPlugins that failed to load (one of them may have provided it):\n"
            msg += _bullets(self.load_failures)
        super().__init__(msg)


class PluginConflictError(ZooError):
    """Two plugins claim the same architecture and neither (or both) declared ``override=True``, or
    two plugins' extensions replace the same contribution (``contribution`` is then set)."""

    def __init__(self, architecture: str, claimants: Sequence[str], contribution: str = ""):
        self.architecture = architecture
        self.contribution = contribution
        self.claimants = list(claimants)
        if contribution:
            head = f"the {contribution} of architecture {architecture!r} is replaced by more than one plugin:\n"
            advice = "\nUninstall or block one of them (MCORE_ZOO_BLOCK_PLUGINS=<plugin name>)."
        else:
            head = f"architecture {architecture!r} is claimed by more than one plugin:\n"
            advice = ("\nUninstall or block one of them (MCORE_ZOO_BLOCK_PLUGINS=<plugin name>), or let exactly"
                      " one of them declare ModelEntry(override=True).")  # fmt: skip
        super().__init__(head + _bullets(self.claimants) + advice)


class PluginError(ZooError):
    """A plugin is malformed: bad hook implementation, invalid entry, unresolvable reference."""


# --------------------------------------------------------------------------- configuration


class ConfigError(ZooError):
    """An HF config cannot be converted."""


class UnsupportedConfigError(ConfigError):
    """A config field holds a value the zoo cannot honour exactly (it is never approximated)."""

    def __init__(self, architecture: str, field: str, value: Any, reason: str):
        self.architecture = architecture
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{architecture}: unsupported value {field}={value!r}: {reason}")


class UnclassifiedConfigFieldsError(ConfigError):
    """The HF config has fields the architecture's converter neither maps nor ignores."""

    def __init__(self, architecture: str, fields: dict[str, Any]):
        self.architecture = architecture
        self.fields = dict(fields)
        super().__init__(
            f"{architecture}: the HF config has fields no converter rule classifies (mapped, ignored"
            " with a reason, or rejected). They might change the model, so conversion stops:\n"
            + _bullets(f"{k} = {v!r}" for k, v in sorted(self.fields.items()))
            + "\nIf a field is harmless, pass ignore_fields={'<field>': '<reason>'}"
            " (command line: --ignore-field FIELD=REASON)."
        )


class LayoutError(ConfigError):
    """A parallel layout (TP/PP/VPP/CP/EP) that does not divide the model."""


class UnsupportedLayoutError(LayoutError):
    """A parallel layout that divides the model, but that a layer of it is not built for yet (the
    gated DeltaNet layer under tensor parallelism, ...): refused by name, never computed wrongly."""


class NotOnThisRankError(LayoutError):
    """An operation on a model that this rank holds no part of: the model is placed on a subset of
    the job's ranks (``build_model(..., ranks=...)``) and this rank is outside it."""


# --------------------------------------------------------------------------- weights


class WeightMapError(ZooError):
    """The weight map and a checkpoint or model do not agree."""


class MissingTensorsError(WeightMapError):
    """Tensors the weight map needs are absent from the checkpoint."""

    def __init__(self, names: Sequence[str], source: str = "checkpoint"):
        self.names = sorted(names)
        super().__init__(f"{source} is missing {len(self.names)} tensor(s):\n" + _bullets(self.names))


class UnexpectedTensorsError(WeightMapError):
    """Checkpoint tensors that no weight-map rule consumes and none explicitly ignores."""

    def __init__(self, names: Sequence[str], source: str = "checkpoint"):
        self.names = sorted(names)
        super().__init__(
            f"{source} has {len(self.names)} tensor(s) that no weight-map rule consumes or ignores"
            " (they would be silently dropped):\n" + _bullets(self.names)
        )


class UnmappedParametersError(WeightMapError):
    """mcore parameters that no rule gives a source: they would stay at random init."""

    def __init__(self, names: Sequence[str]):
        self.names = sorted(names)
        super().__init__(
            f"{len(self.names)} mcore parameter(s) have no source in the weight map and would stay at"
            " random initialisation:\n" + _bullets(self.names)
        )


class ShapeMismatchError(WeightMapError):
    """A tensor whose shape is not the one the weight map and config imply."""

    def __init__(self, name: str, expected: Sequence[int], got: Sequence[int], context: str = ""):
        self.name = name
        self.expected = tuple(expected)
        self.got = tuple(got)
        extra = f" ({context})" if context else ""
        super().__init__(f"tensor {name!r} has shape {self.got}, expected {self.expected}{extra}")


class CheckpointFormatError(WeightMapError):
    """A checkpoint file that cannot be read: truncated, corrupt, not safetensors, bad index."""

    def __init__(self, path: str, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read checkpoint file {self.path}: {reason}")


# --------------------------------------------------------------------------- outputs and inputs


class OutputError(ZooError):
    """An output directory that cannot be written."""

    def __init__(self, path: Any, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class OutputExistsError(OutputError, FileExistsError):
    """An output directory that would replace data: not empty (without ``overwrite``), an input,
    or holding files mcore-zoo did not write. ``overwrite_hint``: passing overwrite would help."""

    #: How the hint names the option; the command line sets ``--overwrite``.
    hint = "overwrite=True"

    def __init__(self, path: Any, reason: str, overwrite_hint: bool = False):
        self.overwrite_hint = overwrite_hint
        OutputError.__init__(self, path, reason)

    def __str__(self) -> str:
        text = f"{self.path} {self.reason}"
        return f"{text} (pass {self.hint})" if self.overwrite_hint else text


class InputError(ZooError):
    """A damaged or unreadable input (config, index, distributed checkpoint), named by path and field."""
