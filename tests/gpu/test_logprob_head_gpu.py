"""CUDA: the chunked log-prob / entropy head is exact, never synchronises with the host, and needs
less memory than Megatron-Core's ``labels`` path (``vocab_parallel_cross_entropy``).

CPU counterparts: ``tests/unit/test_logprob_head.py`` (exactness, TP2, mutations)."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.distributed import vocab_parallel
from mcore_zoo.distributed.vocab_parallel import naive_logprobs_and_entropy, token_logprobs_and_entropy

pytestmark = pytest.mark.gpu


def _case(t, v, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(t, v, generator=gen, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen, device="cuda")
    return logits, targets, torch.randn(t, generator=gen, device="cuda"), torch.randn(t, generator=gen, device="cuda")


def _run(fn, logits, targets, g, h, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x, targets, **kw)
    ((lp * g).sum() + ((ent * h).sum() if ent is not None else 0.0)).backward()
    return lp.detach(), (ent.detach() if ent is not None else None), x.grad


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_exact_against_fp64(temperature, triton, monkeypatch):
    """fp32 logits: the head (its Triton kernels, the CUDA default, and the torch path) is within
    1e-5 of the formula in fp64 (log-probs down to ~ -30) and no further from it than the naive
    fp32 formula plus 2e-6."""
    monkeypatch.setattr(vocab_parallel, "USE_TRITON", triton)
    logits, targets, g, h = _case(512, 32000, torch.float32)
    kw = dict(temperature=temperature)
    head = _run(token_logprobs_and_entropy, logits, targets, g, h, chunk_tokens=100, **kw)
    naive = _run(naive_logprobs_and_entropy, logits, targets, g, h, **kw)
    truth = _run(naive_logprobs_and_entropy, logits.double(), targets, g.double(), h.double(), **kw)
    for a, b, c in zip(head, naive, truth):
        err_head, err_naive = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        assert err_head <= 1e-5 and err_head <= err_naive + 2e-6, (err_head, err_naive)


def test_bf16_triton_and_torch_paths_agree(monkeypatch):
    """bf16 logits: the Triton kernels and the torch path give the same log-probs and entropy up to
    fp32 summation order, and gradients within half a bf16 ulp of each row's largest gradient."""
    logits, targets, g, h = _case(2048, 151936, torch.bfloat16)
    out = {}
    for triton in (True, False):
        monkeypatch.setattr(vocab_parallel, "USE_TRITON", triton)
        out[triton] = _run(token_logprobs_and_entropy, logits, targets, g, h, temperature=0.8)
    (lp1, e1, g1), (lp0, e0, g0) = out[True], out[False]
    assert (lp1 - lp0).abs().max() <= 1e-5 and (e1 - e0).abs().max() <= 1e-5
    # per element the entropy term e (c0 + h (z - M)) can cancel, so bound at each row's scale
    scale = g0.float().abs().amax(dim=-1, keepdim=True)
    assert ((g1.float() - g0.float()).abs() <= scale * 2.0**-8).all()


def test_bf16_and_casts_fused_or_not_bitwise(monkeypatch):
    monkeypatch.setattr(vocab_parallel, "USE_TRITON", False)
    logits, targets, g, h = _case(512, 32000, torch.bfloat16)
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(vocab_parallel, "FUSED_CASTS", fused)
        out[fused] = _run(token_logprobs_and_entropy, logits, targets, g, h, chunk_tokens=100, temperature=0.8)
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    ref = _run(naive_logprobs_and_entropy, logits.float(), targets, g, h, temperature=0.8)
    assert (out[True][0] - ref[0]).abs().max() <= 1e-5 and (out[True][1] - ref[1]).abs().max() <= 1e-5
    assert out[True][2].dtype == torch.bfloat16
    assert (out[True][2].float() - ref[2]).abs().max() <= ref[2].abs().max() * 2.0**-8


def test_no_host_synchronisation():
    logits, targets, g, h = _case(256, 8000, torch.bfloat16)
    x = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = token_logprobs_and_entropy(x, targets, chunk_tokens=64, temperature=0.9)
        ((lp * g).sum() + (ent * h).sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_less_memory_than_the_labels_path():
    """bf16 logits [4096, 32000], log-prob only: held between forward and backward and at the peak,
    the head needs less than ``vocab_parallel_cross_entropy`` (which keeps an fp32 softmax)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel()
    t, v = 4096, 32000
    logits, targets, g, _ = _case(t, v, torch.bfloat16)
    stats = {}
    for name in ("head", "labels"):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if name == "head":
            lp, _ = token_logprobs_and_entropy(x, targets, compute_entropy=False, chunk_tokens=256)
        else:
            lp = -vocab_parallel_cross_entropy(x, targets)
        held = torch.cuda.memory_allocated() - start
        (lp * g).sum().backward()
        torch.cuda.synchronize()
        stats[name] = (held, torch.cuda.max_memory_allocated() - start)
        del x, lp
    head, labels = stats["head"], stats["labels"]
    assert head[0] < 64 * t  # per-token statistics only
    assert labels[0] >= 4 * t * v  # the fp32 softmax
    assert head[1] < labels[1] - 2 * t * v, stats
