"""The files transformers and vLLM need next to the weights: tokenizer files,
``generation_config.json`` and a vision-language model's processor configs (an engine builds the
transformers processor from them at start-up).

A model's handle remembers the HF checkpoint it was loaded from (``ModelHandle.hf_source``, set by
:func:`mcore_zoo.load_hf_weights`); :func:`mcore_zoo.save_hf_checkpoint` then copies that
checkpoint's assets next to the exported weights. ``mcore-zoo convert`` carries them through the
distributed checkpoint (in its ``hf_assets/`` folder) back to the HF side.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Union

logger = logging.getLogger(__name__)

#: Files copied from a source checkpoint (top level only). Weights, their index and config.json are
#: written by the zoo itself.
ASSET_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "*.tiktoken", "spiece.model", "sentencepiece*.model", "chat_template*", "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",  # vision-language
)  # fmt: skip

#: The folder of a distributed checkpoint written by ``convert`` that holds the HF assets.
MCORE_ASSET_DIR = "hf_assets"



def asset_files(directory: Union[str, os.PathLike, None]) -> list[Path]:
    """The asset files of an HF checkpoint directory (empty if there is none).

    Only regular files whose real path lies inside the checkpoint directory, or inside the Hugging
    Face Hub cache entry it is a snapshot of (the cache links ``snapshots/<rev>/x`` to
    ``../../blobs/<hash>``), are assets: a name that matches an asset pattern but is a link
    leading elsewhere (or dangling), or not a regular file, raises
    :class:`~mcore_zoo.errors.InputError` naming it - the export would otherwise copy whatever
    the link points at."""
    if directory is None:
        return []
    root = Path(directory)
    if not root.is_dir():
        return []
    real_root = root.resolve()
    allowed = [real_root]
    if real_root.parent.name == "snapshots":  # a Hub cache snapshot: its blobs are in the repo folder
        allowed.append(real_root.parent.parent)
    found = []
    for path in sorted(root.iterdir()):
        if not any(fnmatch.fnmatch(path.name, p) for p in ASSET_PATTERNS):
            continue
        if path.is_dir() and not path.is_symlink():
            continue  # a folder named like an asset (e.g. tokenizer/): not copied
        found.append(_checked_asset(path, allowed))
    return found


def _checked_asset(path: Path, allowed: list) -> Path:
    from .errors import InputError

    try:
        real = path.resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError) as exc:  # dangling link, link loop
        raise InputError(f"{path}: a checkpoint asset that cannot be read ({type(exc).__name__}: {exc})") from None
    if not any(real == root or root in real.parents for root in allowed):
        raise InputError(f"{path}: links to {real}, outside the checkpoint ({allowed[0]}); refusing to copy it")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file; refusing to copy it")
    return path


def copy_assets(source: Union[str, os.PathLike, None], target: Union[str, os.PathLike]) -> list[str]:
    """Copy the assets of ``source`` into ``target`` (following the links :func:`asset_files`
    accepts, as the Hub cache uses them); returns the names copied."""
    names = []
    for path in asset_files(source):
        shutil.copyfile(path, Path(target) / path.name)
        names.append(path.name)
    if names:
        logger.debug("copied %s from %s", ", ".join(names), source)
    return names
