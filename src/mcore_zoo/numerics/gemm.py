"""cuBLAS split-K and bitwise packing.

cuBLAS picks GEMM kernels by shape; for some row counts ``M`` it splits the reduction (split-K),
which sums in another order. A packed (THD) batch multiplies ``sum(len_i)`` rows at once while the
HF reference run on each sequence alone multiplies ``len_i`` rows, so some sequences differ in the
last bits (measured on an H200: lengths 100 and 37 differed, 512 and 300 did not). Without a cuBLAS
workspace, split-K kernels are not eligible and every row is computed the same way at any ``M``:
with ``CUBLAS_WORKSPACE_CONFIG=:0:0`` on both sides, ``hf-exact`` THD was bit-identical to HF on
each sequence alone.

The variable is read once, when the process first uses cuBLAS: :func:`require_no_split_k` sets it
if that has not happened yet and raises otherwise. BSHD batches and THD packs of equal lengths
compared with HF's batched call need none of this (same ``M`` on both sides). What it costs in
speed is measured in ``docs/numerics.md``.
"""

from __future__ import annotations

import os

import torch

from ..errors import ZooError

NO_SPLIT_K = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def split_k_disabled() -> bool:
    """Whether this process runs cuBLAS without a workspace (no split-K kernels)."""
    return all(os.environ.get(k) == v for k, v in NO_SPLIT_K.items())


def require_no_split_k() -> None:
    """Disable cuBLAS split-K for this process, or raise if it is too late to do so.

    Call before the first CUDA matmul (e.g. at the top of a parity run or an RL worker that must
    reproduce HF log-probs on packed batches bit for bit). The reference process needs the same.
    """
    if split_k_disabled():
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ZooError(
            "cuBLAS split-K can only be disabled before CUDA is initialised: start the process with "
            + " ".join(f"{k}={v}" for k, v in NO_SPLIT_K.items())
        )
    os.environ.update(NO_SPLIT_K)
