"""The chunked vocab-parallel log-prob / entropy head (:mod:`mcore_zoo.distributed.vocab_parallel`)
against the naive formula: forward and gradients of both outputs, temperatures, chunkings, bf16,
TP2 on gloo, and mutations that must fail.

Tolerance (fp32): ``|head - naive| <= 1e-6 + 2**-22 * |naive|``, i.e. 1e-6 plus two fp32 ulps of
the value. Both sides round, differently: ``torch.log_softmax`` on CPU forms ``x - (max + log s)``
(a rounding at the scale of the log-sum-exp), the head ``(x - max) - log s`` (one rounding at the
scale of the result); the naive entropy sums ``p log p`` over the vocabulary, the head takes
``log s - sum p (x - max)``. Log-probs of -20 are 1.9e-6 apart in fp32, so a bare 1e-6 cannot
hold for them; :func:`test_at_large_logit_scale_no_less_accurate_than_naive` compares both
sides with fp64 instead.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mcore_zoo.distributed.vocab_parallel import naive_logprobs_and_entropy, token_logprobs_and_entropy

TOL = 1e-6
RTOL = 2.0**-22


def _case(t: int, v: int, *, seed: int = 0, scale: float = 1.5, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen)
    g_lp = torch.randn(t, generator=gen)
    g_h = torch.randn(t, generator=gen)
    return logits, targets, g_lp, g_h


def _run(fn, logits, targets, g_lp, g_h, **kw):
    """(logprobs, entropy, d/dlogits of sum(g_lp * logprobs + g_h * entropy))."""
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, targets, **kw)
    loss = (lp * g_lp).sum() + ((h * g_h).sum() if h is not None else 0.0)
    loss.backward()
    return lp.detach(), (h.detach() if h is not None else None), x.grad


def _naive(logits, targets, g_lp, g_h, temperature=1.0):
    return _run(lambda x, t: naive_logprobs_and_entropy(x, t, temperature=temperature), logits, targets, g_lp, g_h)


KEYS = ("logprob", "entropy", "grad")


def _errors(a, b) -> dict:
    """Max absolute difference per output."""
    return {k: (x.double() - y.double()).abs().max().item() for k, x, y in zip(KEYS, a, b) if x is not None}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a.double() - b.double()).abs() - RTOL * b.double().abs()).max().item() <= TOL


def _excess(a, b) -> dict:
    """Max of ``|a - b| - RTOL * |b|`` per output: within tolerance when <= TOL."""
    return {
        k: ((x.double() - y.double()).abs() - RTOL * y.double().abs()).max().item()
        for k, x, y in zip(KEYS, a, b)
        if x is not None
    }


# ---------------------------------------------------------------------------- fp32, one process
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("t,chunk", [(37, 1), (37, 7), (37, 37), (37, 64), (37, None), (1, 1), (1, 5)])
def test_fp32_matches_naive_formula(temperature, t, chunk):
    v = 997  # prime: no relation to any chunking
    case = _case(t, v, seed=t * 101 + (chunk or 0))
    head = _run(token_logprobs_and_entropy, *case, temperature=temperature, chunk_tokens=chunk)
    ref = _naive(*case, temperature=temperature)
    err = _excess(head, ref)
    assert max(err.values()) <= TOL, (err, _errors(head, ref))
    assert head[0].dtype == head[1].dtype == torch.float32


def test_each_output_gradient_alone():
    """Only the log-prob used (entropy's gradient arrives as None), only the entropy used, and
    ``compute_entropy=False``."""
    logits, targets, g_lp, g_h = _case(29, 500, seed=3)
    zero = torch.zeros_like(g_lp)
    for keep_lp, keep_h in ((True, False), (False, True)):
        x = logits.clone().requires_grad_()
        lp, h = token_logprobs_and_entropy(x, targets, temperature=0.8, chunk_tokens=6)
        (lp * g_lp).sum().backward() if keep_lp else (h * g_h).sum().backward()
        ref = _naive(logits, targets, g_lp if keep_lp else zero, g_h if keep_h else zero, temperature=0.8)
        assert _excess([None, None, x.grad], ref)["grad"] <= TOL
    head = _run(token_logprobs_and_entropy, logits, targets, g_lp, g_h, compute_entropy=False, chunk_tokens=10)
    assert head[1] is None
    assert max(_excess(head, _naive(logits, targets, g_lp, zero)).values()) <= TOL


def test_leading_dims_ignored_targets_and_inplace_backward():
    logits, targets, g_lp, g_h = _case(24, 300, seed=5)
    ref = _naive(logits, targets, g_lp, g_h, temperature=1.2)
    # [s, b, V] as GPTModel returns it; results keep the leading shape
    x = logits.view(6, 4, 300).clone().requires_grad_()
    lp, h = token_logprobs_and_entropy(x, targets.view(6, 4), temperature=1.2, chunk_tokens=5)
    assert lp.shape == h.shape == (6, 4)
    ((lp * g_lp.view(6, 4)).sum() + (h * g_h.view(6, 4)).sum()).backward()
    assert _close(x.grad.view(24, 300), ref[2])
    # the gradient written into the logits' own storage
    x = logits.clone().requires_grad_()
    lp, h = token_logprobs_and_entropy(x, targets, temperature=1.2, chunk_tokens=5, inplace_backward=True)
    grads = torch.autograd.grad((lp * g_lp).sum() + (h * g_h).sum(), x)
    assert grads[0].data_ptr() == x.data_ptr()
    assert _close(grads[0], ref[2])
    # ... and another node that saved the logits and runs its backward later fails loudly
    y = logits.clone().requires_grad_() * 1.0
    other = (y * y).sum()
    lp, h = token_logprobs_and_entropy(y, targets, chunk_tokens=5, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (other + lp.sum()).backward()
    # negative targets: log-prob 0, no log-prob gradient, entropy unchanged
    ignored = targets.clone()
    ignored[::3] = -100
    head = _run(token_logprobs_and_entropy, logits, ignored, g_lp, g_h, temperature=1.2, chunk_tokens=5)
    keep = ignored >= 0
    masked = _naive(logits, targets, torch.where(keep, g_lp, 0.0), g_h, temperature=1.2)
    assert torch.all(head[0][~keep] == 0) and _close(head[0][keep], ref[0][keep])
    assert _close(head[1], ref[1]) and _close(head[2], masked[2])


def test_at_large_logit_scale_no_less_accurate_than_naive():
    """Realistic LM logits (max ~ 30): against fp64 truth the head is at least as accurate as the
    fp32 naive formula (whose log-sum-exp rounding then exceeds 1e-6)."""
    logits, targets, g_lp, g_h = _case(64, 2000, seed=7, scale=6.0)
    truth = _naive(logits.double(), targets, g_lp.double(), g_h.double())
    head = _errors(_run(token_logprobs_and_entropy, logits, targets, g_lp, g_h, chunk_tokens=9), truth)
    naive = _errors(_naive(logits, targets, g_lp, g_h), truth)
    for key in head:
        assert head[key] <= max(naive[key], TOL), (key, head, naive)


class _LargestFp32(TorchDispatchMode):
    """Records the largest fp32 storage any op (forward or backward) produces."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("entropy", [True, False])
def test_never_materialises_full_fp32_logits(entropy):
    """Forward + backward on bf16 logits: no fp32 tensor larger than one chunk ``[c, V]``; the
    naive formula, seen through the same probe, makes ``[T, V]`` ones."""
    t, v, chunk = 64, 1000, 8
    logits, targets, g_lp, g_h = _case(t, v, seed=17, dtype=torch.bfloat16)
    for fn, bound in ((token_logprobs_and_entropy, chunk * v * 4), (naive_logprobs_and_entropy, None)):
        x = logits.clone().requires_grad_()
        kw = {"chunk_tokens": chunk, "temperature": 0.9, "compute_entropy": entropy} if bound else {}
        with _LargestFp32() as probe:
            lp, h = fn(x, targets, **kw)
            ((lp * g_lp).sum() + ((h * g_h).sum() if h is not None else 0.0)).backward()
        if bound:
            assert probe.nbytes == bound, (probe.nbytes, bound)
        else:
            assert probe.nbytes >= t * v * 4


# ---------------------------------------------------------------------------- bf16
def test_bf16_distance_to_fp32_naive(capsys):
    """bf16 logits in, fp32 statistics inside, bf16 gradient out. Reported: the distance to the fp32
    naive formula on the same (bf16-valued) logits and on the fp32 logits they were rounded from."""
    logits, targets, g_lp, g_h = _case(256, 4096, seed=11, scale=3.0)
    bf = logits.bfloat16()
    head = _run(token_logprobs_and_entropy, bf, targets, g_lp, g_h, chunk_tokens=100)
    assert head[0].dtype == torch.float32 and head[2].dtype == torch.bfloat16
    ref = _naive(bf.float(), targets, g_lp, g_h)
    same = _errors(head, ref)
    orig = _errors(head, _naive(logits, targets, g_lp, g_h))
    grad_scale = ref[2].abs().max().item()
    with capsys.disabled():
        print(
            f"\n[logprob head, bf16 logits] vs fp32 naive on the same values: {same}"
            f"\n[logprob head, bf16 logits] vs fp32 naive on the unrounded logits: {orig} (max |grad| {grad_scale:.3g})"
        )
    # the forward is fp32 arithmetic on the bf16 values: within the fp32 tolerance of the exact (fp64)
    # values. (Not of the fp32 naive formula: its entropy sums 4 096 fp32 products, in an order that
    # depends on the CPU's vector width - on an AMD EPYC with AVX-512 it lies 1.1e-6 past the
    # tolerance from fp64 itself.)
    exact = _naive(bf.double(), targets, g_lp, g_h)
    assert _close(head[0], exact[0]) and _close(head[1], exact[1]), _excess(head, exact)
    # the gradient is rounded once to bf16 (8 significant bits)
    assert same["grad"] <= grad_scale * 2.0**-8
    # what bf16 storage of the logits costs (input rounding, |x| <= ~15: ulp 0.0625)
    assert orig["logprob"] <= 0.1 and orig["entropy"] <= 0.05


@pytest.mark.parametrize("temperature", [1.0, 0.75])
def test_fused_and_separate_casts_agree_bitwise(monkeypatch, temperature):
    """The cast-fused path (CUDA's) and the separate-cast path (CPU's default for bf16) compute the
    same fp32 values and round the gradient once: bit-identical results."""
    from mcore_zoo.distributed import vocab_parallel

    logits, targets, g_lp, g_h = _case(40, 700, seed=13, scale=3.0, dtype=torch.bfloat16)
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(vocab_parallel, "FUSED_CASTS", fused)
        for entropy in (True, False):
            out[fused, entropy] = _run(
                token_logprobs_and_entropy, logits, targets, g_lp, g_h,
                temperature=temperature, chunk_tokens=9, compute_entropy=entropy,
            )  # fmt: skip
    for entropy in (True, False):
        for a, b in zip(out[True, entropy], out[False, entropy]):
            assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------------------- mutations
def test_mutations_fail_the_comparison():
    """The comparisons above can fail: a temperature off by 0.1%, the two upstream gradients swapped,
    or the wrong vocabulary offset (a TP rank that believes it is another) each exceed 1e-6."""
    logits, targets, g_lp, g_h = _case(37, 997, seed=1)
    ref = _naive(logits, targets, g_lp, g_h, temperature=0.7)
    wrong_t = _errors(_run(token_logprobs_and_entropy, logits, targets, g_lp, g_h, temperature=0.7007), ref)
    assert min(wrong_t.values()) > TOL, wrong_t
    swapped = _errors(_run(token_logprobs_and_entropy, logits, targets, g_h, g_lp, temperature=0.7), ref)
    assert swapped["grad"] > TOL, swapped
    shifted = _errors(_run(token_logprobs_and_entropy, logits, (targets + 1) % 997, g_lp, g_h, temperature=0.7), ref)
    assert shifted["logprob"] > TOL and shifted["grad"] > TOL, shifted


def test_without_autograd():
    logits, targets, _, _ = _case(10, 50, seed=19)
    ref = naive_logprobs_and_entropy(logits, targets)
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            lp, h = token_logprobs_and_entropy(logits.clone().requires_grad_(), targets, chunk_tokens=3)
        assert not lp.requires_grad and _close(lp, ref[0]) and _close(h, ref[1])


def test_rejects_bad_arguments():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(TypeError):
        token_logprobs_and_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, torch.zeros(4, dtype=torch.long), chunk_tokens=0)


