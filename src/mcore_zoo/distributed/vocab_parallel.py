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
``2 * V/tp`` bytes per token in bf16), the int64 targets (8 B/token) and three fp32 per-token
statistics ``M``, ``s`` and ``a`` (12 B/token; ``a`` only with entropy). The softmax is recomputed
in backward, chunk by chunk, from the saved logits.

Peak extra memory (beyond the logits shard the caller already holds), ``Vl = V / tp``, ``c`` the
chunk, all per chunk of fp32 work buffers:

* forward: ``c * Vl * 4`` bytes (log-prob only) or ``2 * c * Vl * 4`` (with entropy), plus
  ~40 B/token of statistics;
* backward: ``2 * c * Vl * 4`` bytes of work buffers plus the gradient, ``Vl * itemsize`` per
  token (none with ``inplace_backward=True``).

Megatron-Core's ``labels`` path (``tensor_parallel.vocab_parallel_cross_entropy``, the default,
unfused; ``fusions.fused_cross_entropy`` stores the same) casts the whole shard to fp32
(``T * Vl * 4`` B), turns that copy into the softmax in place and saves it for backward, where it
becomes the fp32 gradient that autograd then casts to the input dtype. Per token, with bf16
logits: it holds ``4 Vl`` bytes from forward to backward (plus the ``2 Vl`` logits until the
forward ends, so ``6 Vl`` at its forward peak) and ``6 Vl`` at its backward peak (fp32 gradient +
bf16 cast); this head holds ``2 Vl`` bytes (the logits) between forward and backward, peaks at
``2 Vl`` + one chunk in forward and ``4 Vl`` + one chunk in backward (``2 Vl`` + one chunk with
``inplace_backward``). At ``V = 151936``, tp 1, that is 1.2 MB/token less than the labels path at
every point, and one chunk (default :data:`DEFAULT_CHUNK_BYTES`) of fp32 buffers on top.

Work: per element of the shard, log-prob only, the forward reads the input twice (max, then
``z - M``) and makes one fp32 buffer pass for ``exp`` and one for the sum; the backward one
``z - M``, one ``exp``, and one fused scale-and-cast into the gradient buffer - about 40 bytes
of memory traffic per element in all against ~52 for Megatron-Core's unfused path (cast, max,
subtract, exp, sum, divide; multiply, cast). Entropy adds two fp32 passes in forward and three in
backward.

Exactness: in fp32 on one process, the forward applies the same operations in the same order as
``torch.log_softmax(x / tau)`` (max, ``exp(z - max)`` summed, ``(z_t - max) - log s``): CPU tests
hold it within 1e-6 of the naive formula, and the entropy and both gradients too
(``tests/unit/test_logprob_head.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

#: Default budget for one fp32 work buffer (the chunk is ``DEFAULT_CHUNK_BYTES // (4 * V/tp)``
#: tokens: 441 tokens at a vocabulary of 151936 on one rank).
DEFAULT_CHUNK_BYTES = 256 << 20


def _group_size_rank(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    size = dist.get_world_size(group)
    return size, (dist.get_rank(group) if size > 1 else 0)


def default_chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk such that one fp32 ``[chunk, vocab_local]`` buffer fits in
    :data:`DEFAULT_CHUNK_BYTES`."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_local)))


def _scaled(x: torch.Tensor, tau: Optional[torch.Tensor]) -> torch.Tensor:
    """``x / tau`` in fp32 (a fresh buffer), or ``x`` itself when ``tau`` is None."""
    return x if tau is None else torch.div(x, tau)


def _shifted(x: torch.Tensor, tau: Optional[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 buffer ``x / tau - m`` (``m [c, 1]`` fp32), in one pass when ``tau`` is None."""
    if tau is None:
        return torch.sub(x, m)  # promoted to fp32 by the [c, 1] fp32 operand: one read, one write
    return torch.div(x, tau).sub_(m)


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
        tau = None if temperature == 1.0 else torch.tensor([temperature], dtype=torch.float32, device=dev)

        start = rank * vl
        local = targets - start
        owned = (local >= 0) & (local < vl)
        idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)

        m = torch.empty(n, dtype=torch.float32, device=dev)
        rows = 3 if want_entropy else 2
        # stats[0] = sum exp(z - m), stats[1] = raw target logit z_t (0 where not owned),
        # stats[2] = sum exp(z - m) * (z - m)
        stats = torch.empty(rows, n, dtype=torch.float32, device=dev)
        for lo in range(0, n, chunk):
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
        tau = None if temperature == 1.0 else torch.tensor([temperature], dtype=torch.float32, device=dev)

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
            torch.mul(d, coef[lo:hi], out=grad[lo:hi])  # computed in fp32, rounded once
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
            f"targets {tuple(targets.shape)} must match logits_shard {tuple(logits_shard.shape)} without its last dimension"
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
