"""Multi-process helpers: launching, parallel layouts (see :mod:`mcore_zoo.distributed.launch`)."""

from .launch import launch

__all__ = ["launch"]
