"""Triton kernels for the log-prob / entropy head: one pass per row over a vocabulary slice.

The chunked head (:mod:`mcore_zoo.distributed.vocab_parallel`) needs, per token, statistics of
the row ``z = x / tau`` of this rank's vocabulary slice, and in backward a gradient row. With
torch ops each of those is several full passes through fp32 work buffers (~40 bytes of memory
traffic per logit, forward and backward together). These kernels read the logits in their own
dtype and keep everything else in registers:

* :func:`row_stats` (forward): two reads of the row (the max, then the sums): ``2 * itemsize``
  bytes per logit;
* :func:`grad_rows` (backward): one read and one write per logit (``2 * itemsize``).

Single rank, no collectives: the head combines the per-rank statistics. Both kernels compute in
fp32 and give the same per-token quantities as the torch path up to the summation order of the
row sums (the max is exact; sums differ by fp32 rounding only).

Contract (both): ``logits [n, vl]`` any float dtype, row-major with unit stride in the last
dimension (rows may be strided); CUDA tensors, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported; tests use it). ``idx [n]`` int64: the
local column of the target (any valid column where the target is not on this rank), every other
per-token tensor ``[n]`` fp32 contiguous.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

#: Elements of a row one program loads at a time.
BLOCK = 4096


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch; the CPU wheel has none)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: use the torch path
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(x_ptr, stride, vl, idx_ptr, owned_ptr, inv_tau,
                     m_ptr, s_ptr, zt_ptr, w_ptr,
                     WANT_W: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for lo in range(0, vl, BLOCK):
            cols = lo + offs
            x = tl.load(base + cols, mask=cols < vl, other=float("-inf")).to(tl.float32)
            mx = tl.maximum(mx, x)
        m = tl.max(mx, axis=0)
        if HAS_TAU:
            m = m * inv_tau
        acc_s = tl.zeros([BLOCK], tl.float32)
        acc_w = tl.zeros([BLOCK], tl.float32)
        for lo in range(0, vl, BLOCK):
            cols = lo + offs
            mask = cols < vl
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_TAU:
                x = x * inv_tau
            d = x - m
            e = tl.where(mask, tl.exp(d), 0.0)
            acc_s += e
            if WANT_W:
                acc_w += e * d
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, tl.sum(acc_s, axis=0))
        if WANT_W:
            tl.store(w_ptr + row, tl.sum(acc_w, axis=0))
        t = tl.load(idx_ptr + row)
        zt = tl.load(base + t).to(tl.float32)
        if HAS_TAU:
            zt = zt * inv_tau
        own = tl.load(owned_ptr + row)
        tl.store(zt_ptr + row, tl.where(own != 0, zt, 0.0))

    @triton.jit
    def grad_kernel(x_ptr, x_stride, out_ptr, out_stride, vl, idx_ptr, m_ptr, onehot_ptr, coef_ptr,
                    c0_ptr, h_ptr, inv_tau,
                    WANT_H: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        xb = x_ptr + row * x_stride
        ob = out_ptr + row * out_stride
        m = tl.load(m_ptr + row)
        t = tl.load(idx_ptr + row)
        onehot = tl.load(onehot_ptr + row)
        coef = tl.load(coef_ptr + row)
        if WANT_H:
            c0 = tl.load(c0_ptr + row)
            h = tl.load(h_ptr + row)
        offs = tl.arange(0, BLOCK)
        for lo in range(0, vl, BLOCK):
            cols = lo + offs
            mask = cols < vl
            x = tl.load(xb + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_TAU:
                x = x * inv_tau
            d = x - m
            e = tl.exp(d)
            if WANT_H:
                v = e * (c0 + h * d)
            else:
                v = e
            v = tl.where(cols == t, v + onehot, v)
            tl.store(ob + cols, (v * coef).to(out_ptr.dtype.element_ty), mask=mask)

    return stats_kernel, grad_kernel


def _inv_tau(temperature: float) -> tuple[float, bool]:
    return (1.0 / temperature, True) if temperature != 1.0 else (1.0, False)


def row_stats(logits: torch.Tensor, idx: torch.Tensor, owned: torch.Tensor, temperature: float,
              want_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """Per row of ``logits [n, vl]``: ``m`` = max of ``z = x * (1 / tau)``, ``s = sum exp(z - m)``,
    ``zt`` = ``z[idx]`` where ``owned`` else 0, and (``want_w``) ``w = sum exp(z - m) (z - m)``.
    All ``[n]`` fp32. ``owned [n]`` bool. The temperature is applied as a multiplication by its
    fp32 reciprocal (the torch path divides; the two differ by at most an ulp of ``z``)."""
    n, vl = logits.shape
    dev = logits.device
    m = torch.empty(n, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    zt = torch.empty_like(m)
    w = torch.empty_like(m) if want_w else s
    if n == 0:
        return m, s, zt, (w if want_w else None)
    inv_tau, has_tau = _inv_tau(temperature)
    stats_kernel, _ = _kernels()
    stats_kernel[(n,)](logits, logits.stride(0), vl, idx.contiguous(), owned.to(torch.int8).contiguous(),
                       inv_tau, m, s, zt, w, WANT_W=want_w, HAS_TAU=has_tau, BLOCK=BLOCK)  # fmt: skip
    return m, s, zt, (w if want_w else None)


def grad_rows(logits: torch.Tensor, out: torch.Tensor, idx: torch.Tensor, m: torch.Tensor,
              onehot: torch.Tensor, coef: torch.Tensor, c0: Optional[torch.Tensor],
              h: Optional[torch.Tensor], temperature: float) -> None:  # fmt: skip
    """``out[r, v] = coef[r] * (e + onehot[r] * [v == idx[r]])`` with ``e = exp(z - m[r])``, or with
    ``c0`` / ``h`` given ``e * (c0[r] + h[r] (z - m[r]))`` instead of ``e``; computed in fp32 and
    rounded once to ``out``'s dtype. ``out`` may be ``logits`` itself (each element is read
    before it is written, by the same program)."""
    n, vl = logits.shape
    if n == 0:
        return
    inv_tau, has_tau = _inv_tau(temperature)
    _, grad_kernel = _kernels()
    want_h = h is not None
    c0 = c0.contiguous() if want_h else coef
    h = h.contiguous() if want_h else coef
    grad_kernel[(n,)](logits, logits.stride(0), out, out.stride(0), vl, idx.contiguous(), m.contiguous(),
                      onehot.contiguous(), coef.contiguous(), c0, h, inv_tau,
                      WANT_H=want_h, HAS_TAU=has_tau, BLOCK=BLOCK)  # fmt: skip


__all__ = ["available", "row_stats", "grad_rows", "BLOCK"]
