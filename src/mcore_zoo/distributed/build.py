"""The one-call build: :func:`build_model` builds this rank's chunks
(:func:`mcore_zoo.build.build_chunks`) and, given ``load=``, loads HF weights into them job-wide
(:func:`mcore_zoo.distributed.load.load_hf_weights`: read on one rank, broadcast to data-parallel
replicas). Building is the model layer's; loading is a job-wide operation, so the function that
does both lives here."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..build import BuildRequest, build_chunks
from ..handle import handle_of
from .load import load_hf_weights


def build_model(
    source: Any,
    request: Optional[BuildRequest] = None,
    /,
    *,
    load: Any = None,
    device: Optional[Union[str, torch.device]] = None,
    **options: Any,
) -> Union[torch.nn.Module, list[torch.nn.Module]]:
    """Build the Megatron-Core model for an HF architecture.

    Args:
        source: HF config (object or dict), checkpoint directory or config.json path.
        request, options: the build options, a :class:`~mcore_zoo.build.BuildRequest` and / or its
            fields as keywords (``backend=``, ``numerics=``, ``parallel=``, ``head=``, ...).
        load: an HF checkpoint directory to load weights from (every parameter must be covered);
            the model is then built without random init.
        device: where the model lives (default: the current CUDA device, else CPU).

    Returns:
        One ``GPTModel`` for this rank's pipeline stage, or a list of virtual-pipeline chunks when
        ``parallel.vpp`` is set. Each carries its :class:`~mcore_zoo.handle.ModelHandle`
        (``.mcore_zoo``). On a rank outside ``ranks=`` (a model placed on part of the job): a
        :class:`~mcore_zoo.handle.ModelOnOtherRanks` carrying the handle, nothing built or loaded.
    """
    if "perform_initialization" in options:
        raise TypeError("build_model decides perform_initialization (off when it loads weights)")
    chunks = build_chunks(source, BuildRequest.of(request, **options, perform_initialization=load is None), device=device)
    if load is not None and handle_of(chunks[0]).placement.holds_model:
        load_hf_weights(chunks, load)
    return chunks if handle_of(chunks[0]).options.parallel.vpp else chunks[0]


__all__ = ["build_model"]
