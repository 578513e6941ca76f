"""A CPU stand-in for Transformer Engine's grouped linears, so that Megatron-Core's real
``TEGroupedMLP`` (and the zoo's ``HFOrderTEGroupedMLP``) can be built and run without TE.

Transformer Engine is not installed on the CPU machines, and ``TEGroupedMLP`` builds its two
projections from ``megatron.core.extensions.transformer_engine.TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (wrappers of ``transformer_engine.pytorch.GroupedLinear``). These
stand-ins have exactly what the zoo's weight rules and Megatron-Core's ``TEGroupedMLP`` see of
them, read from TE's ``module/grouped_linear.py`` (2.x up to 2.20.0.dev0) and Megatron-Core's
wrappers (0.16.1 and 0.19.2 ``extensions/transformer_engine.py``):

* constructor ``(num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
  is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None)``; the wrapper divides the
  output (column) or input (row) size by the expert-TP size itself and gives TE ``tp_size=1``;
* parameters ``weight{i}`` ``[out_features, in_features]`` for ``i`` in ``range(num_gemms)``, and
  ``bias{i}`` ``[out_features]`` only with ``bias=True`` (without, TE sets a plain empty tensor
  attribute, not a parameter);
* attributes as Megatron-Core 0.19's ``_set_expert_parameter_attributes`` leaves them: every
  weight ``tensor_model_parallel`` with ``partition_dim`` 0 (column) / 1 (row), column biases
  split along 0, row biases replicated, ``allreduce = not (ep > 1 or etp != tp)``;
* ``forward(x, m_splits) -> (out, bias)``: rows of ``x`` split by ``m_splits``, split ``i``
  multiplied by ``weight{i}``; with ``skip_bias_add`` and a bias, the per-GEMM biases are
  returned as a list (TE's ``return_bias``), else added (or ``None``).

The GEMM is ``torch.matmul(x_i, weight_i.t())``, the op Megatron-Core's ``ColumnParallelLinear`` /
``RowParallelLinear`` run on the CPU, so a grouped model with these stand-ins computes each
expert exactly as the sequential model does: what that checks is everything around the GEMMs
(the zoo's rules, loading, export, expert parallelism, ``TEGroupedMLP``'s activation and the
HF-order weighting). It says nothing about TE's grouped GEMM kernels: ``tests/gpu`` runs those.

:func:`installed` puts the stand-ins where Megatron-Core's ``TESpecProvider`` finds TE's classes,
and lets ``check_grouped_experts`` accept the CPU ``local`` / ``portable`` backends; nothing else of
the zoo or Megatron-Core is replaced.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Optional

import torch


class _StandInGroupedLinear(torch.nn.Module):
    parallel_mode = ""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Any,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str] = None,
                 pg_collection: Any = None, name: Optional[str] = None) -> None:  # fmt: skip
        super().__init__()
        from megatron.core import parallel_state as ps

        assert is_expert, "TEGroupedLinear only supports expert parallelism"
        etp_group = pg_collection.expt_tp if pg_collection is not None else ps.get_expert_tensor_parallel_group()
        etp = etp_group.size() if etp_group is not None else 1
        if self.parallel_mode == "column":
            output_size //= etp
        else:
            input_size //= etp
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.use_bias, self.return_bias = bias, bias and skip_bias_add
        use_expert_pgs = config.expert_model_parallel_size > 1 or (
            (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) != config.tensor_model_parallel_size
        )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
            if config.perform_initialization:
                with torch.no_grad():
                    init_method(weight)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=config.params_dtype, device=device))
        for pname, param in self.named_parameters(recurse=False):
            param.allreduce = not use_expert_pgs
            split = pname.startswith("weight") or self.parallel_mode == "column"
            param.tensor_model_parallel = split
            if split:
                param.partition_dim = 1 if self.parallel_mode == "row" else 0
                param.partition_stride = 1

    def forward(self, x: torch.Tensor, m_splits: list) -> tuple[torch.Tensor, Any]:
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        outs = []
        for i, rows in enumerate(torch.split(x.reshape(-1, self.in_features), list(m_splits))):
            out = torch.matmul(rows, getattr(self, f"weight{i}").t())
            if self.use_bias and not self.return_bias:
                out = out + getattr(self, f"bias{i}")
            outs.append(out)
        out = torch.cat(outs).view(*x.shape[:-1], self.out_features)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out, None

    def backward_dw(self) -> None:
        pass


class StandInColumnParallelGroupedLinear(_StandInGroupedLinear):
    parallel_mode = "column"


class StandInRowParallelGroupedLinear(_StandInGroupedLinear):
    parallel_mode = "row"


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The stand-ins in Megatron-Core's TE spec provider, and ``check_grouped_experts`` accepting
    any backend on the CPU (see the module docstring); restored on exit."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider

    from mcore_zoo.families.moe import config as moe

    saved = (provider.TEColumnParallelGroupedLinear, provider.TERowParallelGroupedLinear, moe.check_grouped_experts)
    provider.TEColumnParallelGroupedLinear = StandInColumnParallelGroupedLinear
    provider.TERowParallelGroupedLinear = StandInRowParallelGroupedLinear
    moe.check_grouped_experts = lambda arch, backend, cuda=True: None
    try:
        yield
    finally:
        provider.TEColumnParallelGroupedLinear, provider.TERowParallelGroupedLinear, moe.check_grouped_experts = saved


_GROUPED = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc[12])\.weight(\d+)")
_SEQUENTIAL = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


def expert_gradients(model: torch.nn.Module) -> dict:
    """``{(layer, projection, expert): gradient}`` of every routed-expert weight of a decoder,
    grouped (``linear_fc1.weight{i}``) or sequential (``local_experts.{i}.linear_fc1.weight``), so
    the two can be compared key by key."""
    out = {}
    for name, param in model.named_parameters():
        if m := _GROUPED.fullmatch(name):
            out[(int(m.group(1)), m.group(2), int(m.group(3)))] = param.grad
        elif m := _SEQUENTIAL.fullmatch(name):
            out[(int(m.group(1)), m.group(3), int(m.group(2)))] = param.grad
        else:
            assert ".mlp.experts." not in name, f"an expert parameter of unknown layout: {name}"
    return out
