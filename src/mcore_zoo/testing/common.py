"""Test helpers shared by mcore-zoo's own tests and the conformance suite (CPU, fp32).

* :func:`assert_same` - the bitwise-or-documented-tolerance comparison every parity check uses;
* :func:`random_sequences` - reproducible token sequences;
* :class:`ReferenceCheckpoints` - tiny HF reference checkpoints with random, sharp-attention
  weights (see :mod:`mcore_zoo.parity.reference`), written once per configuration;
* :func:`case_config` - an architecture's example config with overrides.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

#: Lengths of the sequences packed by the parity and THD checks: one of them a single token, two of
#: them longer than the example configs' sliding windows.
PARITY_LENGTHS = (37, 50, 12, 1, 29)

#: Where bitwise equality is not reachable, logits must agree to 1e-6 relative to the largest
#: reference logit (a few fp32 ulps). Two such places, both measured, both explained:
#:
#: * a very short sequence run alone makes every GEMM a few rows: the CPU BLAS (torch 2.13) then
#:   takes another kernel path than for the same rows inside a pack, which sums in another order.
#:   Measured: lengths 1-3, 5-7 and 9-11 differ by a few ulps, 4, 8 and >= 12 are bitwise. The
#:   checks use lengths >= 12 plus one single token (judged by this tolerance);
#: * Megatron-Core's own ``DotProductAttention`` folds the softmax scale into ``baddbmm(alpha=)``
#:   while HF multiplies after the matmul: identical only when ``head_dim ** -0.5`` is a power of
#:   two (head_dim 16, 64, 256 ...), not for Qwen3's example head_dim 24 (nor 128).
REL_TOL = 1e-6

#: Mixture-of-experts models: a THD pack (or alignment padding) gives every expert another set of
#: tokens than a sequence run alone - a different row count for each expert's GEMMs - and the CPU
#: BLAS picks its kernel by row count. Each expert's rows then differ by a few ulps (measured on the
#: Qwen3-MoE example: max |dlogit| 1.7e-6, Qwen2-MoE with alignment padding 3.8e-6, logits ~3-5).
#: The same model run on the same tokens in the same batch (BSHD, local backend, hf-exact) is
#: bitwise. So packed-vs-alone comparisons of MoE models use ``MOE_PACK_REL_TOL``, not bitwise
#: equality.
MOE_PACK_EXACT = False
MOE_PACK_REL_TOL = 1e-5

#: Gated DeltaNet models (``arch.gated_deltanet``, no MoE): a single-token sequence inside a THD pack
#: meets the BLAS row-count effect of :data:`REL_TOL` in every attention and MLP GEMM, and the
#: linear-attention layers carry it further than a plain decoder does. Measured (packed vs alone,
#: the THD check's sequences with seeds 0 and 2-5): Qwen3.5 example 0.4e-6 to 3.2e-6 relative,
#: Qwen3-Next with dense MLPs 0.6e-6 to 1.1e-6. The same sequence run alone is bitwise equal to
#: transformers, and every longer sequence of the pack stays bitwise. Single-token sequences of these
#: models are judged by this tolerance.
LINEAR_ATTENTION_TOKEN_REL_TOL = 1e-5


def pack_tolerance(arch: Any) -> tuple[Optional[bool], float]:
    """``(exact, rel_tol)`` for :func:`assert_same` on one sequence of a THD pack of ``arch`` (an
    ``ArchConfig``) compared with the sequence run alone or with transformers: MoE models within
    :data:`MOE_PACK_REL_TOL`; otherwise bitwise beyond one token, a single token within
    :data:`LINEAR_ATTENTION_TOKEN_REL_TOL` for gated DeltaNet models, else :data:`REL_TOL`."""
    if arch.moe is not None:
        return MOE_PACK_EXACT, MOE_PACK_REL_TOL
    return None, LINEAR_ATTENTION_TOKEN_REL_TOL if arch.gated_deltanet is not None else REL_TOL


#: Tensor parallelism sums partial products of row-parallel layers across ranks (another summation
#: order than one GEMM): logits agree to 1e-5 relative to the largest reference logit.
TP_REL_TOL = 1e-5


#: Layouts against one process (TP / PP / EP / CP on gloo): the same math in other summation
#: orders (row-parallel partial sums, expert GEMMs over other row counts, chunked attention). Each
#: reordered reduction moves a value by a few units in the last place of the largest value it
#: sums, and the layers compound it, so the bound is ``LAYOUT_ULPS`` ulps of the values' dtype at
#: their largest magnitude (at least 1): 1.5e-5 for fp32 values of size <= 1, 7.6e-5 for fp32
#: logits of size 5. A wrong shard, a missing reduction or a changed expert moves them by O(0.1).
LAYOUT_ULPS = 128
#: Gated DeltaNet models under a layout: the delta rule's recurrence (decays cumulated over a whole
#: chunk, a triangular solve per chunk, the state carried from chunk to chunk) carries a reordered
#: reduction further than attention does - one ulp of a layer's output moves the example models'
#: logits by ~1e-5 relative. Measured at TP2 on the examples (the gradients contract): up to 1.13x
#: ``LAYOUT_ULPS`` (Qwen3-Next's ``A_log``; Qwen3.5's attention ``k_proj`` 1.09x; the dense form with
#: sequence parallelism 1.30x, ``input_layernorm``). A wrong shard or a missing reduction still moves
#: the gradients by O(0.1).
LINEAR_ATTENTION_LAYOUT_ULPS = 2 * LAYOUT_ULPS
#: Gated DeltaNet models with the MoE block under a layout: the gradients contract at TP2 with
#: sequence parallelism measured Qwen3-Next's MoE example at 1.13x ``LAYOUT_ULPS`` (``A_log``) and
#: Qwen3.5-MoE's at 2.59x: one routed expert's ``up_proj`` gradient (4.9e-5 at a largest entry of
#: 1.25), that layer's ``A_log`` / ``dt_bias`` / ``in_proj_a`` at 1.5-1.7x. Rounding, not a misplaced
#: value: the same comparison in float64 (the gated DeltaNet core still computes in fp32, as
#: transformers' does) shrinks that expert's gap 370-fold, to 1.3e-7, where a wrong shard or a
#: missing reduction would stay (``tests/distributed/test_gated_deltanet_layouts.py::
#: test_moe_tp2_gradient_gap_is_rounding`` keeps it so). An expert's weight gradient sums only the tokens routed to it, so its
#: largest entry is small next to the upstream gradient errors the reordered reductions (row-parallel
#: partial sums, the sequence-parallel reduce-scatter) carry into it.
LINEAR_ATTENTION_MOE_LAYOUT_ULPS = 4 * LAYOUT_ULPS


def layout_ulps(arch: Any) -> int:
    """The ulps of :func:`layout_bound` for a model of ``arch`` (an ``ArchConfig``):
    :data:`LINEAR_ATTENTION_MOE_LAYOUT_ULPS` for gated DeltaNet models with the MoE block,
    :data:`LINEAR_ATTENTION_LAYOUT_ULPS` for the other gated DeltaNet models, else :data:`LAYOUT_ULPS`."""
    if getattr(arch, "gated_deltanet", None) is None:
        return LAYOUT_ULPS
    return LINEAR_ATTENTION_MOE_LAYOUT_ULPS if getattr(arch, "moe", None) is not None else LINEAR_ATTENTION_LAYOUT_ULPS


def layout_bound(ref: Any, ulps: int = LAYOUT_ULPS) -> float:
    """``ulps`` units in the last place of ``ref``'s dtype at the largest magnitude among ``ref``
    (a tensor or a list of tensors; at least 1.0): the bound of a layout comparison
    (:data:`LAYOUT_ULPS`)."""
    import torch

    tensors = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    largest = max([t.detach().abs().max().item() for t in tensors if t.numel()] + [1.0])
    dtype = tensors[0].dtype if tensors and tensors[0].is_floating_point() else torch.float32
    return ulps * torch.finfo(dtype).eps * largest


@contextlib.contextmanager
def at_rank_threads(world_size: int) -> Iterator[int]:
    """Run the block at the intra-op thread count of a rank of a ``world_size``-rank
    :func:`~mcore_zoo.distributed.launch` (:func:`~mcore_zoo.distributed.launch.rank_threads`);
    the previous count is restored after it. A CPU GEMM's rounding depends on its split over
    threads, so a single-process reference computed here is what the ranks compute for the same
    GEMMs: a pipeline layout (the same GEMMs on the same shapes, stage by stage) is then bitwise
    equal to it, and a tensor-parallel one differs by its reordered reductions alone."""
    import torch

    from ..distributed.launch import rank_threads

    previous = torch.get_num_threads()
    torch.set_num_threads(rank_threads(world_size))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def max_abs_diff(got: Any, ref: Any) -> float:
    return (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0


def assert_same(got: Any, ref: Any, what: str, exact: Optional[bool] = None, rel_tol: float = REL_TOL) -> None:
    """Assert ``got == ref`` bitwise (``exact``; default: when ``got`` has more than one row), else
    within ``rel_tol`` of the largest reference value. The message says by how much they differ."""
    import torch

    if tuple(got.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    diff = max_abs_diff(got, ref)
    if exact is None:
        exact = got.shape[0] > 1
    if exact:
        if not torch.equal(got, ref):
            raise AssertionError(f"{what}: not bitwise equal, max |diff| {diff:.3e}")
    else:
        bound = rel_tol * max(1.0, ref.abs().max().item())
        if not diff <= bound:
            raise AssertionError(f"{what}: max |diff| {diff:.3e} > {bound:.3e}")


def scale_is_power_of_two(head_dim: int) -> bool:
    """Whether ``head_dim ** -0.5`` is a power of two (see :data:`REL_TOL`)."""
    return math.log2(head_dim) % 2 == 0


def random_sequences(lengths: Sequence[int], vocab: int, seed: int = 0) -> list:
    """One random ``long`` token tensor per length (reproducible through ``seed``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def case_config(arch_name: str, overrides: Optional[Mapping[str, Any]] = None, *, registry: Any = None) -> dict:
    """The example config of ``arch_name`` (from the registry) with ``overrides`` applied."""
    from ..registry import get_registry

    config = (registry or get_registry()).get(arch_name).example_config()
    config.update(overrides or {})
    return config


def load_safetensors_dir(path: "str | os.PathLike") -> dict:
    """Every tensor of the ``*.safetensors`` files in ``path`` (small test checkpoints only)."""
    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


class ReferenceCheckpoints:
    """``refs(architecture, config, seed=0) -> Path``: an HF checkpoint of ``architecture`` (a
    registry :class:`~mcore_zoo.architecture.Architecture`) at ``config`` (a dict), with random
    sharp-attention weights, written under ``make_dir(name)`` once per (architecture, config, seed).
    """

    def __init__(self, make_dir: Callable[[str], Path]) -> None:
        self._make_dir = make_dir
        self._cache: dict = {}

    def __call__(self, architecture: Any, config: Mapping[str, Any], seed: int = 0) -> Path:
        from ..parity.reference import write_reference_checkpoint

        key = (architecture.name, architecture.plugin, repr(sorted(config.items(), key=lambda kv: kv[0])), seed)
        if key not in self._cache:
            out = Path(self._make_dir(architecture.name))
            write_reference_checkpoint(architecture, dict(config), out, seed=seed)
            self._cache[key] = out
        return self._cache[key]


def same_bits(a: Any, b: Any) -> bool:
    """Whether two tensors are equal bit for bit: the same dtype and shape and the same bytes (a
    signed zero or a NaN payload counts, unlike ``torch.equal``)."""
    import torch

    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8)))  # fmt: skip


def run_under_triton_interpreter(script: str, timeout: float = 900) -> None:
    """Run ``script`` (Python source that prints ``ok`` first on success) in a subprocess with
    ``TRITON_INTERPRET=1``, so Triton kernels run on the CPU; skip the calling test where Triton is
    not installed (the CPU wheel of torch does not ship it), fail with the script's output otherwise."""
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (CUDA builds of torch ship it; the CPU wheel does not)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]
