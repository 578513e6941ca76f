"""The files transformers and vLLM need next to the weights: tokenizer files and
``generation_config.json``.

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
from pathlib import Path
from typing import Union

logger = logging.getLogger(__name__)

#: Files copied from a source checkpoint (top level only). Weights, their index and config.json are
#: written by the zoo itself.
ASSET_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "*.tiktoken", "spiece.model", "sentencepiece*.model", "chat_template*", "generation_config.json",
)  # fmt: skip

#: The folder of a distributed checkpoint written by ``convert`` that holds the HF assets.
MCORE_ASSET_DIR = "hf_assets"



def asset_files(directory: Union[str, os.PathLike, None]) -> list[Path]:
    """The asset files of an HF checkpoint directory (empty if there is none)."""
    if directory is None:
        return []
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in ASSET_PATTERNS):
            found.append(path)
    return found


def copy_assets(source: Union[str, os.PathLike, None], target: Union[str, os.PathLike]) -> list[str]:
    """Copy the assets of ``source`` into ``target`` (following symlinks, as the Hub cache uses
    them); returns the names copied."""
    names = []
    for path in asset_files(source):
        shutil.copyfile(path, Path(target) / path.name)
        names.append(path.name)
    if names:
        logger.debug("copied %s from %s", ", ".join(names), source)
    return names
