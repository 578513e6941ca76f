"""Progress bars for long work (loading, export, conversion): ``tqdm`` on standard error, shown
only when it is a terminal and the user did not ask for quiet (``mcore-zoo -q`` or
``MCORE_ZOO_QUIET=1``). Messages go through :mod:`logging` (one logger per module, named after it);
the command line configures it, a library user's own configuration is left alone."""

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


def enabled() -> bool:
    """Bars are shown: not quiet, standard error is a terminal, and this is rank 0 of a job."""
    if _quiet or os.environ.get(ENV_QUIET, "0") not in ("", "0"):
        return False
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return False
    except ImportError:  # pragma: no cover
        pass
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress(iterable: Iterable[T], *, total: Optional[int] = None, desc: str = "", unit: str = "it", **kwargs: Any) -> Iterator[T]:
    """``iterable`` with a progress bar when :func:`enabled`, else unchanged."""
    if not enabled():
        yield from iterable
        return
    from tqdm.auto import tqdm

    with tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, **kwargs) as bar:
        yield from bar
