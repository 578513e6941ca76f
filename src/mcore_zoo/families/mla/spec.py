"""Multi-head latent attention (DeepSeek-V2 / V3) on Megatron-Core's ``MLASelfAttention``.

Megatron-Core's MLA already computes what HF's ``DeepseekV3Attention`` computes with
``rope_interleave=True``: the q / kv down projections, the latent RMSNorms, the up projections
split per head into ``[nope, rope]`` / ``[k_nope, v]``, RoPE on the rope part only (its MLA RoPE
de-interleaves the pairs ``(x0, x1), (x2, x3), ...`` and rotates half, which is HF's
``apply_rotary_pos_emb_interleave`` operation for operation), the shared ``k_rope`` expanded to
every head. Three things differ, and :class:`ZooMLASelfAttention` replaces them:

* **RoPE frequencies**: Megatron-Core computes them (and YaRN's ramp) itself; the zoo installs
  transformers' (``mcore_zoo.config.rope.inv_freq``, computed on the CPU as HF does) and HF's
  attention factor (YaRN ``mscale / mscale_all_dim``), applied to cos / sin as HF does.
* **softmax scale**: HF ``(nope + rope) ** -0.5 * mscale(factor, mscale_all_dim) ** 2`` (in that
  order); Megatron-Core computes ``mscale * mscale / sqrt(q_head_dim)``, which can differ in the
  last bit.
* **latent norm epsilon**: HF builds ``q_a_layernorm`` / ``kv_a_layernorm`` with its RMSNorm default
  (1e-6) whatever ``rms_norm_eps`` says; Megatron-Core uses ``layernorm_epsilon``.

Under TP the kv down projection's ``k_rope`` gradient is summed over the ranks' heads, which
Megatron-Core's branch for a ``ColumnParallelLinear`` down projection does not do
(:func:`_kv_down_class`).

Core attention: the zoo's :class:`~mcore_zoo.specs.portable.PortableAttention` (THD, keys of width
``nope + rope`` and values of width ``v_head_dim``) on ``local`` and ``portable``; Megatron-Core's
local ``DotProductAttention`` cannot take different key and value widths. On ``te`` (profiles whose
``attention`` knob is ``backend``) Transformer Engine's ``DotProductAttention``, which can; the up
and output projections are TE linears there, the down projections stay Megatron-Core's own
``ColumnParallelLinear`` (rows split over TP, the output gathered) on every backend, and the layer norms are separate
modules (MLA's two down projections read the same normalised input: no norm is fused into a
linear). RoPE is never TE's fused kernel (the frequencies are HF's, installed above).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional

import torch

from mcore_zoo.config.arch import ArchConfig
from mcore_zoo.errors import ZooError
from mcore_zoo.numerics.profiles import NumericsProfile
from mcore_zoo.specs.pack_rows import gemm_each_sequence
from mcore_zoo.specs.patching import wrap_once


def _rotary_class() -> Any:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class HFRotaryEmbedding(RotaryEmbedding):
        """Megatron-Core's rotary embedding with HF's frequencies; returns ``(emb, attention factor)``
        when the MLA layer takes the YaRN branch (which multiplies cos and sin by it)."""

        def __init__(self, arch: ArchConfig, *, with_scale: bool, cp_group: Any = None) -> None:
            from mcore_zoo.config.rope import inv_freq

            mla = arch.mla
            super().__init__(mla.qk_rope_head_dim, rotary_percent=1.0, rotary_base=arch.rope.theta,
                             use_cpu_initialization=True, cp_group=cp_group)  # fmt: skip
            freqs, scaling = inv_freq(arch.rope, mla.qk_rope_head_dim, arch.max_position_embeddings)
            self.inv_freq = freqs  # CPU; mcore moves it to the current device on first use
            self.attention_scaling = float(scaling)
            self.with_scale = with_scale
            RotaryEmbedding.forward.cache_clear()  # no embedding computed from mcore's frequencies survives

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> Any:
            emb = super().forward(max_seq_len, offset, packed_seq, cp_group)
            return (emb, self.attention_scaling) if self.with_scale else emb

    return HFRotaryEmbedding


_LOCAL = threading.local()


def complex_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """transformers' DeepSeek-V2 RoPE: the pairs ``(x0, x1), (x2, x3), ...`` of ``t`` (``[..., d]``)
    multiplied in fp32 as complex numbers by ``polar(1, freqs) * mscale``, and kept interleaved.
    ``freqs``: Megatron-Core's ``[..., d]`` embedding (the frequencies twice)."""
    half = freqs[..., : freqs.shape[-1] // 2].float()
    cis = torch.polar(torch.ones_like(half), half) * mscale
    x = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(x * cis).flatten(-2).type_as(t)


def _install_complex_rope() -> None:
    """Route Megatron-Core's ``_apply_rotary_pos_emb_bshd`` (BSHD and, per packed token, THD) through
    :func:`complex_rope` while a DeepSeek-V2 MLA layer runs on this thread; every other caller gets
    the original. Installed once, process-wide."""
    from megatron.core.models.common.embeddings import rope_utils

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def dispatch(t: torch.Tensor, freqs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not getattr(_LOCAL, "complex", False):
                return original(t, freqs, *args, **kwargs)
            rot = freqs.shape[-1]
            if rot != t.shape[-1]:
                raise ZooError(f"complex RoPE expects the whole rope part ({t.shape[-1]}), got {rot} frequencies")
            _LOCAL.applied = True
            return complex_rope(t, freqs, kwargs.get("mscale", 1.0))

        return dispatch

    wrap_once(rope_utils, "_apply_rotary_pos_emb_bshd", make)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient made contiguous. Megatron-Core's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns ``grad``,
    so a non-contiguous gradient (a column slice, as here) would come back unreduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def sum_grad_over_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; backward: the gradient summed over ``group`` (Megatron-Core's copy-to-TP
    region, fed a contiguous gradient)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return _ContiguousGrad.apply(copy_to_tensor_model_parallel_region(x, group=group))


@functools.lru_cache(maxsize=None)
def _kv_down_class() -> Any:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    class GatheredKVDownProj(ColumnParallelLinear):
        """``linear_kv_down_proj`` (rows split over TP) returning the whole ``[latent; k_rope]`` row
        of each token, under sequence parallelism for this rank's tokens only: what a replicated
        linear returns, so ``MLASelfAttention`` takes its replicated branch.

        The branch Megatron-Core takes for a ``ColumnParallelLinear`` down projection gathers its
        output over TP and backpropagates through that gather by keeping each rank's own columns of
        its own gradient. That is right for the latent (every rank's latent gradient is already the
        whole sum: the up projection reduces it over TP), wrong for ``k_rope``: it is shared by every
        head, each rank's gradient holds its own heads' share only, and the rope columns' owner
        keeps its share and drops the other ranks'. Here the shares are summed over TP: under
        sequence parallelism by the gather of ``k_rope`` over the sequence that the replicated
        branch does (its backward reduce-scatters), without it by an all-reduce of the rope columns'
        gradient. The forward is unchanged."""

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out, bias = super().forward(input_, *args, **kwargs)
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
            if self.config.sequence_parallel:
                return scatter_to_sequence_parallel_region(out, group=self.tp_group), bias
            latent, rope = torch.split(out, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
            rope = sum_grad_over_tp(rope, self.tp_group)
            return torch.cat([latent, rope], dim=-1), bias

    return GatheredKVDownProj


@functools.lru_cache(maxsize=None)
def mla_attention_class() -> Any:
    """The zoo's ``MLASelfAttention`` subclass (built once; DeepSeek sparse attention extends it)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from mcore_zoo.specs.portable import PortableAttention

    if not isinstance(mla_module.TELinear, type):
        # without Transformer Engine its import shim leaves placeholders (not classes) with HAVE_TE true,
        # and MLA's isinstance(linear_proj, TELinear) check then raises: say TE is absent
        mla_module.HAVE_TE = False
    rotary_cls = _rotary_class()

    class ZooMLASelfAttention(MLASelfAttention):
        """``MLASelfAttention`` with HF's RoPE frequencies, attention factor and softmax scale."""

        def __init__(self, config: Any, submodules: Any, layer_number: int, *, arch: ArchConfig, **kwargs: Any) -> None:
            super().__init__(config, submodules, layer_number, **kwargs)
            _check_built_as_specified(self, submodules)
            down = self.linear_kv_down_proj
            if type(down) is ColumnParallelLinear and down.tp_group is not None and down.tp_group.size() > 1:
                # MLA accepts only Megatron-Core's own class in the spec: the k_rope gradient fix
                # (_kv_down_class) is the same module, parameters and all, with another forward
                down.__class__ = _kv_down_class()
            for linear in (getattr(self, "linear_q_down_proj", None), down):  # pack_gemms="each" (specs/pack_rows.py)
                if linear is not None and hasattr(linear, "_forward_impl"):
                    gemm_each_sequence(linear)
            cp = getattr(self.pg_collection, "cp", None)
            # the YaRN branch of MLA multiplies cos / sin by the returned factor (HF: attention_scaling)
            self.rotary_pos_emb = rotary_cls(arch, with_scale=config.rope_type == "yarn", cp_group=cp)
            self.softmax_scale = arch.mla.softmax_scale
            core = self.core_attention
            if hasattr(core, "scale"):  # PortableAttention
                core.scale = self.softmax_scale
            elif hasattr(core, "softmax_scale"):
                core.softmax_scale = self.softmax_scale
            else:  # pragma: no cover - a backend whose scale the zoo cannot set
                raise ZooError(f"{type(core).__name__}: cannot set the MLA softmax scale")
            self.rope_complex = arch.mla.rope_complex
            if self.rope_complex:
                _install_complex_rope()

        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            """Megatron-Core 0.19 only (0.16 builds the spec's classes as they are): the Q/KV norms
            and up projections to build. 0.19's resolver derives them from ``config.qk_layernorm``
            and cannot express a latent kv norm without a q norm (no ``q_lora_rank``, DeepSeek-V2-Lite):
            with the flag on it demands a norm fused into ``linear_q_proj`` (TE's, a norm HF does not
            have) or refuses (local), with it off it refuses the kv norm. The zoo's spec names every
            module; they are built as named, as 0.16 builds them."""
            from megatron.core.transformer.identity_op import IdentityOp

            q_lora = self.config.q_lora_rank is not None
            return {
                "linear_q_proj": IdentityOp if q_lora else submodules.linear_q_proj,
                "linear_q_up_proj": submodules.linear_q_up_proj if q_lora else IdentityOp,
                "linear_kv_up_proj": submodules.linear_kv_up_proj,
                "q_layernorm": submodules.q_layernorm if q_lora else IdentityOp,
                "kv_layernorm": submodules.kv_layernorm,
            }

        def _run_core_attention(self, query: Any, key: Any, value: Any, attention_mask: Any,
                                packed_seq_params: Any = None, attn_mask_type: Any = None, **kwargs: Any) -> Any:  # fmt: skip
            """Megatron-Core 0.19 only (0.16 calls the core attention directly, values as they are):
            0.19 zero-pads THD values to the key width (for Transformer Engine) and trims the output.
            :class:`PortableAttention` takes values narrower than keys, so it gets them unpadded, as
            on 0.16; Transformer Engine keeps 0.19's padding."""
            if not isinstance(self.core_attention, PortableAttention):
                return super()._run_core_attention(query, key, value, attention_mask, packed_seq_params=packed_seq_params,
                                                   attn_mask_type=attn_mask_type, **kwargs)  # fmt: skip
            return self.core_attention(query, key, value, attention_mask, packed_seq_params=packed_seq_params,
                                       attn_mask_type=attn_mask_type or self.attn_mask_type, **kwargs)  # fmt: skip

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if not self.rope_complex:
                return super().forward(*args, **kwargs)
            _LOCAL.complex, _LOCAL.applied = True, False
            try:
                out = super().forward(*args, **kwargs)
            finally:
                _LOCAL.complex = False
            if not _LOCAL.applied:  # fail closed: this Megatron-Core applies RoPE elsewhere
                raise ZooError("DeepSeek-V2 complex RoPE was not applied: this Megatron-Core version's MLA does not"
                               " call rope_utils._apply_rotary_pos_emb_bshd (fused RoPE?)")  # fmt: skip
            return out

    return ZooMLASelfAttention


def _check_built_as_specified(attn: Any, submodules: Any) -> None:
    """Fail closed if Megatron-Core built other up projections than the spec names (0.19 picks them
    through a resolver that the zoo overrides; a release that resolved them elsewhere could fuse a
    norm into them, or fall back to its own classes)."""
    names = ["linear_q_up_proj" if attn.config.q_lora_rank is not None else "linear_q_proj", "linear_kv_up_proj"]
    for name in names:
        spec = getattr(submodules, name)
        cls = getattr(spec, "module", spec)
        if not isinstance(getattr(attn, name, None), cls):
            raise ZooError(f"MLA {name}: Megatron-Core built {type(getattr(attn, name, None)).__name__},"
                           f" the spec names {getattr(cls, '__name__', cls)}")  # fmt: skip


def _fixed_eps_norm(norm: Any, eps: float) -> Any:
    """A norm class whose epsilon is ``eps`` whatever the layer passes (HF's latent norms)."""

    class LatentNorm:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            kwargs["eps"] = eps
            return norm(*args, **kwargs)

    LatentNorm.__name__ = f"{getattr(norm, '__name__', 'Norm')}Eps{eps:g}"
    return LatentNorm


def mla_attention_spec(arch: ArchConfig, backend: str, numerics: NumericsProfile, pieces: dict[str, Any], *,
                       module: Any = None, latent_norm_eps: Optional[float] = None) -> Any:  # fmt: skip
    """The ``self_attention`` ``ModuleSpec`` of an MLA layer (``pieces``: the backend's modules).
    ``module``: a subclass of :func:`mla_attention_class`'s to build instead (``vllm-exact``'s);
    ``latent_norm_eps``: the latent norms' epsilon (default: HF's, ``arch.mla.latent_norm_eps``)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_zoo.specs.portable import PortableAttention

    if backend not in ("local", "portable", "te"):
        raise ZooError(f"{arch.architecture}: MLA is built for the te, local and portable backends, not {backend!r}")
    if not arch.mla.rope_interleave:
        raise ZooError(f"{arch.architecture}: rope_interleave=False (rotate-half on the rope dims) is not"
                       " what Megatron-Core's MLA RoPE computes")  # fmt: skip
    if backend == "te" and numerics.attention == "backend":
        core = pieces["core_attention"]  # TEDotProductAttention: keys nope + rope wide, values v_head_dim
    else:
        kernel = numerics.attention if numerics.attention != "backend" else ("eager" if backend == "local" else "auto")
        core = ModuleSpec(module=PortableAttention, params={"kernel": kernel})
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    module = mla_attention_class() if module is None else module
    eps = arch.mla.latent_norm_eps if latent_norm_eps is None else latent_norm_eps
    norm = _fixed_eps_norm(pieces["qk_norm"], eps)
    column, row = pieces["linear_qkv"], pieces["linear_proj"]
    down = ColumnParallelLinear  # MLA accepts only mcore's own classes for the down projections (no biases)
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal, "arch": arch},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=column,
            linear_q_down_proj=down,
            linear_q_up_proj=column,
            linear_kv_down_proj=down,
            linear_kv_up_proj=column,
            core_attention=core,
            linear_proj=row,
            q_layernorm=norm if arch.mla.q_lora_rank is not None else IdentityOp,  # no q latent, no q norm
            kv_layernorm=norm,
        ),
    )