# ---------------------------------------------------------------------------- TP2 on gloo
def _tp_rank(logits, targets, g_lp, g_h, temperature, chunk):
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    vl = logits.shape[-1] // size
    out = {}
    # "swapped": a rank that believes it owns the other slice (a mutation that must fail)
    for name, owner, entropy in (("tp", rank, True), ("tp-lp", rank, False), ("swapped", (rank + 1) % size, True)):
        shard = logits[:, owner * vl : (owner + 1) * vl].clone().requires_grad_()
        lp, h = token_logprobs_and_entropy(
            shard, targets, tp_group=group, temperature=temperature, chunk_tokens=chunk, compute_entropy=entropy
        )
        ((lp * g_lp).sum() + ((h * g_h).sum() if h is not None else 0.0)).backward()
        out[name] = (lp.detach(), h.detach() if h is not None else None, shard.grad)
    return out


@pytest.mark.slow
def test_tp2_gloo_matches_one_process(capsys):
    """Two gloo ranks, each with half the vocabulary: log-probs, entropy and the gathered logit
    gradients equal one process (and the naive formula); with entropy and without."""
    from mcore_zoo.distributed import launch

    t, v, temperature, chunk = 45, 2 * 501, 0.9, 8
    logits, targets, g_lp, g_h = _case(t, v, seed=21)
    # targets on both halves and at their edges, and one ignored position
    targets[:4] = torch.tensor([0, 500, 501, v - 1])
    targets[4] = -100
    one = _run(token_logprobs_and_entropy, logits, targets, g_lp, g_h, temperature=temperature, chunk_tokens=chunk)
    keep = targets >= 0
    zero = torch.zeros_like(g_h)
    naive = _naive(logits, targets.clamp(min=0), torch.where(keep, g_lp, 0.0), g_h, temperature=temperature)
    naive_lp = _naive(logits, targets.clamp(min=0), torch.where(keep, g_lp, 0.0), zero, temperature=temperature)
    ranks = launch(_tp_rank, 2, logits, targets, g_lp, g_h, temperature, chunk, backend="gloo")

    def gathered(name):
        lp, h, _ = ranks[0][name]
        for r in ranks[1:]:  # every rank has the full per-token results
            assert torch.equal(r[name][0], lp) and (h is None or torch.equal(r[name][1], h))
        return lp, h, torch.cat([r[name][2] for r in ranks], dim=-1)

    tp, tp_lp = gathered("tp"), gathered("tp-lp")
    with capsys.disabled():
        print(f"\n[logprob head, TP2 gloo] vs one process: {_errors(tp, one)}")
    assert max(_excess(tp, one).values()) <= TOL
    assert _close(tp[0][keep], naive[0][keep]) and _close(tp[1], naive[1]) and _close(tp[2], naive[2])
    assert tp_lp[1] is None
    assert _close(tp_lp[0], tp[0]) and _close(tp_lp[2], naive_lp[2])
    # mutation: the ranks swap their vocabulary slices (a wrong vocab offset) -> must differ
    assert (gathered("swapped")[0] - one[0]).abs().max() > TOL


