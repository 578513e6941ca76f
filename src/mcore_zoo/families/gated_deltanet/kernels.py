"""Which kernels compute the gated DeltaNet layer: the numerics knob ``linear_attention_kernel``.

``"torch"``: transformers' torch fallbacks op for op (:mod:`.spec`: ``causal_conv1d``,
``chunk_gated_delta_rule``), bitwise equal to transformers' model on its torch path. ``"fla"``:
flash-linear-attention's Triton kernels (package ``fla``, CUDA only) - the chunked gated delta rule
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, q / k L2-normalised in the kernel, as
transformers calls it) and the causal convolution (``fla.modules.causal_conv1d.causal_conv1d``;
``fla.modules.convolution`` in releases before 0.5). A THD pack runs as one varlen call of each with
``cu_seqlens``: every sequence starts from a zero recurrent state and a zero convolution window
inside the kernels, no padding, no per-sequence loop. ``"auto"``: ``"fla"`` for CUDA inputs when
``fla`` is importable, else ``"torch"`` (decided per forward).

fla's gated RMSNorm (``FusedRMSNormGated``) is not used: it multiplies the weight in fp32 before the
single final cast, where transformers' ``Qwen3NextRMSNormGated`` casts the normalised input back to
its dtype first (bf16 results differ), so the layer keeps the torch norm on every kernel.

Asking for ``"fla"`` where it cannot run (``fla`` not importable, or a CPU build) is refused by name
(:func:`fla_problem`); it is never replaced by the torch path.

fp32 gradients need fp32 dots. fla's kernels leave the precision of their fp32 ``tl.dot`` calls to
Triton, whose default on NVIDIA GPUs is TF32 (inputs cut to a 10-bit mantissa). fla computes the
gradient of the decay ``g`` as a reverse cumulative sum of products of q, k and their gradients
whose terms nearly cancel (the decays are strong: ``A_log`` up to log 16), so at TF32 the gradients
of ``A_log``, ``dt_bias`` and the ``a`` projection come out wrong by their own size or more
(Qwen3-Next's tiny layer in fp32 on an H100, ``tests/gpu/test_gated_deltanet_fla_gpu.py``: gaps of
3.4 times the largest entry of the torch path's gradient on a THD pack, 92 on a BSHD batch), the
other tensors within TF32 rounding; at fp32-accurate dots the decay's gradients agree within a few
1e-3. So fla is taken for float32 activations with gradients recorded only where Triton's fp32 dots
are exact enough (:data:`FP32_DOT_PRECISIONS`, set by ``TRITON_F32_DEFAULT`` before fla's first fp32
call in the process: Triton reads it when it compiles a kernel); elsewhere ``"fla"`` is refused by
name and ``"auto"`` takes ``"torch"`` (:func:`fp32_gradient_problem`). bf16 / fp16 activations and
calls without gradients are not concerned.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any, Callable, Optional, Union

import torch

from mcore_zoo.errors import ZooError

#: the knob's values
KERNELS = ("torch", "fla", "auto")
#: where each release of flash-linear-attention keeps the causal convolution (newest first)
CONV_MODULES = ("fla.modules.causal_conv1d", "fla.modules.convolution")
DELTA_RULE_MODULE = "fla.ops.gated_delta_rule"
#: Triton's input precisions for fp32 dots (``TRITON_F32_DEFAULT``) under which fla's fp32 backward
#: keeps fp32 accuracy (the module docstring: TF32, Triton's default on NVIDIA GPUs, does not)
FP32_DOT_PRECISIONS = ("ieee", "tf32x3")


@dataclasses.dataclass(frozen=True)
class FlaKernels:
    """flash-linear-attention's two entry points the layer calls, with fla's signatures:
    ``chunk_gated_delta_rule(q, k, v, g, beta, *, use_qk_l2norm_in_kernel, cu_seqlens, ...)``
    (``[b, t, heads, d]``; returns ``(out, final_state)``) and ``causal_conv1d(x, weight, *,
    activation, cu_seqlens, ...)`` (``x`` ``[b, t, channels]``, ``weight`` ``[channels, width]``;
    returns ``(out, final_state)``); ``device_types``: the tensors' device types they run on."""

    chunk_gated_delta_rule: Callable[..., Any]
    causal_conv1d: Callable[..., Any]
    device_types: tuple = ("cuda",)
    version: str = "unknown"


def load_fla() -> FlaKernels:
    """The installed flash-linear-attention's kernels; :class:`ZooError` naming what is missing."""
    found = _import_fla()
    if isinstance(found, str):
        raise ZooError(found)
    return found


