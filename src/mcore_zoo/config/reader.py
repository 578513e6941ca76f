"""Field-coverage bookkeeping for HF config conversion.

A converter reads every field it uses through a :class:`ConfigReader`, which records how the field
was classified:

* ``mapped``  - the value goes into the mcore model (the record says where);
* ``ignored`` - the value cannot change the trained model's math (the record says why);
* rejected    - the value is one the zoo cannot honour exactly: :class:`UnsupportedConfigError`
  is raised at once, naming field and value.

:meth:`ConfigReader.finish` then raises :class:`UnclassifiedConfigFieldsError` for any field of the
HF config that no rule touched, so a new HF field can never be silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, Optional

from ..errors import UnclassifiedConfigFieldsError, UnsupportedConfigError, ZooError

_MISSING = object()


def positive_int(value: Any) -> bool:
    """Whether an HF config value is a positive integer (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def parse_ignore_fields(items: Iterable[str]) -> dict[str, str]:
    """``["name=reason", ...]`` -> ``{name: reason}``, the ``ignore_fields`` of a build, from the
    command line's ``--ignore-field`` values (a reason is required)."""
    out = {}
    for item in items:
        name, _, reason = item.partition("=")
        if not name.strip() or not reason.strip():
            raise ZooError(f"--ignore-field {item!r}: expected NAME=REASON (say why the field may be ignored)")
        out[name.strip()] = reason.strip()
    return out


@dataclass(frozen=True)
class FieldRecord:
    """How one HF config field was classified."""

    field: str
    value: Any
    kind: str  # "mapped" | "ignored"
    detail: str  # mapped: the target; ignored: the reason
    present: bool = True  # False when the value is the HF default of an absent field

    def as_dict(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "value": _jsonable(self.value),
            "kind": self.kind,
            "detail": self.detail,
            "present": self.present,
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


class ConfigReader:
    """Reads an HF config dict field by field, recording each field's classification.

    Args:
        config: the HF config as a dict (``PretrainedConfig.to_dict()``).
        architecture: the architecture name, used in every error message.
        ignore_fields: user-supplied ``{field: reason}`` for fields to ignore on purpose.
        defaulted: fields whose value is transformers' default, absent from the user's config
            (recorded with ``present=False``).
        prefix: how the records and errors name this reader's fields (``"text_config."`` for the
            reader :meth:`nested` makes); lookups take the bare names.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        architecture: str,
        ignore_fields: Optional[Mapping[str, str]] = None,
        defaulted: Collection[str] = (),
        prefix: str = "",
    ) -> None:
        self.config = dict(config)
        self.defaulted = frozenset(defaulted)  # fields only transformers' defaults filled in
        self.architecture = architecture
        self.prefix = prefix
        self.ignore_fields = dict(ignore_fields or {})
        self.records: dict[str, FieldRecord] = {}
        for name, reason in self.ignore_fields.items():
            if name in self.config:
                self._record(name, self.config[name], "ignored", f"by the user: {reason}")

    # ------------------------------------------------------------------ nested configs
    def nested(self, name: str) -> "ConfigReader":
        """A reader of the dict field ``name`` (a vision-language config's ``text_config``): its
        records and errors name the fields ``name.field``. The user's ``ignore_fields`` apply to it
        as ``name.field``, or by the bare field name where the outer config has no such field.
        :meth:`adopt` takes its records back."""
        inner = self.config[name]
        if not isinstance(inner, Mapping):
            raise self.unsupported(name, inner, "expected a nested config (a JSON object)")
        dotted = name + "."
        ignore = {k: v for k, v in self.ignore_fields.items() if "." not in k and k not in self.config}
        ignore.update({k[len(dotted):]: v for k, v in self.ignore_fields.items() if k.startswith(dotted)})
        return ConfigReader(inner, self.architecture, ignore, prefix=self.prefix + dotted)

    def adopt(self, name: str, inner: "ConfigReader", to: str) -> None:
        """Classify the dict field ``name`` as mapped to ``to`` once ``inner`` (its :meth:`nested`
        reader) has classified every field of it (else :class:`UnclassifiedConfigFieldsError`
        naming them); its records join this reader's under their dotted names, and the values it
        stated join :attr:`config`."""
        inner.finish()
        self.config[name] = inner.config
        self._record(name, inner.config, "mapped", to)
        for record in inner.records.values():
            self.records[record.field] = record

    # ------------------------------------------------------------------ primitives
    def has(self, name: str) -> bool:
        return name in self.config

    def peek(self, name: str, default: Any = None) -> Any:
        """Read without classifying (for decisions that another call classifies)."""
        return self.config.get(name, default)

    def _record(self, name: str, value: Any, kind: str, detail: str, present: bool = True) -> None:
        present = present and name not in self.defaulted
        self.records[name] = FieldRecord(self.prefix + name, value, kind, detail, present)

    def _value(self, name: str, default: Any) -> tuple[Any, bool]:
        if name in self.config:
            return self.config[name], name not in self.defaulted
        if default is _MISSING:
            raise UnsupportedConfigError(self.architecture, self.prefix + name, None, "required field is absent")
        return default, False

    def unsupported(self, name: str, value: Any, reason: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(self.architecture, self.prefix + name, value, reason)

    # ------------------------------------------------------------------ classification
    def map(self, name: str, to: str, default: Any = _MISSING, *, convert: Optional[Callable] = None) -> Any:
        """Read ``name`` (or ``default`` if absent) and record it as mapped to ``to``."""
        value, present = self._value(name, default)
        if convert is not None and value is not None:
            value = convert(value)
        self._record(name, value, "mapped", to, present)
        return value

    def ignore(self, name: str, reason: str) -> Any:
        """Record ``name`` as ignored with ``reason`` (no-op if absent)."""
        if name in self.config:
            self._record(name, self.config[name], "ignored", reason)
        return self.config.get(name)

    def ignore_many(self, reasons: Mapping[str, str]) -> None:
        for name, reason in reasons.items():
            self.ignore(name, reason)

    def expect(
        self,
        name: str,
        allowed: Any,
        *,
        reason: str,
        default: Any = _MISSING,
        detail: Optional[str] = None,
        state_absent: bool = False,
    ) -> Any:
        """Require ``name`` to have an allowed value; record it as ignored (it changes nothing).

        ``allowed`` is a value, a collection of values, or a predicate. Raises
        :class:`UnsupportedConfigError` naming field and value otherwise. ``state_absent``: when
        the field is absent, write ``default`` into the normalised config (:attr:`config`, which
        exports copy) - for fields whose absence other readers of the config (vLLM, SGLang)
        take for another value than transformers' model computes.
        """
        value, present = self._value(name, default)
        if not _allowed(value, allowed):
            raise self.unsupported(name, value, reason)
        self._record(name, value, "ignored", detail or f"value {value!r} has no effect here", present)
        if state_absent and name not in self.config:
            self.config[name] = value
        return value

    def map_checked(
        self,
        name: str,
        to: str,
        allowed: Any,
        *,
        reason: str,
        default: Any = _MISSING,
    ) -> Any:
        """Like :meth:`map` but reject values outside ``allowed`` (value, collection or predicate)."""
        value, present = self._value(name, default)
        if not _allowed(value, allowed):
            raise self.unsupported(name, value, reason)
        self._record(name, value, "mapped", to, present)
        return value

    # ------------------------------------------------------------------ result
    def unclassified(self) -> dict[str, Any]:
        return {self.prefix + k: v for k, v in self.config.items() if k not in self.records}

    def finish(self) -> "FieldReport":
        """Raise for unclassified fields; return the report of all classifications."""
        missing = self.unclassified()
        if missing:
            raise UnclassifiedConfigFieldsError(self.architecture, missing)
        return FieldReport(self.architecture, tuple(self.records[k] for k in sorted(self.records)))


def _allowed(value: Any, allowed: Any) -> bool:
    if callable(allowed):
        return bool(allowed(value))
    if isinstance(allowed, (set, frozenset, list, tuple)):
        return value in allowed
    return value == allowed


@dataclass(frozen=True)
class FieldReport:
    """Every HF config field and what the conversion did with it."""

    architecture: str
    records: tuple[FieldRecord, ...]

    def __getitem__(self, name: str) -> FieldRecord:
        for record in self.records:
            if record.field == name:
                return record
        raise KeyError(name)

    def fields(self) -> list[str]:
        return [r.field for r in self.records]

    def as_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "fields": [r.as_dict() for r in self.records]}

    def format_table(self, kinds: Iterable[str] = ("mapped", "ignored")) -> str:
        rows = [r for r in self.records if r.kind in set(kinds)]
        width = max((len(r.field) for r in rows), default=5)
        lines = []
        for r in rows:
            value = repr(r.value)
            if len(value) > 40:
                value = value[:37] + "..."
            suffix = "" if r.present else "  (absent; HF default)"
            lines.append(f"  {r.field:<{width}}  {r.kind:<7}  {value:<40}  {r.detail}{suffix}")
        return "\n".join(lines)

