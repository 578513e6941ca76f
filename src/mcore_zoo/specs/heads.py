"""Output heads other than the language-model head.

:class:`ValueHead` replaces ``GPTModel.output_layer`` in a model built with ``head="value"``
(a critic): one scalar per token, ``hidden @ weight.T + bias`` with ``weight [1, hidden]`` and
``bias [1]`` - transformers' ``*ForTokenClassification`` ``score`` layer with ``num_labels=1``, as
RL critics (verl) save it. It is called like Megatron-Core's output layer
(``(hidden, weight=None, runtime_gather_output=None) -> (out, None)``), so ``GPTModel``'s forward is
unchanged and returns ``[b, s, 1]`` instead of vocabulary logits.

Tensor parallelism: width 1 cannot be split, so the head is replicated on every TP rank (its
parameters carry ``tensor_model_parallel=False``). Every rank computes every token's value from the
full hidden states, so its gradient (and the gradient flowing back into the decoder) is complete on
each rank without a reduction. Under sequence parallelism the hidden states are first gathered
along the sequence with a backward that keeps each rank's own slice (not a reduce-scatter: the
gradient is already whole on every rank).

No dropout: transformers' token-classification head applies ``classifier_dropout`` in training mode
(RL critics set it to 0).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

#: ``value_head_init`` values: how a head absent from the checkpoint is initialised
VALUE_HEAD_INITS = ("zeros", "normal")


class ValueHead(torch.nn.Module):
    """A replicated ``hidden -> 1`` linear layer standing in for ``GPTModel.output_layer``."""

    def __init__(self, config: Any, init: Optional[str] = None, tp_group: Any = None) -> None:
        super().__init__()
        dtype = config.params_dtype
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_group = tp_group  # the model's tensor-parallel group (None: parallel_state's)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        for p in (self.weight, self.bias):
            setattr(p, "tensor_model_parallel", False)
        with torch.no_grad():
            if init == "normal" or (init is None and config.perform_initialization):
                # the same values on every rank (the head is replicated): a fixed generator
                generator = torch.Generator().manual_seed(0)
                values = torch.randn(self.weight.shape, generator=generator) * config.init_method_std
                self.weight.copy_(values)
            else:  # "zeros"; or left for a checkpoint to fill (the load fails if it has no head)
                self.weight.zero_()

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:  # fmt: skip
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                                 group=self.tp_group)  # fmt: skip
        return F.linear(hidden_states, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets)


__all__ = ["ValueHead", "VALUE_HEAD_INITS"]
