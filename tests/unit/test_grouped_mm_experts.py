"""``grouped_experts_apply`` (transformers' ``grouped_mm`` experts on the zoo's expert weights) takes
experts whose linears add no bias - Megatron-Core's hold ``None`` there, Transformer Engine's an
empty tensor (the ``te`` backend's experts) - and refuses experts with a bias."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mcore_zoo.families.moe.grouped_mm import grouped_experts_apply


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.bias = bias


class _Expert(torch.nn.Module):
    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, bias) -> None:
        super().__init__()
        self.config = SimpleNamespace(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
        self.linear_fc1 = _Linear(fc1, bias() if callable(bias) else bias)
        self.linear_fc2 = _Linear(fc2, bias() if callable(bias) else bias)


def _experts(bias, hidden=16, ffn=8, count=3, seed=0):  # grouped_mm: 16-byte strides
    gen = torch.Generator().manual_seed(seed)
    return [_Expert(torch.randn(2 * ffn, hidden, generator=gen), torch.randn(hidden, ffn, generator=gen), bias)
            for _ in range(count)]  # fmt: skip


def _per_expert(experts, rows, counts):
    outputs = []
    for expert, x in zip(experts, torch.split(rows, counts)):
        gate, up = torch.nn.functional.linear(x, expert.linear_fc1.weight).chunk(2, dim=-1)
        outputs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, expert.linear_fc2.weight))
    return torch.cat(outputs)


def test_experts_without_a_bias_run_grouped_whether_it_is_none_or_an_empty_tensor():
    rows = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    counts = [3, 0, 4]
    for bias in (None, torch.Tensor):  # Megatron-Core's linears; Transformer Engine's (torch.Tensor(): empty)
        experts = _experts(bias)
        run = grouped_experts_apply(experts)
        assert run is not None, bias
        torch.testing.assert_close(run(rows, counts), _per_expert(experts, rows, counts), rtol=1e-5, atol=1e-5)


def test_experts_with_a_bias_are_refused():
    assert grouped_experts_apply(_experts(lambda: torch.zeros(4))) is None
