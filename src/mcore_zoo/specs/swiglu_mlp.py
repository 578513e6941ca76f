"""The dense MLP with its SwiGLU through :func:`mcore_zoo.kernels.swiglu.swiglu` (numerics knob
``swiglu_kernel="triton"``): Megatron-Core's ``MLP`` (``linear_fc1`` = ``[gate; up]``, then
``linear_fc2``) with the unfused activation's arithmetic - ``silu(gate) * (up + glu_linear_offset)``,
each op rounded as torch rounds it - in one pass each way."""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.mlp import MLP

from ..errors import ZooError
from ..kernels.triton_rows import refuse_off_device, refuse_without_triton


class TritonSwiGLUMLP(MLP):
    """mcore's dense MLP, its SwiGLU in one Triton pass (module docstring)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None,
                **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
        from ..kernels import swiglu

        if per_token_scale is not None or getattr(self.config, "activation_func_clamp_value", None) is not None:
            raise ZooError("swiglu_kernel='triton' computes the plain SwiGLU (no per-token scale, no clamp); use swiglu_kernel='torch'")
        x, bias = self.linear_fc1(hidden_states)
        if bias is not None:  # as Megatron-Core's unfused path: the bias first
            x = x + bias
        refuse_off_device("swiglu_kernel", x)
        return self.linear_fc2(swiglu.swiglu(x, getattr(self.config, "glu_linear_offset", 0.0)))


def mlp_piece(arch: Any, numerics: Any) -> dict[str, Any]:
    """``{"mlp": TritonSwiGLUMLP}`` for the layer spec's pieces where the knob asks for it (after its
    refusals), else ``{}``."""
    if numerics.swiglu_kernel != "triton":
        return {}
    from ..kernels import swiglu

    if arch.moe is not None:
        raise ZooError(f"{arch.architecture}: swiglu_kernel='triton' replaces dense MLPs' activation; this model's"
                       " MoE experts compute theirs elsewhere - use swiglu_kernel='torch'")  # fmt: skip
    if arch.activation != "silu" or not arch.gated_linear_unit:
        raise ZooError(f"{arch.architecture}: swiglu_kernel='triton' computes SwiGLU, not activation={arch.activation!r}"
                       f" (gated {arch.gated_linear_unit})")  # fmt: skip
    refuse_without_triton("swiglu_kernel", swiglu.available())
    return {"mlp": TritonSwiGLUMLP}
