"""Hugging Face Hub ids wherever a checkpoint path is taken.

``build_model("Qwen/Qwen3-8B", load="Qwen/Qwen3-8B")``, ``lookup("Qwen/Qwen3-8B")``,
``mcore-zoo convert --hf Qwen/Qwen3-8B`` and ``parity-report --model Qwen/Qwen3-8B`` resolve the id
through ``huggingface_hub.snapshot_download``: its cache (``HF_HOME`` / ``HF_HUB_CACHE``),
``HF_HUB_OFFLINE=1`` (the cache only) and a revision (``org/name@revision``). Only what the zoo
reads is fetched: configs, safetensors weights, tokenizer files and ``generation_config.json`` -
never pickle-based ``.bin`` weights.

A string is taken as a Hub id only when no file or directory of that name exists and it has the
``org/name`` form (an architecture name such as ``LlamaForCausalLM`` never does).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

from .errors import ZooError

logger = logging.getLogger(__name__)

#: What a snapshot download fetches (safetensors only).
ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "tokenizer*", "*.tiktoken", "*.model", "vocab.*", "merges.txt",
    "chat_template*", "*.jinja",
]  # fmt: skip

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")


class HubError(ZooError):
    """A Hub id that cannot be resolved (offline without a cached copy, unknown repo, revision)."""


def is_hub_id(source: Any) -> bool:
    """``org/name`` (optionally ``@revision``) that names no local path."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    text = os.fspath(source)
    if not isinstance(text, str) or not _HUB_ID.match(text) or text.endswith(".json") or ".." in text:
        return False
    return not os.path.exists(text)


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "")
    if value.strip().upper() in ("1", "ON", "YES", "TRUE"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        return False


def resolve(source: Any, *, revision: Optional[str] = None) -> Any:
    """A local path for ``source``: a Hub id becomes its snapshot directory; anything else is
    returned unchanged."""
    if not is_hub_id(source):
        return source
    repo, _, rev = os.fspath(source).partition("@")
    return _snapshot(repo, rev or revision, os.environ.get("HF_HUB_CACHE"), _offline())


@functools.lru_cache(maxsize=64)
def _snapshot(repo: str, revision: Optional[str], cache_dir: Optional[str], offline: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency of transformers
        raise HubError(f"{repo!r} looks like a Hugging Face Hub id, but huggingface_hub is not installed") from None
    where = f"Hugging Face Hub id {repo!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = snapshot_download(
            repo, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=ALLOW_PATTERNS,
        )  # fmt: skip
    except Exception as exc:  # offline cache miss, unknown repo or revision, network errors
        hint = " (HF_HUB_OFFLINE is set: only the local cache is used)" if offline else ""
        text = " ".join(str(exc).split())[:300]
        raise HubError(
            f"{where} (no local path of that name either): cannot resolve it{hint}: {type(exc).__name__}: {text}"
        ) from None
    logger.info("%s resolved to %s", where, path)
    return Path(path)
