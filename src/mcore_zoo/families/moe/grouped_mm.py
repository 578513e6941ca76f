"""The routed experts as transformers' ``grouped_mm`` experts compute them: every expert's rows in
one grouped GEMM per projection over the experts' stacked weights.

transformers 5's default experts implementation (``grouped_mm_experts_forward``) sorts a batch's
(token, slot) rows by expert, then calls ``torch.nn.functional.grouped_mm`` (or its own per-expert
``torch.mm`` fallback, where the grouped kernel cannot run) on ``gate_up_proj`` and ``down_proj``
(``[E, out, in]``, transposed views) with the experts' row offsets. On CUDA that is a grouped GEMM
kernel of its own, not the cuBLAS GEMM a per-expert ``F.linear`` runs: the two can sum a row's
products in another order (measured on the GPU: Mixtral-8x22B's experts not bitwise at 4 x 512
tokens). :func:`grouped_experts_apply` runs the same call on the same tensors - the zoo's expert weights
stacked as transformers stores them, the rows in its order (``run_in_reference_order``), its
offsets - through transformers' own dispatcher when this transformers has one.

The stacked weights are a copy of every local expert's weights (at Qwen3-30B-A3B's widths 1.2 GB per
layer), and autograd keeps it for the backward. Where one MoE block runs a THD pack one sequence at
a time (``hf-exact``), :func:`shared_expert_stacks` makes the stacks once per block call and every
sequence's GEMMs use them: one copy per layer, not one per layer and sequence.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch

#: the dtypes torch's grouped GEMM takes (other dtypes, fp64, run one expert at a time)
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _own_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers 5.24's ``_grouped_mm`` choice: ``torch.nn.functional.grouped_mm`` where it runs
    (CPU; CUDA of compute capability 8.0 and up), else one ``torch.mm`` per expert."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    usable = grouped is not None and (weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) >= (8, 0))
    if usable:
        return grouped(input.to(weight.dtype), weight, offs=offs)
    output = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=weight.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            output[start:end] = torch.mm(input[start:end].to(weight.dtype), weight[i])
        start = end
    return output


def reference_grouped_mm() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """transformers' own grouped GEMM dispatcher (``transformers.integrations.moe._grouped_mm``:
    the kernel the reference picks), or :func:`_own_grouped_mm` where this transformers has none."""
    try:
        from transformers.integrations.moe import _grouped_mm
    except ImportError:
        return _own_grouped_mm
    return _grouped_mm


_STACKS = threading.local()


@contextlib.contextmanager
def shared_expert_stacks() -> Iterator[None]:
    """Inside the block, :func:`grouped_experts_apply`'s ``run`` stacks each experts module's
    weights at its first call and reuses them at the next ones (same tensors, same grad mode), so
    the sequences of one pack share one stacked copy (and its one node in the autograd graph, whose
    backward hands each expert the sum of the sequences' gradients). The weights must not change
    inside the block; nested blocks share the outer one's stacks."""
    outer = getattr(_STACKS, "cache", None)
    if outer is None:
        _STACKS.cache = {}
    try:
        yield
    finally:
        if outer is None:
            _STACKS.cache = None


def _stacked(local: list, parameter: str) -> torch.Tensor:
    """``torch.stack`` of every local expert's ``parameter`` (``linear_fc1`` / ``linear_fc2``)
    weight, made once per :func:`shared_expert_stacks` block (keyed on the weights themselves and
    the grad mode), else at every call."""
    weights = [getattr(e, parameter).weight for e in local]
    cache = getattr(_STACKS, "cache", None)
    if cache is None:
        return torch.stack(weights)
    key = (tuple(id(w) for w in weights), torch.is_grad_enabled())
    hit = cache.get(key)
    if hit is not None and all(w._version == v for w, v in zip(weights, hit[1])):
        return hit[0]
    stacked = torch.stack(weights)
    cache[key] = (stacked, [w._version for w in weights], weights)  # the weights kept: their ids stay theirs
    return stacked


def _adds_bias(linear: Any) -> bool:
    """Whether ``linear`` adds a bias: a tensor with elements. Megatron-Core's linears without one
    hold ``None``, Transformer Engine's an empty tensor."""
    bias = getattr(linear, "bias", None)
    return isinstance(bias, torch.Tensor) and bias.numel() > 0


def grouped_experts_apply(experts: Any) -> Optional[Callable[[torch.Tensor, list[int]], torch.Tensor]]:
    """``run(rows, counts) -> output`` computing Megatron-Core's ``local_experts`` (expert ``MLP``\\ s
    of gated linears without biases, on one tensor-parallel rank) as transformers' ``grouped_mm``
    experts: ``rows [R, H]`` grouped by expert (``counts[e]`` rows of expert ``e``, in order) ->
    ``[R, H]`` before the routing weights. ``None`` where the experts are not of that form (biases,
    experts split over tensor-parallel ranks, no gated linear unit): they then run one by one.
    Megatron-Core's and Transformer Engine's linears alike (the ``te`` backend's experts too).
    Differentiable."""
    local = list(experts)
    if not local:
        return None
    for expert in local:
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        if not expert.config.gated_linear_unit or _adds_bias(fc1) or _adds_bias(fc2):
            return None
        group = getattr(fc1, "tp_group", None)
        if group is not None and group.size() != 1:
            return None
    activation = local[0].config.activation_func
    grouped_mm = reference_grouped_mm()

    def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up_proj = _stacked(local, "linear_fc1")  # [E, 2I, H], transformers' layout
        down_proj = _stacked(local, "linear_fc2")  # [E, H, I]
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        gate_up = grouped_mm(rows, gate_up_proj.transpose(-2, -1), offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return grouped_mm(activation(gate) * up, down_proj.transpose(-2, -1), offsets)

    return run


__all__ = ["GROUPED_MM_DTYPES", "grouped_experts_apply", "reference_grouped_mm", "shared_expert_stacks"]
