"""Token log-probabilities and entropy from vocab-parallel logits, without ``[T, V]`` fp32 logits.

:func:`token_logprobs_and_entropy` takes what ``GPTModel``'s output layer returns with
``parallel_output=True`` - this tensor-parallel rank's vocabulary slice of the logits, in the
model's dtype - and returns, per token, ``log softmax(logits / temperature)[target]`` and the
entropy ``H = -sum_v p_v log p_v`` of ``p = softmax(logits / temperature)``, both fp32, both
differentiable with respect to the logits. It never builds the fp32 logits, the softmax or the
gradient for all tokens at once: tokens are processed in chunks, and only one chunk's fp32 work
buffers exist at a time.

Contract
--------
* ``logits_shard [..., V / tp]``: rank ``r`` of ``tp_group`` owns vocabulary rows
  ``[r * V / tp, (r + 1) * V / tp)`` (Megatron-Core's ``VocabUtility`` layout); any float dtype;
  every logit finite. ``targets [...]``: int64 *global* vocabulary ids, the same on every rank.
  A negative target (e.g. ``-100`` padding) is ignored: its log-prob is 0 and it sends no
  gradient through the log-prob (its entropy is still computed). A target ``>= V`` is not checked
  (that would cost a device synchronisation) and gives a meaningless log-prob.
* ``tp_group``: the tensor-parallel process group; ``None`` or a group of size 1 issues no
  collective. Every rank of the group must call with the same ``targets``, ``temperature`` and
  token count (the all-reduces are per token).
* Forward issues exactly two all-reduces over ``[T]``-sized fp32 tensors, whatever the chunking:
  the max, then one sum of ``[sum exp, sum exp * z, target logit]`` (``[2, T]`` without
  entropy). Backward issues none: the statistics it needs are already global.
* Gradients: the backward returns ``d/dlogits`` in the logits' dtype, written chunk by chunk into
  a fresh buffer, or into the saved logits tensor itself with ``inplace_backward=True`` (see
  there). Double backward is not supported.

Math (per token; ``z = x / tau``, ``M`` the max of ``z`` over the whole vocabulary,
``s = sum_v exp(z_v - M)``, ``a = sum_v p_v (z_v - M)``)::

    logprob = (z_t - M) - log s
    H       = log s - a                       (= lse - sum_v p_v z_v, free of cancellation)
    d logprob / dx_v = (delta_vt - p_v) / tau
    d H / dx_v       = -p_v (z_v - M - a) / tau   (= -p_v (log p_v + H) / tau)

so with upstream gradients ``g`` (log-prob) and ``h`` (entropy) the backward writes::

    dx_v = -( e_v * (g + h * (z_v - M - a)) - s * g * delta_vt ) / (s * tau),  e_v = exp(z_v - M)

Across ranks each computes its local max ``m_r``, ``s_r`` and ``w_r = sum exp(z - m_r)(z - m_r)``;
after the max all-reduce it rescales them to the global ``M`` (``s_r e^{m_r - M}``,
``e^{m_r - M}(w_r + (m_r - M) s_r)``) before the sum. With one rank ``M = m_r`` and the rescale is
exactly the identity, so the single-process result does not depend on it.

What is saved for backward, and memory
--------------------------------------
Saved: the logits shard itself, in its own dtype (no copy: the same tensor the caller passed,
``2 * V/tp`` bytes per token in bf16), per token the local target column (int64) and two masks
(owned, not ignored), and the fp32 statistics ``M``, ``s`` and ``a`` (``a`` only with entropy):
22 B/token besides the logits. The softmax is recomputed in backward, chunk by chunk, from the
saved logits.

Peak extra memory (beyond the logits shard the caller already holds), ``Vl = V / tp``, ``c`` the
chunk, all per chunk of fp32 work buffers:

* forward: ``c * Vl * 4`` bytes (log-prob only) or ``2 * c * Vl * 4`` (with entropy), plus
  ~40 B/token of statistics;
* backward: the same work buffers (``c * Vl * 4`` bytes, twice that with entropy) plus the
  gradient, ``Vl * itemsize`` per token (none with ``inplace_backward=True``).

Megatron-Core's ``labels`` path (``tensor_parallel.vocab_parallel_cross_entropy``, the default,
unfused; ``fusions.fused_cross_entropy`` stores the same) casts the whole shard to fp32
(``T * Vl * 4`` B), turns that copy into the softmax in place and saves it for backward, where it
becomes the fp32 gradient that autograd then casts to the input dtype. Per token, with bf16
logits (``GPTModel`` frees them once the loss is computed):

=========================  ====================  ==========================================
                           labels path           this head
=========================  ====================  ==========================================
forward peak               ``6 Vl``              ``2 Vl`` + one chunk
held forward -> backward   ``4 Vl`` (softmax)    ``2 Vl`` (the logits) + 22 B
backward peak              ``6 Vl``              ``4 Vl`` + one chunk (``2 Vl`` + one chunk
                                                 with ``inplace_backward=True``)
=========================  ====================  ==========================================

At ``V = 151936``, tp 1, ``2 Vl`` is 0.30 MB/token: 2.5 GB less held between forward and backward
at 8192 tokens, 5 GB less at the forward peak, 2.5 GB (5 GB in place) less at the backward peak,
against one chunk of fp32 buffers (default :data:`DEFAULT_CHUNK_BYTES`, twice with entropy).

Work, in bytes of memory traffic per element of the shard (bf16 logits, CUDA, where a cast is
fused into the op that reads or writes; log-prob only): forward ``amax`` of the input (2),
``z - M`` into the fp32 buffer (2 + 4), ``exp`` in place (4 + 4), row sums (4): 20; backward
``z - M`` (6), ``exp`` in place (8), one fused scale-and-cast into the gradient buffer (4 + 2):
20. In all 40 B/element against ~52 for Megatron-Core's unfused path (forward: cast 6, max 4,
subtract 8, exp 8, sum 4, divide 8; backward: multiply 8, autograd's cast of the fp32 gradient 6);
the scatter / gather of the target column is per token. Entropy adds about 16 B forward (a
second buffer, a product and a sum) and 20 B backward. A temperature other than 1 adds one pass
(8 B) each way. No host synchronisation anywhere (no ``.item()``, no boolean indexing), so the
chunks queue asynchronously on a GPU. On CPU, where a mixed-dtype op first casts its input into a
temporary, the cast is a separate pass into the work buffer (:data:`FUSED_CASTS`).

On CUDA (when Triton imports; :data:`USE_TRITON`) the per-row work runs in the kernels of
:mod:`mcore_zoo.kernels.logprob_rows` instead: the forward reads each row twice in its own dtype
(max, then the sums) and keeps the statistics in registers, the backward reads it once and writes
the gradient once - 6 B per element in bf16 against the 40 above, no fp32 buffer, no chunking (the
chunk size is then irrelevant). Same statistics and collectives; sums in another order (the max
is exact), and a temperature is applied as a multiplication by its fp32 reciprocal.

Exactness: the arithmetic is fp32 whatever the input dtype (a bf16 shard loses nothing beyond
its own rounding; the gradient is rounded once to the input dtype). In fp32 the log-prob is
``(z_t - M) - log s``, rounded once at the scale of the result; ``torch.log_softmax`` on CPU
rounds the log-sum-exp ``M + log s`` first, so the two differ by up to an ulp of the log-sum-exp:
the CPU tests hold the head within ``1e-6 + 2 ulp(value)`` of the naive formula for log-probs,
entropy and both gradients, temperatures and chunkings, and against fp64 no less accurate than
the naive fp32 formula (``tests/unit/test_logprob_head.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..placement import group_rank, group_size

#: Default budget for one fp32 work buffer (the chunk is ``DEFAULT_CHUNK_BYTES // (4 * V/tp)``
#: tokens: 441 tokens at a vocabulary of 151936 on one rank).
DEFAULT_CHUNK_BYTES = 256 << 20


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    size = group_size(group)
    return size, (group_rank(group) if size > 1 else 0)


def default_chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk such that one fp32 ``[chunk, vocab_local]`` buffer fits in
    :data:`DEFAULT_CHUNK_BYTES`."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_local)))


#: Whether the casts between the input dtype and fp32 are fused into the arithmetic (one kernel
#: reads bf16 and writes fp32, or the reverse). ``None``: on CUDA, or when the input is fp32 (no
#: cast at all). On CPU, TensorIterator implements a mixed-dtype op by first casting the input to
#: a full temporary, so there the cast is a separate pass into the work buffer instead (same
#: values: the fp32 arithmetic and the final single rounding are the same either way).
FUSED_CASTS: Optional[bool] = None


#: Whether the per-row work runs in the Triton kernels of :mod:`mcore_zoo.kernels.logprob_rows`
#: (one read of the logits per pass, no fp32 work buffers) instead of chunked torch ops.
#: ``None``: on CUDA tensors when Triton imports. ``True`` forces them (CPU tensors need Triton's
#: interpreter, ``TRITON_INTERPRET=1``), ``False`` forces the torch path.
USE_TRITON: Optional[bool] = None


def _triton(x: torch.Tensor) -> bool:
    from mcore_zoo.kernels import logprob_rows

    if x.stride(-1) != 1:  # the kernels walk each row with unit stride
        return False
    if USE_TRITON is not None:
        return USE_TRITON and logprob_rows.available()
    return x.is_cuda and logprob_rows.available()


def _fused(x: torch.Tensor) -> bool:
    return FUSED_CASTS if FUSED_CASTS is not None else (x.is_cuda or x.dtype == torch.float32)


def _scaled(x: torch.Tensor, tau: Optional[torch.Tensor]) -> torch.Tensor:
    """``x / tau`` in fp32 for a small tensor, or ``x`` itself when ``tau`` is None."""
    return x if tau is None else torch.div(x, tau)


def _shifted(x: torch.Tensor, tau: Optional[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 work buffer ``x / tau - m`` (``m [c, 1]`` fp32)."""
    if _fused(x):
        if tau is None:
            return torch.sub(x, m)  # promoted to fp32 by the [c, 1] fp32 operand: one read, one write
        return torch.div(x, tau).sub_(m)
    d = x.to(torch.float32, copy=True)
    if tau is not None:
        d.div_(tau)
    return d.sub_(m)


