"""Megatron-Core's unfused THD RoPE as one whole-pack op (same arithmetic, fewer kernels).

With ``apply_rope_fusion`` off, Megatron-Core rotates a THD pack in
``rope_utils._apply_rotary_pos_emb_thd``: it reads the slot lengths to the host (``.tolist()``, a
device sync on CUDA), splits the pack per sequence, takes ``freqs[0:n_i]`` for slot ``i`` and
rotates - as one ``_apply_rotary_pos_emb_bshd`` call over the concatenated frequencies (0.16) or
one call per sequence copied into the output (0.19). Every layer, for queries and keys, forward
and backward: a handful of small kernels per sequence.

:func:`install` wraps that function (:data:`mcore_zoo.specs.patching.WRAPPED`). Without context
parallelism the wrapper gathers every row's frequencies at once (``freqs[positions]``, the rows'
positions inside their slots computed once per pack by :func:`mcore_zoo.specs.pack_rows.pack_positions`)
and makes one call of Megatron-Core's own ``_apply_rotary_pos_emb_bshd`` (looked up at call time,
so a zoo wrapper of it - DeepSeek-V2's complex RoPE - still applies) on the whole pack, with the
arguments Megatron-Core passed. That function is elementwise in the rows (slice to the rotary
part, ``cos`` / ``sin`` of the frequencies times ``mscale`` cast to the input dtype, ``t * cos +
rotate_half(t) * sin``, the pass-through tail concatenated), so each row gets the same operations
on the same values as in Megatron-Core's per-sequence form: the output and the gradients are
bitwise Megatron-Core's. Frequencies of the whole pack (``freqs.size(0) == cu_seqlens[-1]``,
multimodal RoPE's per-token angles) are used as they are, as Megatron-Core uses them.

The original runs instead under context parallelism (its per-rank chunking of each sequence), for
a pack whose rows or slots the frequencies do not cover (where Megatron-Core raises), for any
argument this wrapper does not know, and on Megatron-Core releases outside the range whose
function was read (:data:`mcore_zoo.compat.SUPPORTED_MCORE`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .pack_rows import host_bounds, pack_positions

#: the keyword arguments Megatron-Core 0.16 - 0.19 pass to ``_apply_rotary_pos_emb_thd`` besides
#: ``cp_group``; all are passed on to ``_apply_rotary_pos_emb_bshd`` unchanged
_PASSED_ON = frozenset({"rotary_interleaved", "multi_latent_attention", "mla_rotary_interleaved", "mscale"})


def whole_pack_rope(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The wrapper of Megatron-Core's ``_apply_rotary_pos_emb_thd`` (see module docstring)."""
    from megatron.core.models.common.embeddings import rope_utils

    from .. import compat

    supported = compat.SUPPORTED_MCORE[0] <= compat.mcore_version()[:2] < compat.SUPPORTED_MCORE[1]

    @functools.wraps(original)
    def _apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args: Any,
                                  cp_group: Any = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        if not supported or args or cp_group is None or cp_group.size() != 1 or set(kwargs) - _PASSED_ON:
            return original(t, cu_seqlens, freqs, *args, cp_group=cp_group, **kwargs)
        bounds = host_bounds(cu_seqlens)
        total = bounds[-1]
        if bounds[0] != 0 or t.dim() != 3 or t.shape[0] != total or freqs.dim() < 1:
            return original(t, cu_seqlens, freqs, cp_group=cp_group, **kwargs)
        if freqs.size(0) != total:  # frequencies by position: row j of a slot takes freqs[j]
            if max((b - a for a, b in zip(bounds, bounds[1:])), default=0) > freqs.size(0):
                return original(t, cu_seqlens, freqs, cp_group=cp_group, **kwargs)
            freqs = freqs.index_select(0, pack_positions(cu_seqlens, freqs.device))
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, **kwargs).squeeze(1)

    _apply_rotary_pos_emb_thd.zoo_whole_pack = True  # type: ignore[attr-defined]
    return _apply_rotary_pos_emb_thd


def install() -> None:
    """Wrap Megatron-Core's ``rope_utils._apply_rotary_pos_emb_thd`` with :func:`whole_pack_rope`,
    once per process (:func:`mcore_zoo.specs.patching.wrap_once`). It runs only where Megatron-Core's
    unfused THD RoPE would run (``apply_rope_fusion`` off, a THD pack) and computes what it computes."""
    from megatron.core.models.common.embeddings import rope_utils

    from .patching import wrap_once

    wrap_once(rope_utils, "_apply_rotary_pos_emb_thd", whole_pack_rope)


__all__ = ["install", "whole_pack_rope"]