# ---------------------------------------------------------------------------- Triton kernels
_TRITON_CHECK = r"""
import torch
from mcore_zoo.distributed import vocab_parallel as vp
from mcore_zoo.distributed.vocab_parallel import naive_logprobs_and_entropy, token_logprobs_and_entropy
vp.USE_TRITON = True
worst = 0.0
for dtype, v in ((torch.float32, 5003), (torch.bfloat16, 4096)):
    for temperature in (1.0, 0.7):
        for entropy in (True, False):
            for inplace in (False, True):
                gen = torch.Generator().manual_seed(1)
                logits = (torch.randn(23, v, generator=gen) * 3).to(dtype)
                targets = torch.randint(0, v, (23,), generator=gen)
                targets[4] = -100
                g, h = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
                x = logits.clone().requires_grad_()
                y = x * 1  # inplace_backward needs a non-leaf
                lp, ent = token_logprobs_and_entropy(y, targets, temperature=temperature,
                                                     compute_entropy=entropy, inplace_backward=inplace)
                ((lp * g).sum() + ((ent * h).sum() if entropy else 0.0)).backward()
                ref = logits.double().requires_grad_()
                ok = targets >= 0
                rlp, rent = naive_logprobs_and_entropy(ref, targets.clamp(min=0), temperature=temperature)
                rlp = torch.where(ok, rlp, 0.0)
                ((rlp * g.double()).sum() + ((rent * h.double()).sum() if entropy else 0.0)).backward()
                assert torch.equal(lp[4], torch.tensor(0.0)), lp[4]
                errs = [(lp.double() - rlp).abs().max().item(),
                        (x.grad.double() - ref.grad).abs().max().item() / ref.grad.abs().max().item()]
                if entropy:
                    errs.append((ent.double() - rent).abs().max().item())
                bound = 1e-5 if dtype == torch.float32 else 2.0 ** -7
                assert max(errs) <= bound, (dtype, temperature, entropy, inplace, errs)
                worst = max(worst, errs[0])
print("ok", worst)
"""


def test_triton_kernels_against_fp64_in_interpreter():
    """The head with its Triton kernels (``USE_TRITON``), run by Triton's CPU interpreter: log-probs,
    entropy and gradients against the fp64 formula, fp32 and bf16, temperatures, in-place
    backward, an ignored target. On CUDA the same kernels are the default
    (``tests/gpu/test_logprob_head_gpu.py``)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (CUDA builds of torch ship it; the CPU wheel does not)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    if "scope.set_attr(tensor, \"__index__\"" in run.stderr and "only 0-dimensional arrays" in run.stderr:
        # the interpreter's own __index__ of a runtime scalar (a loop bound) fails under numpy 2.4+
        # (seen with Triton 3.6); compiled kernels (the GPU test) are unaffected
        import numpy
        import triton

        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot take a runtime loop bound with numpy {numpy.__version__}")
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]
