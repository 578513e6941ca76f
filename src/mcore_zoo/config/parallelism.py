"""The parallel layout a build asks for: :class:`Parallelism` (sizes only).

Pure data, part of the description of a build (:class:`~mcore_zoo.config.transformer.BuildOptions`
carries it; :func:`~mcore_zoo.config.transformer.validate_layout` checks it against an
architecture before any process group exists). Where a running process sits in that layout is
:class:`mcore_zoo.placement.Placement`; ``mcore_zoo.placement.Parallelism`` is this class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Parallelism:
    """A Megatron parallel layout (sizes only).

    ``vpp`` is the number of virtual pipeline chunks per stage (``None`` = no interleaving);
    ``etp`` is the expert tensor-parallel size (``None`` = same as ``tp``).
    """

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    sequence_parallel: bool = False

    def world_size_needed(self) -> int:
        """Ranks of one model replica's dense part: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    @property
    def chunks_per_stage(self) -> int:
        return self.vpp or 1

    def replace(self, **changes: Any) -> "Parallelism":
        return dataclasses.replace(self, **changes)


__all__ = ["Parallelism"]
