"""Megatron-Core linears that add the bias inside the GEMM, as ``torch.nn.Linear`` does.

mcore's ``ColumnParallelLinear`` computes ``matmul(x, W.T)``, rounds it to the output dtype, then
adds the bias (and MLP / output projections return the bias to be added later still). HF's
``nn.Linear`` calls ``F.linear(x, W, b)``, whose GEMM adds the bias in the fp32 epilogue before the
single rounding. In bf16 the two differ (measured: Qwen2's q/k/v biases alone move mean |dlogp| to
9e-2). These subclasses keep mcore's tensor-parallel plumbing (sequence-parallel all-gather,
tensor-parallel gradient all-reduce) and compute ``F.linear(x, W, b)``.

Used by the ``numerics.linear_bias == "fused"`` knob (the ``hf-exact`` profiles). Inside a decoder
layer that keeps its THD pack's bounds (``pack_gemms="each"``), both compute the pack one sequence
at a time (:func:`mcore_zoo.specs.pack_rows.linear_each_sequence`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .pack_rows import PerSequenceGEMM, linear_each_sequence


def _linear_fused_bias(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    tp_group: Any = None,
    **_: Any,
) -> torch.Tensor:
    """mcore's ``linear_with_grad_accumulation_and_async_allreduce`` contract, bias in the GEMM."""
    if gradient_accumulation_fusion:
        raise ValueError("linear_bias='fused' does not support gradient_accumulation_fusion")
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return linear_each_sequence(input, weight, bias)


class FusedBiasColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` computing ``F.linear(x, W, b)``; never returns a deferred bias."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_bias_add = False  # the bias goes into the GEMM; callers receive bias=None

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _linear_fused_bias(input, weight, *args, **kwargs)


class FusedBiasRowParallelLinear(PerSequenceGEMM, RowParallelLinear):
    """``RowParallelLinear`` computing ``F.linear(x, W, b)`` when the whole sum is on one rank.

    Under tensor parallelism the bias must be added after the cross-rank reduction, as mcore does;
    then this behaves exactly like ``RowParallelLinear`` (its GEMM per sequence as
    :class:`~mcore_zoo.specs.pack_rows.PerSequenceGEMM`'s).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.bias is None or self.tp_group.size() > 1 or self.sequence_parallel or self.explicit_expert_comm:
            return super().forward(input_)
        return linear_each_sequence(input_, self.weight, self.bias), None