@functools.lru_cache(maxsize=None)
def _import_fla() -> Union[FlaKernels, str]:
    """fla's kernels, or why they cannot be imported (looked up once per process: ``"auto"`` asks
    at every forward)."""
    try:
        delta_rule = importlib.import_module(DELTA_RULE_MODULE).chunk_gated_delta_rule
    except Exception as exc:
        return f"flash-linear-attention (package 'fla') is not importable: {type(exc).__name__}: {exc}"
    for name in CONV_MODULES:
        try:
            conv = importlib.import_module(name).causal_conv1d
            break
        except (ImportError, AttributeError):
            continue
    else:
        return f"flash-linear-attention has no causal_conv1d in {' or '.join(CONV_MODULES)}"
    version = getattr(importlib.import_module("fla"), "__version__", "unknown")
    return FlaKernels(chunk_gated_delta_rule=delta_rule, causal_conv1d=conv, version=version)


def fla_problem(device_type: str) -> Optional[str]:
    """Why fla's kernels cannot run on ``device_type`` tensors here (``None``: they can)."""
    try:
        kernels = load_fla()
    except ZooError as exc:
        return str(exc)
    if device_type not in kernels.device_types:
        return f"its Triton kernels run on {'/'.join(kernels.device_types)} tensors, not {device_type}"
    return None


def check_kernel(choice: str, device_type: str) -> None:
    """Refuse, by name, ``linear_attention_kernel=choice`` where it cannot run on ``device_type``."""
    if choice not in KERNELS:
        raise ZooError(f"linear_attention_kernel={choice!r} not in {KERNELS}")
    if choice == "fla":
        problem = fla_problem(device_type)
        if problem is not None:
            raise ZooError(f"numerics knob linear_attention_kernel='fla' cannot run on {device_type}: {problem}"
                           " (use 'torch', or 'auto': fla on CUDA where importable, else torch)")  # fmt: skip


def triton_fp32_dot_precision() -> str:
    """The input precision Triton gives fp32 ``tl.dot`` calls that name none (fla's): Triton's
    ``knobs.language.fp32_default`` (the environment's ``TRITON_F32_DEFAULT``), else ``"tf32"``,
    Triton's default on NVIDIA GPUs."""
    try:
        from triton import knobs

        precision = knobs.language.fp32_default
    except (ImportError, AttributeError):  # no Triton here, or one older than its knobs
        precision = os.environ.get("TRITON_F32_DEFAULT")
    return precision or "tf32"


def fp32_gradient_problem(x: torch.Tensor) -> Optional[str]:
    """Why fla's kernels would give wrong gradients for the float32 input ``x`` with gradients
    recorded (Triton's fp32 dots in TF32: the module docstring); ``None`` where they would not
    (another dtype, no gradients recorded, or fp32 dots in one of :data:`FP32_DOT_PRECISIONS`)."""
    if x.dtype != torch.float32 or not torch.is_grad_enabled():
        return None
    precision = triton_fp32_dot_precision()
    if precision in FP32_DOT_PRECISIONS:
        return None
    return (f"its fp32 backward runs Triton's fp32 dots in {precision!r}, where the gradients of A_log, dt_bias"
            " and the decay's input projection lose all accuracy (the decay gradient is a sum of nearly"
            f" cancelling terms); set TRITON_F32_DEFAULT to one of {FP32_DOT_PRECISIONS} before the first fp32"
            " call, or use bf16 activations, or run without gradients")  # fmt: skip


def resolve_kernel(choice: str, x: torch.Tensor) -> str:
    """``"torch"`` or ``"fla"`` for an input ``x``: ``"auto"`` picks fla where it can run on ``x``'s
    device and give its gradients (:func:`fp32_gradient_problem`); ``"fla"`` where it cannot is
    refused (:func:`check_kernel`), and likewise where its fp32 gradients would be wrong."""
    if choice == "auto":
        usable = x.is_cuda and fla_problem(x.device.type) is None and fp32_gradient_problem(x) is None
        return "fla" if usable else "torch"
    check_kernel(choice, x.device.type)
    if choice == "fla":
        problem = fp32_gradient_problem(x)
        if problem is not None:
            raise ZooError(f"numerics knob linear_attention_kernel='fla' on float32 activations: {problem}")
    return choice


def pack_boundaries(bounds: list[int], starts: list[int], total_rows: int) -> tuple[list, list]:
    """A THD pack's varlen layout for fla: ``(cu_seqlens, spans)`` from the pack's bounds on the host
    (``bounds``: ``cu_seqlens_q``; ``starts``: ``cu_seqlens_q_padded``, or ``bounds`` again for a pack
    without alignment padding). ``spans``: each non-empty sequence's ``(start row, length)``;
    ``cu_seqlens``: the segment starts of the pack's rows - each sequence's rows one segment, its
    alignment padding and rows past the last sequence segments of their own - so no state or
    window crosses a sequence start; the padding rows' outputs are dropped by the caller."""
    spans = [(starts[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
    cuts = sorted({0, total_rows, *(start for start, _ in spans), *(start + n for start, n in spans)})
    return [c for c in cuts if c <= total_rows], spans
