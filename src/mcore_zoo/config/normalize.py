"""Bring an HF config into one form: the ``to_dict()`` of transformers' own config class.

Going through the config class gives converters exactly the values the HF model sees (defaults of
absent fields, transformers-5 ``rope_parameters`` standardisation, derived fields such as
``layer_types``). A model type transformers does not know is read as raw JSON; remote code runs
only with ``trust_remote_code=True``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping, Optional

from ..errors import ConfigError


def _config_class(model_type: str) -> Any:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover
        return None
    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def read_json_config(path: str | Path) -> dict[str, Any]:
    from ..hub import resolve

    path = Path(resolve(path))  # a Hugging Face Hub id becomes its snapshot directory
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def normalize_hf_config(source: Any, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """The HF config ``source`` (config object, dict, directory, config.json) as a normalised dict."""
    return normalize_with_defaults(source, trust_remote_code=trust_remote_code)[0]


def normalize_with_defaults(source: Any, *, trust_remote_code: bool = False,
                            fallback_model_type: Optional[str] = None) -> tuple[dict[str, Any], frozenset[str]]:  # fmt: skip
    """:func:`normalize_hf_config` and the top-level fields that only transformers' defaults filled
    in (absent from the given dict or file; empty for a config object, whose origin is unknown).

    ``fallback_model_type``: the config class to read with when the config's own ``model_type`` is
    one transformers does not know (Kimi-K2's ``kimi_k2`` is a DeepSeek-V3 with remote code): the
    owning architecture's built-in class, never the remote code. ``model_type`` keeps its value."""
    if hasattr(source, "to_dict") and callable(source.to_dict) and not isinstance(source, Mapping):
        return dict(source.to_dict()), frozenset()
    if isinstance(source, Mapping):
        raw = dict(source)
    else:
        from ..hub import resolve

        path = Path(resolve(source))
        raw = read_json_config(path)
        if trust_remote_code and raw.get("auto_map"):
            from transformers import AutoConfig

            full = dict(AutoConfig.from_pretrained(str(path), trust_remote_code=True).to_dict())
            return full, _defaulted(full, raw)
    model_type = raw.get("model_type")
    cls = _config_class(model_type) if model_type else None
    if cls is None and fallback_model_type:
        cls = _config_class(fallback_model_type)
    if cls is None:
        return raw, frozenset()
    try:  # transformers may edit nested dicts it is given (rope_scaling gains rope_theta): pass a copy
        full = dict(cls.from_dict(copy.deepcopy(raw)).to_dict())
        if model_type:
            full["model_type"] = model_type
    except Exception as exc:  # validators raise TypeError, ValueError, KeyError and their own types
        raise ConfigError(f"transformers rejects this {model_type!r} config: {type(exc).__name__}: {exc}") from exc
    return full, _defaulted(full, raw)


#: Fields transformers derives from others that are present (not defaults): field -> its sources.
_DERIVED = {"rope_parameters": ("rope_theta", "rope_scaling"), "layer_types": ("sliding_window", "use_sliding_window", "max_window_layers")}


def _defaulted(full: Mapping[str, Any], raw: Mapping[str, Any]) -> frozenset[str]:
    absent = set(full) - set(raw)
    for name, sources in _DERIVED.items():
        if any(source in raw for source in sources):
            absent.discard(name)
    return frozenset(absent)