def _store(d: torch.Tensor, coef: torch.Tensor, out: torch.Tensor) -> None:
    """``out = d * coef``, computed in fp32 and rounded once to ``out``'s dtype (``d`` is consumed)."""
    if _fused(out):
        torch.mul(d, coef, out=out)
    else:
        out.copy_(d.mul_(coef))


class _TokenLogprobEntropy(torch.autograd.Function):
    """The chunked head; see the module docstring. Use :func:`token_logprobs_and_entropy`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Any,
        temperature: float,
        chunk: int,
        want_entropy: bool,
        inplace_backward: bool,
    ) -> Any:
        size, rank = _group_size_rank(group)
        n, vl = logits.shape
        dev = logits.device
        tau = None if temperature == 1.0 else torch.full((1,), temperature, dtype=torch.float32, device=dev)

        start = rank * vl
        local = targets - start
        owned = (local >= 0) & (local < vl)
        idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)

        m = torch.empty(n, dtype=torch.float32, device=dev)
        rows = 3 if want_entropy else 2
        # stats[0] = sum exp(z - m), stats[1] = raw target logit z_t (0 where not owned),
        # stats[2] = sum exp(z - m) * (z - m)
        stats = torch.empty(rows, n, dtype=torch.float32, device=dev)
        kernel = _triton(logits)
        if kernel:
            from mcore_zoo.kernels.logprob_rows import row_stats

            m, stats[0], stats[1], w = row_stats(logits, idx.squeeze(-1), owned, temperature, want_entropy)
            if want_entropy:
                stats[2] = w
        for lo in range(0, 0 if kernel else n, chunk):
            hi = min(n, lo + chunk)
            x = logits[lo:hi]
            mc = x.amax(dim=-1).float()
            if tau is not None:
                mc = mc / tau  # max(x / tau) == max(x) / tau exactly: division by tau > 0 is monotonic
            m[lo:hi] = mc
            d = _shifted(x, tau, mc.unsqueeze(-1))
            zt = x.gather(-1, idx[lo:hi]).squeeze(-1).float()
            stats[1, lo:hi] = torch.where(owned[lo:hi], _scaled(zt, tau), 0.0)
            if want_entropy:
                e = torch.exp(d)
                stats[0, lo:hi] = e.sum(dim=-1)
                stats[2, lo:hi] = e.mul_(d).sum(dim=-1)
                del e
            else:
                stats[0, lo:hi] = d.exp_().sum(dim=-1)
            del d

        if size > 1:
            gmax = m.clone()
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            shift = m - gmax  # <= 0; exactly 0 on the rank(s) holding the max
            scale = shift.exp()
            if want_entropy:
                stats[2] = scale * (stats[2] + shift * stats[0])
            stats[0] = stats[0] * scale
            dist.all_reduce(stats, group=group)
            m = gmax

        s = stats[0]
        valid = targets >= 0
        log_s = s.log()
        logprobs = torch.where(valid, (stats[1] - m) - log_s, 0.0)
        if want_entropy:
            a = stats[2] / s
            entropy = log_s - a
        else:
            a = None

        ctx.set_materialize_grads(False)
        saved = [logits, idx, owned & valid, m, s] + ([a] if want_entropy else []) + [valid]
        ctx.save_for_backward(*saved)
        ctx.tau = temperature
        ctx.chunk = chunk
        ctx.inplace = inplace_backward
        ctx.want_entropy = want_entropy
        if want_entropy:
            return logprobs, entropy
        return logprobs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:  # type: ignore[override]
        g = grads[0]
        h = grads[1] if ctx.want_entropy else None
        logits, idx, hit, m, s = ctx.saved_tensors[:5]
        a = ctx.saved_tensors[5] if ctx.want_entropy else None
        none = (None,) * 6
        if g is None and h is None:
            return (None,) + none
        n, _ = logits.shape
        dev = logits.device
        temperature = ctx.tau
        tau = None if temperature == 1.0 else torch.full((1,), temperature, dtype=torch.float32, device=dev)

        valid = ctx.saved_tensors[-1]
        if g is None:
            g = torch.zeros(n, dtype=torch.float32, device=dev)
        else:  # ignored targets send nothing through the log-prob
            g = torch.where(valid, g.float(), 0.0)
        if h is None:
            # dx = -g (e - s onehot) / (s tau)
            onehot = torch.where(hit, -s, 0.0).unsqueeze(-1)
            coef = (-g / (s * temperature)).unsqueeze(-1)
        else:
            # dx = -(e (g + h (z - M - a)) - s g onehot) / (s tau)
            h = h.float()
            onehot = torch.where(hit, -(s * g), 0.0).unsqueeze(-1)
            c0 = (g - h * a).unsqueeze(-1)  # g + h (d - a) = c0 + h d
            coef = (-1.0 / (s * temperature)).unsqueeze(-1)

        grad = logits if ctx.inplace else torch.empty_like(logits)
        if _triton(logits):
            from mcore_zoo.kernels.logprob_rows import grad_rows

            c0_, h_ = (c0.squeeze(-1), h) if h is not None else (None, None)
            grad_rows(logits, grad, idx.squeeze(-1), m, onehot.squeeze(-1), coef.squeeze(-1), c0_, h_, temperature)
            return (grad,) + none
        for lo in range(0, n, ctx.chunk):
            hi = min(n, lo + ctx.chunk)
            d = _shifted(logits[lo:hi], tau, m[lo:hi].unsqueeze(-1))  # z - M
            if h is None:
                d.exp_()  # e
            else:
                e = torch.exp(d)
                torch.addcmul(c0[lo:hi], d, h[lo:hi].unsqueeze(-1), out=d)  # g + h (z - M - a)
                d.mul_(e)
                del e
            d.scatter_add_(-1, idx[lo:hi], onehot[lo:hi])
            _store(d, coef[lo:hi], grad[lo:hi])
            del d
        return (grad,) + none


def token_logprobs_and_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log softmax(logits / temperature)[target]`` and entropy, fp32, from this rank's
    vocabulary slice of the logits; differentiable with respect to ``logits_shard``.

    Args:
        logits_shard: ``[..., V / tp]`` this tensor-parallel rank's vocabulary slice (rank ``r``
            owns ids ``[r * V/tp, (r + 1) * V/tp)``), any float dtype, e.g. ``GPTModel``'s output
            with ``parallel_output=True`` (``[s, b, V/tp]`` or ``[T, V/tp]`` for THD).
        targets: int64 global vocabulary ids, shaped like ``logits_shard[..., 0]``; negative ids
            are ignored (log-prob 0, no log-prob gradient).
        tp_group: the tensor-parallel process group (``None`` or size 1: no collectives).
        temperature: the logits are divided by it (``> 0``) before the softmax.
        chunk_tokens: tokens per chunk (default: one fp32 chunk buffer of at most
            :data:`DEFAULT_CHUNK_BYTES`); memory and results do not depend on it beyond rounding
            that is identical per token.
        compute_entropy: also return the entropy (else ``None``; saves two fp32 passes forward,
            three backward and 4 B/token).
        inplace_backward: write the gradient into ``logits_shard``'s own storage instead of a
            new buffer. Safe when nothing reads the logits after this head's backward has run:
            the output layer's backward does not need them, but a caller that keeps them (e.g.
            returns them as ``return_logits``) would read gradients; another autograd node that
            saved the same tensor and runs its backward later fails loudly (version counter).

    Returns:
        ``(logprobs, entropy)``, each fp32 shaped like ``targets``; ``entropy`` is ``None`` when
        ``compute_entropy=False``.
    """
    if not logits_shard.is_floating_point():
        raise TypeError(f"logits_shard must be a float tensor, got {logits_shard.dtype}")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match logits_shard {tuple(logits_shard.shape)}"
            " without its last dimension"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = targets.shape
    vl = logits_shard.shape[-1]
    chunk = default_chunk_tokens(vl) if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat = logits_shard.reshape(-1, vl)
    out = _TokenLogprobEntropy.apply(
        flat, targets.reshape(-1).long(), tp_group, float(temperature), chunk, compute_entropy, inplace_backward
    )
    if compute_entropy:
        logprobs, entropy = out
        return logprobs.view(shape), entropy.view(shape)
    return out.view(shape), None


def naive_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference formula on full (gathered) logits: ``log_softmax(logits.float() / temperature)``
    gathered at ``targets`` and ``-(p * log p).sum(-1)``. Materialises ``[T, V]`` fp32 (several
    times, with autograd); for tests and benchmarks. Targets must be valid ids. fp64 logits stay
    fp64 (a reference for the fp32 results)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(x / temperature, dim=-1)
    picked = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return picked, entropy


__all__ = ["token_logprobs_and_entropy", "naive_logprobs_and_entropy", "default_chunk_tokens", "DEFAULT_CHUNK_BYTES"]
