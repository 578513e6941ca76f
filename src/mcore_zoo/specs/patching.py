"""Every change the zoo makes to Megatron-Core's (and torch's) module attributes, in one registry.

Three kinds, all listed by :func:`patches` (``mcore_zoo.megatron_patches()``), each with what it
changes and for how long:

* **Diverting wrappers** (:data:`WRAPPED`, installed by :func:`wrap_once`): a layer that needs
  another op order inside a Megatron-Core function it cannot reach through a module spec (the MoE
  routing arithmetic, the token combine, DeepSeek-V2's RoPE, vLLM's RoPE) wraps that module
  attribute once per process, when the first such layer is built. The wrapper calls the zoo's
  version only while such a layer has said so on the current thread (or, for vLLM's RoPE, for a
  model whose config carries the zoo's RoPE), and the original otherwise: every other model runs
  Megatron-Core's code unchanged. One computes what the original computes, only with fewer
  kernels (the unfused THD RoPE over a whole pack at once, :mod:`mcore_zoo.specs.thd_rope`), and
  runs for every caller where it applies. They stay process-wide: the functions run inside Megatron-Core's
  forward, which a trainer may call outside any zoo entry point, so there is no narrower scope to
  install them in.
* **CPU patches** (:data:`mcore_zoo.cpu_shim.PATCHES`): only in a process without CUDA, for good.
* **Version shims** (:data:`mcore_zoo.compat.PATCHES`): one missing module global defined, and the
  weight-init helpers replaced while a model to be loaded is built (restored afterwards).

A wrapper not declared in :data:`WRAPPED` is refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ZooError

#: The Megatron-Core functions the zoo's layers divert: ``(module, function) -> what the wrapper
#: changes``. :func:`wrap_once` installs only these.
WRAPPED: dict[tuple[str, str], str] = {
    ("megatron.core.transformer.moe.router", "topk_routing_with_score_function"):
        "HF's top-k routing arithmetic (hf_topk_routing) while a zoo HFRouter routes on this thread",
    ("megatron.core.transformer.moe.token_dispatcher", "unpermute"):
        "the token combine in the HF reference's order while a zoo HFOrderMoELayer runs on this thread"
        " (plain calls only: no probs, fused or drop-and-pad)",
    ("megatron.core.transformer.moe.token_dispatcher", "permute"):
        "records each permuted row's token while a zoo HFOrderMoELayer runs on this thread; the result"
        " is returned unchanged",
    ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_bshd"):
        "DeepSeek-V2's complex (interleaved-pair) RoPE while a zoo MLA layer of that kind runs on this thread",
    ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_thd"):
        "Megatron-Core's unfused THD RoPE computed over the whole pack at once (mcore_zoo.specs.thd_rope): the"
        " same elementwise arithmetic per row, bitwise equal, without the per-sequence split and host sync;"
        " for every caller without context parallelism (the original under it)",
    ("megatron.core.transformer.attention", "apply_rotary_pos_emb"):
        "vLLM's RoPE kernel and cos / sin cache for a model whose config carries zoo_vllm_rope (numerics"
        " 'vllm-exact'); Megatron-Core's unfused RoPE in one Triton pass (the same bits) for a model whose"
        " config says zoo_rope_kernel='triton' (knob rope_kernel); the original for every other model"
        " (mcore_zoo.specs.rope_dispatch)",
}  # fmt: skip

_LOCK = threading.Lock()
_WRAPPED: set[tuple[str, str]] = set()  # the WRAPPED entries installed in this process


@dataclass(frozen=True)
class Patch:
    """One attribute the zoo replaces: where, what the replacement changes, for how long, and
    whether it is in place in this process now."""

    module: str
    function: str
    why: str
    scope: str
    installed: bool


def wrap_once(module: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.<name>`` with ``make(original)``, the first time only (thread-safe; later
    calls for the same module attribute do nothing). ``(module, name)`` must be declared in
    :data:`WRAPPED` (:class:`ZooError` otherwise)."""
    key = (module.__name__, name)
    if key not in WRAPPED:
        raise ZooError(f"{key[0]}.{key[1]}: declare the patch and why in mcore_zoo.specs.patching.WRAPPED first")
    with _LOCK:
        if key in _WRAPPED:
            return
        setattr(module, name, make(getattr(module, name)))
        _WRAPPED.add(key)


def patches() -> list[Patch]:
    """Every patch of Megatron-Core (and torch) the zoo may make, and whether it is installed in
    this process now (a scoped one only while its scope runs)."""
    from .. import compat, cpu_shim

    out = [Patch(m, f, why, "process, from the first layer that needs it; the original for every other caller",
                 (m, f) in _WRAPPED) for (m, f), why in WRAPPED.items()]  # fmt: skip
    out += [Patch(m, f, why, "process without CUDA", cpu_shim.active()) for m, f, why in cpu_shim.PATCHES]
    out += [Patch(m, f, why, scope, f in compat.patches_in_effect()) for m, f, why, scope in compat.PATCHES]
    return out


__all__ = ["Patch", "WRAPPED", "patches", "wrap_once"]
