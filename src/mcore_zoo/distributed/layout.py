"""Where this process sits in the initialised Megatron parallel state, checked against a model.

Every multi-process entry point (loading, export, the distributed forward) calls
:func:`current_layout` first: a model built for another layout than the running parallel state is a
:class:`~mcore_zoo.errors.LayoutError` before any weight is read or any collective is issued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..build import as_chunks, model_info
from ..config.arch import Parallelism
from ..config.transformer import validate_layout
from ..errors import LayoutError


@dataclass(frozen=True)
class Layout:
    """Sizes and ranks of this process in the initialised Megatron parallel state."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    cp: int
    cp_rank: int
    vpp: int
    sequence_parallel: bool

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def current_layout(model: Any, *, all_chunks: bool = True) -> Layout:
    """The layout ``model`` (this rank's chunks) runs under.

    Raises :class:`LayoutError` when the model was built for another layout than the initialised
    parallel state, when the layout does not divide the model, or (``all_chunks``) when ``model``
    is not the full list of this rank's virtual-pipeline chunks."""
    from megatron.core import parallel_state as ps

    chunks = as_chunks(model)
    info = model_info(chunks[0])
    config = info.config
    if not ps.model_parallel_is_initialized():
        tp = pp = cp = 1
        tp_rank = pp_rank = cp_rank = 0
    else:
        tp, pp, cp = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        tp_rank, pp_rank, cp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_context_parallel_rank(),
        )
    built = {
        "tp": config.tensor_model_parallel_size,
        "pp": config.pipeline_model_parallel_size,
        "cp": config.context_parallel_size,
    }
    running = {"tp": tp, "pp": pp, "cp": cp}
    wrong = [f"{k}: model built for {built[k]}, parallel state has {running[k]}" for k in built if built[k] != running[k]]
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if all_chunks and len(chunks) != vpp:
        wrong.append(f"vpp: model config says {vpp} chunk(s) per stage, got {len(chunks)}")
    if wrong:
        raise LayoutError(f"{info.arch.architecture}: model and parallel state disagree:\n" + "\n".join(f"  - {w}" for w in wrong))
    validate_layout(info.arch, Parallelism(tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp))
    return Layout(tp, tp_rank, pp, pp_rank, cp, cp_rank, vpp, bool(config.sequence_parallel))
