"""Progress bars for long work (loading, export, conversion): ``tqdm`` on standard error, shown
only when it is a terminal and the user did not ask for quiet (``mcore-zoo -q`` or
``MCORE_ZOO_QUIET=1``). Messages go through :mod:`logging` (one logger per module, named after it);
the command line configures it, a library user's own configuration is left alone.

This module asks nothing about the job: a caller that runs on every rank of a job passes its rank
(``rank=placement.rank``), and bars are shown on rank 0 only; a caller that runs on one process
(conversion, the writing rank of an export) leaves it at 0."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

ENV_QUIET = "MCORE_ZOO_QUIET"
_quiet: Optional[bool] = None


def set_quiet(quiet: bool) -> None:
    """Switch progress bars off (``True``) for this process, or back to the default (``False``)."""
    global _quiet
    _quiet = True if quiet else None


def enabled(rank: int = 0) -> bool:
    """Bars are shown: not quiet, standard error is a terminal, and ``rank`` (the caller's rank
    in its job, 0 for a single process) is 0."""
    if _quiet or os.environ.get(ENV_QUIET, "0") not in ("", "0") or rank != 0:
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress(iterable: Iterable[T], *, total: Optional[int] = None, desc: str = "", unit: str = "it", rank: int = 0,
             **kwargs: Any) -> Iterator[T]:  # fmt: skip
    """``iterable`` with a progress bar when :func:`enabled` for ``rank``, else unchanged."""
    if not enabled(rank):
        yield from iterable
        return
    from tqdm.auto import tqdm

    with tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, **kwargs) as bar:
        yield from bar
