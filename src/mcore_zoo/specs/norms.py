"""Normalisation modules used in zoo layer specs.

:class:`HFRMSNorm` computes RMSNorm in the order transformers' ``LlamaRMSNorm`` (and the Mistral,
Qwen2, Qwen3 copies) does: upcast to fp32, normalise, cast back to the input dtype, then multiply
by the weight in the weight's dtype. Megatron-Core's and TE's RMSNorm multiply the weight before
the final cast, which in bf16 rounds differently (measured: most of the bf16 logit gap to HF).
:class:`ZeroCenteredRMSNorm` is Qwen3-Next's ``1 + weight`` RMSNorm in its op order.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.hf_rmsnorm import transformers_rms_norm


class HFRMSNorm(torch.nn.Module):
    """RMSNorm with HF's op order. Input ``[..., hidden]`` of any float dtype; output same shape.

    Constructed like Megatron-Core norms: ``(config, hidden_size, eps)``. The weight is marked
    ``sequence_parallel`` like mcore's norms so gradients are all-reduced under sequence parallel.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"HFRMSNorm implements RMSNorm, config asks for {config.normalization}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.variance_epsilon = eps
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return transformers_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, op_order=hf"


class HFRMSNormTriton(HFRMSNorm):
    """:class:`HFRMSNorm` through :func:`mcore_zoo.kernels.hf_rmsnorm.hf_rms_norm` (numerics knob
    ``norm_kernel="triton"``): the same output bits in three passes, a fused backward. CUDA tensors
    (or the CPU under Triton's interpreter); anything else is refused by name."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from ..kernels.hf_rmsnorm import hf_rms_norm
        from ..kernels.triton_rows import refuse_off_device

        refuse_off_device("norm_kernel", hidden_states)
        return hf_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", kernel=triton"


class ZeroCenteredRMSNorm(HFRMSNorm):
    """RMSNorm whose weight is stored zero-centred: ``norm(x) * (1 + weight)``, in the op order of
    transformers' ``Qwen3NextRMSNorm``: normalise in fp32, scale by ``1 + weight`` in fp32, then
    cast to the input dtype. Constructed like :class:`HFRMSNorm`; the weight starts at zero (scale
    1). Used by every backend for architectures with ``zero_centered_norm``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps, **kwargs)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = out * (1.0 + self.weight.float())
        return out.type_as(hidden_states)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, zero_centered=True, op_order=hf"
