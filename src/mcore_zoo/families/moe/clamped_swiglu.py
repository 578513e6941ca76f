"""gpt-oss experts in transformers' layout and op order: a clamped SwiGLU on gate / up columns that
alternate, with biases on both projections.

transformers' ``GptOssExperts`` computes, per expert, ``h = x @ gate_up_proj + gate_up_proj_bias``
with ``gate_up_proj [H, 2I]`` (gate in the even columns, up in the odd ones), then
``gate = h[..., ::2].clamp(max=limit)``, ``up = h[..., 1::2].clamp(-limit, limit)``,
``(up + 1) * (gate * sigmoid(gate * alpha))``, then ``@ down_proj [I, H] + down_proj_bias``.
Megatron-Core's expert ``MLP`` computes the same math (``quick_gelu``, ``glu_linear_offset=1``,
``activation_func_clamp_value``) from its own layout - ``linear_fc1.weight [2I, H]``, gate rows
then up rows - but a CPU GEMM's result for an output column can depend on the weight's layout and
the column's place in it, so :func:`clamped_swiglu_expert` multiplies by the weights laid out as
transformers holds them (a copy per call): exact where transformers' experts are, at the cost of
that copy. Under expert tensor parallelism it runs the stock ``MLP`` (partial sums are reduced
across ranks there anyway).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_zoo.config.arch import ClampedSwiGLU
from mcore_zoo.placement import group_size
from mcore_zoo.weights.rules import interleave_halves


def clamped_swiglu(gate_up: torch.Tensor, swiglu: ClampedSwiGLU) -> torch.Tensor:
    """transformers' ``GptOssExperts._apply_gate`` on alternating gate / up columns."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=swiglu.limit)
    up = up.clamp(min=-swiglu.limit, max=swiglu.limit)
    glu = gate * torch.sigmoid(gate * swiglu.alpha)
    return (up + 1) * glu


def clamped_swiglu_expert(expert: Any, rows: torch.Tensor, swiglu: ClampedSwiGLU) -> torch.Tensor:
    """One expert (Megatron-Core's expert ``MLP``) on ``rows [n, H]``, with its fc2 bias added, as
    transformers computes it (module docstring). Differentiable."""
    fc1, fc2 = expert.linear_fc1, expert.linear_fc2
    group = getattr(fc1, "tp_group", None)
    if (group is not None and group_size(group) != 1) or fc1.bias is None or fc2.bias is None:
        output, bias = expert(rows)
        return output if bias is None else output + bias
    up_weight = interleave_halves(fc1.weight).t().contiguous()  # [H, 2I], transformers' gate_up_proj
    gate_up = rows @ up_weight + interleave_halves(fc1.bias)
    down_weight = fc2.weight.t().contiguous()  # [I, H], transformers' down_proj
    return clamped_swiglu(gate_up, swiglu) @ down_weight + fc2.bias
