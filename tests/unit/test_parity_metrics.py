"""Parity metrics on hand-made distributions (values computed independently here)."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_zoo.numerics.metrics import (
    TOLERANCES,
    Predictions,
    check_tolerance,
    first_divergent_site,
    histogram,
    layer_metrics,
    logprob_metrics,
)


def _logits(seed, shape=(6, 11)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_identical_predictions_are_bitwise_with_zero_error():
    tokens = [torch.tensor([1, 4, 2, 9, 0, 3]), torch.tensor([5, 5, 7])]
    logits = [_logits(0), _logits(1, (3, 11))]
    m = logprob_metrics(Predictions(tokens, logits=logits), Predictions(tokens, logits=[l.clone() for l in logits]))
    assert m["bitwise_equal"] and m["positions"] == 5 + 2
    assert m["mean_abs_dlogp"] == m["max_abs_dlogp"] == m["kl_mean"] == 0.0
    assert m["top1_agreement"] == 1.0 and m["token_mult_prob_error"] == 1.0
    assert m["histogram"]["zero"] == 7 and m["worst_tokens"] == []


def test_metrics_match_a_direct_computation():
    tokens = [torch.tensor([3, 1, 4, 1, 5, 9])]
    ref, cand = _logits(2), _logits(3)
    m = logprob_metrics(Predictions(tokens, logits=[ref]), Predictions(tokens, logits=[cand]), worst=3)
    lr, lc = torch.log_softmax(ref[:-1].double(), -1), torch.log_softmax(cand[:-1].double(), -1)
    target = tokens[0][1:, None]
    d = (lc.gather(-1, target) - lr.gather(-1, target)).abs().squeeze(-1)
    kl = (lr.exp() * (lr - lc)).sum(-1)
    assert m["mean_abs_dlogp"] == pytest.approx(d.mean().item(), rel=1e-5)
    assert m["max_abs_dlogp"] == pytest.approx(d.max().item(), rel=1e-5)
    assert m["p99_abs_dlogp"] == pytest.approx(d.max().item(), rel=1e-5)  # nearest rank of 5 values
    assert m["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert m["top1_agreement"] == pytest.approx((lr.argmax(-1) == lc.argmax(-1)).double().mean().item())
    assert m["token_mult_prob_error"] == pytest.approx(d.exp().mean().item(), rel=1e-6)
    worst = m["worst_tokens"]
    assert len(worst) == 3 and worst[0]["position"] == int(d.argmax()) and worst[0]["sequence"] == 0
    assert worst[0]["next_token"] == int(tokens[0][worst[0]["position"] + 1])


def test_top_k_candidate_without_full_distribution_has_no_kl():
    tokens = [torch.tensor([0, 2, 1, 3])]
    ref = _logits(4, (4, 5))
    rows = torch.log_softmax(ref[:-1].float(), -1)
    lp = rows.gather(-1, tokens[0][1:, None]).squeeze(-1)
    cand = Predictions(tokens, logprobs=[lp + 1e-3], top1=[rows.argmax(-1)])
    m = logprob_metrics(Predictions(tokens, logits=[ref]), cand)
    assert m["kl_mean"] is None and m["top1_agreement"] == 1.0 and not m["bitwise_equal"]
    assert m["mean_abs_dlogp"] == pytest.approx(1e-3, rel=1e-3)


def test_histogram_decades():
    h = histogram(torch.tensor([0.0, 0.0, 3e-7, 5e-7, 0.02, 7.0, 1e-12]))
    assert h["zero"] == 2
    counts = dict(zip(h["decades"], h["counts"]))
    assert counts[-7] == 2 and counts[-2] == 1 and counts[0] == 1 and counts[-9] == 1  # clamped to the range
    assert sum(h["counts"]) == 5


def test_tolerance_check_and_baseline_relaxation():
    tol = TOLERANCES["bfloat16"]
    metrics = {"mean_abs_dlogp": 0.08, "kl_mean": 0.01, "top1_agreement": 0.76}
    assert check_tolerance(metrics, tol) == ["mean_abs_dlogp 0.08 > 0.05", "top1_agreement 0.7600 < 0.8"]
    relaxed = tol.relaxed_by({"mean_abs_dlogp": 0.065, "kl_mean": 0.004, "top1_agreement": 0.82})
    assert relaxed.mean_abs_dlogp == pytest.approx(0.13) and relaxed.kl_mean == 0.02
    assert relaxed.top1_min == pytest.approx(0.64)
    assert check_tolerance(metrics, relaxed) == []
    assert TOLERANCES["float32"].relaxed_by({"mean_abs_dlogp": 1.0}) == TOLERANCES["float32"]
    with pytest.raises(ValueError, match="unknown tolerance"):
        tol.with_overrides(mean=1.0)


def test_layer_metrics_flag_and_first_divergent_site():
    ref = {s: [torch.ones(4, 8), torch.ones(2, 8)] for s in ("embedding", "layer.0", "layer.1")}
    cand = {s: [t.clone() for t in ts] for s, ts in ref.items()}
    cand["layer.1"][1][0, 0] += 0.5
    rows = layer_metrics(ref, cand, bitwise=True, hidden_rel=1e-4)
    assert [r["flagged"] for r in rows] == [False, False, True]
    assert first_divergent_site(rows) == "layer.1"
    assert rows[2]["max_abs"] == 0.5 and rows[2]["mean_abs"] == pytest.approx(0.5 / 48)
    assert rows[0]["cosine_min"] == 1.0 and rows[2]["cosine_min"] < 1.0
    tolerant = layer_metrics(ref, cand, bitwise=False, hidden_rel=0.1)
    assert first_divergent_site(tolerant) is None
    assert math.isclose(tolerant[2]["rel_mean_abs"], 0.5 / 48)
