"""Launch helpers shared by the row kernels of :mod:`~mcore_zoo.kernels.hf_rmsnorm`,
:mod:`~mcore_zoo.kernels.rope` and :mod:`~mcore_zoo.kernels.swiglu` (no Triton import here; the
kernels themselves import it when first launched)."""

from __future__ import annotations

import os
from typing import Any

import torch

_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``'s device: CUDA, or the CPU under Triton's interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def refuse_without_triton(knob: str, available: bool) -> None:
    """Refuse the numerics knob ``knob="triton"`` by name where Triton is not ``available``."""
    if not available:
        from ..errors import ZooError

        raise ZooError(f"{knob}='triton' needs Triton (it ships with CUDA builds of torch); use {knob}='torch'")


def refuse_off_device(knob: str, x: torch.Tensor) -> None:
    """Refuse the numerics knob ``knob="triton"`` by name for a tensor the kernels do not take
    (:func:`runs_on`)."""
    if not runs_on(x):
        from ..errors import ZooError

        raise ZooError(f"{knob}='triton' runs on CUDA tensors, not on {x.device} (use {knob}='torch')")


def tl_dtype(dtype: torch.dtype) -> Any:
    """Triton's dtype for a float32 / bfloat16 / float16 tensor (``TypeError`` for any other)."""
    import triton.language as tl

    if dtype not in _TL_DTYPES:
        raise TypeError(f"the row kernels take float32 / bfloat16 / float16 tensors, not {dtype}")
    return getattr(tl, _TL_DTYPES[dtype])


def block(n: int) -> int:
    """A power of two >= ``n`` (and >= 16): the elements one program loads for a row of ``n``."""
    import triton

    return max(16, triton.next_power_of_2(n))


def warps(block: int) -> int:
    """Warps of a program holding rows of ``block`` elements (about 8 fp32 per thread and tensor)."""
    return min(16, max(1, block // 256))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
