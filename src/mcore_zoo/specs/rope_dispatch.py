"""Which RoPE a model's attention applies: the zoo's wrapper of Megatron-Core's
``apply_rotary_pos_emb`` in ``megatron.core.transformer.attention``
(:data:`mcore_zoo.specs.patching.WRAPPED`), dispatching on the model's ``TransformerConfig``:

* ``config.zoo_vllm_rope`` (numerics ``vllm-exact``): vLLM's RoPE kernel and cos / sin cache;
* ``config.zoo_rope_kernel == "triton"`` (numerics knob ``rope_kernel="triton"``): Megatron-Core's
  unfused RoPE in one Triton pass each way, the same bits (:mod:`mcore_zoo.kernels.rope`); a THD
  pack rotated whole, each row at its position in its sequence (as :mod:`mcore_zoo.specs.thd_rope`
  does for the torch ops). Anything it does not take (context parallelism, interleaved or MLA RoPE,
  frequencies of another shape) is refused by name, never handed to another kernel;
* every other model: Megatron-Core's function.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ZooError


def triton_rope(t: torch.Tensor, freqs: torch.Tensor, config: Any, cu_seqlens: Any = None, mscale: float = 1.0,
                cp_group: Any = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """``apply_rotary_pos_emb``'s unfused arithmetic through :func:`mcore_zoo.kernels.rope.rope`."""
    from ..kernels import rope as kernel
    from .pack_rows import host_bounds, pack_positions

    if config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention or kwargs.get("mla_rotary_interleaved"):
        raise ZooError("rope_kernel='triton' computes the unfused, non-interleaved RoPE; this attention asks for"
                       " another (fused, interleaved or MLA) - use rope_kernel='torch'")  # fmt: skip
    if cp_group is None or cp_group.size() != 1:  # (Megatron-Core's attention passes its group)
        raise ZooError("rope_kernel='triton' does not split sequences over context-parallel ranks (and needs the"
                       " caller's context-parallel group to know); use rope_kernel='torch'")  # fmt: skip
    unknown = set(kwargs) - {"mla_rotary_interleaved"}
    if unknown:
        raise ZooError(f"rope_kernel='triton': this Megatron-Core passes {sorted(unknown)} to apply_rotary_pos_emb")
    if cu_seqlens is not None:  # THD [tokens, heads, dim]: each row's frequencies at its position in its slot
        bounds = host_bounds(cu_seqlens)
        if bounds[0] != 0 or t.dim() != 3 or t.shape[0] != bounds[-1]:
            raise ZooError(f"rope_kernel='triton': a THD pack of {tuple(t.shape)} rows for slots ending at {bounds[-1]}")
        if freqs.size(0) != bounds[-1]:
            freqs = freqs.index_select(0, pack_positions(cu_seqlens, freqs.device))
        t = t.unsqueeze(1)
    if not kernel.takes(t, freqs) or not kernel.runs_on(t):
        raise ZooError(f"rope_kernel='triton' takes [s, b, h, d] {tuple(t.shape)} ({t.dtype}, {t.device}) with frequencies"
                       f" [s, 1, 1, rot] {tuple(freqs.shape)} on CUDA; use rope_kernel='torch'")  # fmt: skip
    out = kernel.rope(t, freqs, mscale)
    return out.squeeze(1) if cu_seqlens is not None else out


def rope_hook(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The wrapper of Megatron-Core's ``apply_rotary_pos_emb`` (module docstring)."""

    def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config: Any, cu_seqlens: Any = None,
                             *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        rope = getattr(config, "zoo_vllm_rope", None)
        if rope is not None:
            return rope.apply(t, cu_seqlens)
        if getattr(config, "zoo_rope_kernel", "torch") == "triton":
            names = ("mscale", "cp_group")
            kwargs.update(zip(names, args))
            return triton_rope(t, freqs, config, cu_seqlens, **kwargs)
        return original(t, freqs, config, cu_seqlens, *args, **kwargs)

    return apply_rotary_pos_emb


def install() -> None:
    """Install :func:`rope_hook` once per process."""
    from megatron.core.transformer import attention as mcore_attention

    from .patching import wrap_once

    wrap_once(mcore_attention, "apply_rotary_pos_emb", rope_hook)
