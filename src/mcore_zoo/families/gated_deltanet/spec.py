"""Gated DeltaNet layers among gated full-attention layers (Qwen3-Next, Qwen3.5), as Megatron-Core layer specs.

:class:`PortableGatedDeltaNet` is the linear-attention token mixer, in the ``self_attention`` slot
of Megatron-Core's ``TransformerLayer``. It computes what transformers' ``Qwen3NextGatedDeltaNet``
computes without a cache, with transformers' own torch fallbacks (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``l2norm``, ``Qwen3NextRMSNormGated``) op for op, so that CPU
fp32 is bitwise equal to the HF model. Its parameters keep the checkpoint's layout
(``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``; for
Qwen3.5's split projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` in place
of the first two, computed as ``Qwen3_5GatedDeltaNet`` computes them).

THD packs (``PackedSeqParams``): each sequence runs alone - the convolution window starts from
zeros and the recurrent state from zero at every sequence start (``cu_seqlens_q``; a pack padded
for alignment lays its sequences out by ``cu_seqlens_q_padded``, the padding rows give zeros) - so
a packed sequence computes exactly what it computes run alone. With the numerics knob
``linear_attention_pack="batch"`` the pack's sequences run as one right-padded batch instead (the
convolution and the delta rule are causal: the padding after a sequence reaches none of its
tokens), one pass of the chunk loop for the whole pack.

Kernels (numerics knob ``linear_attention_kernel``, :mod:`.kernels`): transformers' torch math above,
or flash-linear-attention's Triton kernels on CUDA - its causal convolution and chunked gated delta
rule, a THD pack as one varlen call with ``cu_seqlens`` (each sequence from a zero state and
window inside the kernels; with ``linear_attention_pack="batch"`` as one right-padded batch instead),
BSHD batches as they are; the projections, the gated RMSNorm (fla's does
not round as transformers' does) and ``out_proj`` stay the same on both.

Tensor parallelism splits the layer by head as it computes them (each rank a whole group of key
heads with their value heads; ``out_proj`` row-parallel); pipeline stages take their layers of the
hybrid pattern (:func:`hybrid_layer_specs`). Megatron-Core's own ``GatedDeltaNet``
(``megatron.core.ssm.gated_delta_net``) also calls fla's kernels, but is not used here: in 0.16 it
refuses THD packs (``packed_seq_params``), and it holds its
projections as one ``in_proj`` in Megatron's own order with its own tensor-parallel sharding, where
this layer keeps the checkpoint's tensors and splits them by whole key-head groups - so the same
layer, weight table and THD handling serve every backend and both kernels. The layer is built on
backends ``local``, ``portable`` and ``te`` (Transformer Engine's linears, attention and norms around
it; on ``te`` the layer keeps an input norm of its own, :func:`with_input_norm`); context parallelism
is refused by :meth:`~mcore_zoo.config.arch.GatedDeltaNetSpec.layout_problems`.

Full-attention layers are Megatron-Core's ``SelfAttention`` with ``attention_output_gate``
(the query projection twice as wide, :mod:`.weights` lays it out), whose gate is applied in HF's
op order by :class:`GatedSelfAttention`'s ``_apply_output_gate``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mcore_zoo.config.arch import ArchConfig, GatedDeltaNetSpec
from mcore_zoo.errors import ZooError
from mcore_zoo.families.gated_deltanet import kernels as linear_kernels
from mcore_zoo.numerics.profiles import NumericsProfile
from mcore_zoo.specs import pack_rows

#: the backends the gated DeltaNet layer is built on
BACKENDS = ("local", "portable", "te")


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (flash-linear-attention's definition)."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn``: depthwise convolution of ``x`` (``[b, channels, s]``) with
    ``weight`` (``[channels, width]``), zeros left of the first position, then ``activation``."""
    seq_len = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight=weight.unsqueeze(1), bias=None, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[:, :, :seq_len]  # fmt: skip
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ZooError(f"gated DeltaNet convolution activation {activation!r} is not implemented (silu is)")
    return out.to(x.dtype)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:  # fmt: skip
    """transformers' ``torch_chunk_gated_delta_rule`` from a zero state, q and k L2-normalised in the
    kernel; ``[b, s, heads, d]`` inputs (q / k with key heads, v with value heads), ``[b, s, v heads]``
    decay ``g`` and ``beta``; returns ``[b, s, v heads, dv]`` in the input dtype."""
    initial_dtype = query.dtype
    batch, seq_len, num_k_heads, _ = key.shape
    num_v_heads = value.shape[-2]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    compute = torch.promote_types(query.dtype, torch.float32)  # fp32 as transformers; fp64 stays fp64 (a truth)
    query, key, value, beta, decay = [x.transpose(1, 2).to(compute, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]  # fmt: skip
    query = l2norm(query, dim=-1, eps=1e-6)
    key = l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    num_chunks = (seq_len + pad) // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]  # fmt: skip
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)

    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    state = torch.zeros((batch, num_v_heads, key.shape[-1], value.shape[-1]), dtype=new_values.dtype,
                        device=new_values.device)  # fmt: skip
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, num_v_heads, -1, value.shape[-1])[:, :, :seq_len]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)


class GatedRMSNorm(torch.nn.Module):
    """transformers' ``Qwen3NextRMSNormGated``: ``weight * rmsnorm(x)`` (cast back to the input
    dtype first) times ``silu(gate)`` in fp32, cast to the input dtype. The weight is not
    zero-centred. One weight for every head: under tensor parallelism each rank normalises its own
    heads, so the weight's gradient is summed over the group (``shared_weight``)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: Any, shared_weight: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype, device=device))
        self.variance_epsilon = eps
        self.shared_weight = shared_weight

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        weight = self.weight if self.shared_weight is None else self.shared_weight(self.weight)
        compute = torch.promote_types(input_dtype, torch.float32)  # fp32 as transformers; fp64 stays fp64
        hidden_states = hidden_states.to(compute)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * F.silu(gate.to(compute))
        return hidden_states.to(input_dtype)


def rank_heads(spec: GatedDeltaNetSpec, tp: int) -> GatedDeltaNetSpec:
    """The heads one of ``tp`` tensor-parallel ranks computes: ``1 / tp`` of the key heads with
    their value heads (whole key-head groups, as the head-interleaved projections lay them out)."""
    if tp == 1:
        return spec
    return dataclasses.replace(spec, num_key_heads=spec.num_key_heads // tp, num_value_heads=spec.num_value_heads // tp)


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """A THD pack's layout for the gated DeltaNet layer, made once per pack (every layer of one
    forward gets the same objects, so fla's caches keyed by its ``cu_seqlens`` tensor hit after the
    first layer). ``spans``: each non-empty sequence's ``(start row, length)``; ``fla_arguments``:
    ``cu_seqlens`` (``[segments + 1]`` long, on the pack's device) and ``cu_seqlens_cpu`` (the
    same on the host) as fla takes them (:func:`~.kernels.pack_boundaries`); ``keep``: ``[t]``
    bool on the device, False on alignment-padding rows (whose outputs are zeroed), ``None`` when
    every row is a sequence's. ``longest``, ``rows``, ``slots``: the pack as a right-padded batch of
    ``len(spans)`` rows of ``longest`` - the pack rows of the sequences in order and their slots in
    the flattened batch (``[tokens]`` long each, on the device)."""

    spans: list
    fla_arguments: dict
    keep: Optional[torch.Tensor]
    longest: int
    rows: torch.Tensor
    slots: torch.Tensor


def _varlen_layout(params: Any, total_rows: int, device: torch.device) -> VarlenLayout:
    """The pack ``params``'s :class:`VarlenLayout` for ``total_rows`` rows on ``device``."""
    bounds, starts = pack_rows.pack_host_layout(params)

    def make(_: torch.Tensor) -> VarlenLayout:
        cuts, spans = linear_kernels.pack_boundaries(bounds, starts, total_rows)
        cpu = torch.tensor(cuts, dtype=torch.long)
        keep = None
        if sum(length for _, length in spans) != total_rows:
            mask = torch.zeros(total_rows, dtype=torch.bool)
            for start, length in spans:
                mask[start:start + length] = True
            keep = mask.to(device)
        longest = max((length for _, length in spans), default=0)
        rows = torch.cat([torch.arange(start, start + length) for start, length in spans] or [torch.zeros(0, dtype=torch.long)])
        slots = torch.cat([torch.arange(i * longest, i * longest + length) for i, (_, length) in enumerate(spans)]
                          or [torch.zeros(0, dtype=torch.long)])  # fmt: skip
        return VarlenLayout(spans, {"cu_seqlens": cpu.to(device), "cu_seqlens_cpu": cpu}, keep, longest,
                            rows.to(device), slots.to(device))  # fmt: skip

    return pack_rows.per_pack(params.cu_seqlens_q, ("gated_deltanet_varlen", total_rows, str(device), tuple(starts)), make)


@functools.lru_cache(maxsize=None)
def gated_deltanet_class() -> type:
    """:class:`PortableGatedDeltaNet` (a ``MegatronModule``; built lazily so importing this module
    stays free of Megatron-Core)."""
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes,
    )  # fmt: skip
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
        reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
    )  # fmt: skip
    from megatron.core.transformer.module import MegatronModule

    class PortableGatedDeltaNet(MegatronModule):
        """The gated DeltaNet token mixer (module docstring): ``[s, b, h]`` in, ``([s, b, h], None)`` out.

        Under tensor parallelism (``tp`` ranks) it holds and computes its rank's heads
        (:func:`rank_heads`): the input projections, the convolution's channels, ``A_log`` and
        ``dt_bias`` split by head, ``out_proj`` split by its input columns (row-parallel, its
        output summed over the group; reduce-scattered over the sequence under sequence
        parallelism, whose input is gathered first), the gated norm's weight whole (its gradient
        summed over the group)."""

        def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None, *,
                     spec: GatedDeltaNetSpec, pack: str = "each", kernel: str = "torch", **_: Any) -> None:  # fmt: skip
            super().__init__(config)
            self.pack = pack  # the numerics knob linear_attention_pack: "each", "batch" or "auto"
            self.kernel = kernel  # the numerics knob linear_attention_kernel: "torch", "fla" or "auto"
            self.tp = config.tensor_model_parallel_size
            self.sequence_parallel = bool(config.sequence_parallel) and self.tp > 1
            spec = rank_heads(spec, self.tp)
            self.spec, self.layer_number = spec, layer_number
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            dtype, h = config.params_dtype, config.hidden_size
            linear = functools.partial(torch.nn.Linear, bias=False, device=device, dtype=dtype)
            if spec.projections == "fused":
                self.in_proj_qkvz = linear(h, 2 * spec.key_dim + 2 * spec.value_dim)
                self.in_proj_ba = linear(h, 2 * spec.num_value_heads)
                projections = (self.in_proj_qkvz, self.in_proj_ba)
            else:
                self.in_proj_qkv = linear(h, spec.conv_dim)
                self.in_proj_z = linear(h, spec.value_dim)
                self.in_proj_b = linear(h, spec.num_value_heads)
                self.in_proj_a = linear(h, spec.num_value_heads)
                projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            self.conv1d = torch.nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel_dim, bias=False,
                                          groups=spec.conv_dim, padding=spec.conv_kernel_dim - 1,
                                          device=device, dtype=dtype)  # fmt: skip
            self.dt_bias = torch.nn.Parameter(torch.ones(spec.num_value_heads, dtype=dtype, device=device))
            a = torch.empty(spec.num_value_heads, dtype=torch.float32, device=device).uniform_(1, 16)
            self.A_log = torch.nn.Parameter(torch.log(a).to(dtype))  # on the layer's device, as the others
            shared = copy_to_tensor_model_parallel_region if self.tp > 1 else None
            self.norm = GatedRMSNorm(spec.value_head_dim, spec.norm_eps, dtype, device, shared_weight=shared)
            self.out_proj = linear(spec.value_dim, h)
            if config.perform_initialization:
                with torch.no_grad():
                    for projection in projections:
                        config.init_method(projection.weight)
                    config.output_layer_init_method(self.out_proj.weight)
            for param in (*(p.weight for p in projections), self.conv1d.weight, self.A_log, self.dt_bias):
                set_tensor_model_parallel_attributes(param, True, 0, 1)  # split by head (one rank: all)
            set_tensor_model_parallel_attributes(self.out_proj.weight, True, 1, 1)
            for param in self.parameters():
                set_defaults_if_not_set_tensor_model_parallel_attributes(param)

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *, inference_context: Any = None,
                    packed_seq_params: Any = None, inference_params: Any = None, **_: Any) -> tuple:  # fmt: skip
            if inference_context is not None or inference_params is not None:
                raise ZooError("the gated DeltaNet layer has no inference cache: run it without an inference context")
            if self.sequence_parallel:
                hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                hidden_states = copy_to_tensor_model_parallel_region(hidden_states)
            x = hidden_states.transpose(0, 1).contiguous()  # [b, s, h], HF's layout
            fla = linear_kernels.resolve_kernel(self.kernel, x) == "fla"
            if packed_seq_params is None:
                out = self._mix(x, fla=fla)
            elif fla and self.pack != "batch":
                out = self._mix_varlen(x, packed_seq_params)
            else:
                out = self._mix_packed(x, packed_seq_params, fla=fla)
            out = out.transpose(0, 1).contiguous()
            if self.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(out)
            elif self.tp > 1:
                out = reduce_from_tensor_model_parallel_region(out)
            return out, None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
            """Megatron-Core's default (every tensor whole) at one tensor-parallel rank; under tensor
            parallelism refused by name: the ``[q; k; v]`` channels of ``conv1d`` / ``in_proj_qkv``
            split part by part are no contiguous shard of the checkpoint's tensor."""
            if self.tp > 1:
                raise ZooError(f"distributed checkpoints (torch_dist) of the gated DeltaNet layer at tp={self.tp} are"
                               " not written or read yet (its [q; k; v] channels are split part by part); save"
                               " or load them at tp=1, or use the HF export (save_hf_checkpoint)")  # fmt: skip
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)

        def _mix_packed(self, x: torch.Tensor, params: Any, fla: bool = False) -> torch.Tensor:
            """One THD pack (``[1, t, h]``): every sequence from a zero state and window - alone, one
            after the other (``pack="each"``), or as one right-padded batch (``pack="batch"``; ``"auto"``:
            a batch on CUDA, alone on the CPU). ``fla``: on fla's kernels (reached with ``pack="batch"``
            only: the other values take one varlen call, :meth:`_mix_varlen`)."""
            if x.shape[0] != 1:
                raise ZooError(f"a THD pack has batch 1, got {x.shape[0]}")
            layout = _varlen_layout(params, x.shape[1], x.device)
            spans = layout.spans
            out = torch.zeros(x.shape[:-1] + (self.out_proj.out_features,), dtype=x.dtype, device=x.device)
            batch = self.pack == "batch" or (self.pack == "auto" and x.is_cuda)  # "auto": batch on the GPU
            if batch and len(spans) > 1:
                return self._mix_padded_batch(x, layout, out, fla)
            for start, length in spans:
                out[:, start:start + length] = self._mix(x[:, start:start + length], fla=fla)
            return out

        def _mix_varlen(self, x: torch.Tensor, params: Any) -> torch.Tensor:
            """One THD pack (``[1, t, h]``) through fla's kernels as one varlen call each, every
            sequence from a zero state and window (:func:`~.kernels.pack_boundaries`); alignment
            padding rows give zeros."""
            if x.shape[0] != 1:
                raise ZooError(f"a THD pack has batch 1, got {x.shape[0]}")
            layout = _varlen_layout(params, x.shape[1], x.device)
            out = self._mix(x, fla=True, varlen=layout.fla_arguments)
            return out if layout.keep is None else out * layout.keep.to(out.dtype).view(1, -1, 1)

        def _mix_padded_batch(self, x: torch.Tensor, layout: VarlenLayout, out: torch.Tensor, fla: bool = False) -> torch.Tensor:
            """The pack's sequences as one right-padded ``[n, longest, h]`` batch (rows moved by one
            gather and one scatter each way, :class:`VarlenLayout`), mixed, and written back into ``out``."""
            rows, slots, longest = layout.rows, layout.slots, layout.longest
            batch = x.new_zeros(len(layout.spans) * longest, x.shape[-1]).index_copy(0, slots, x[0].index_select(0, rows))
            mixed = self._mix(batch.view(len(layout.spans), longest, -1), fla=fla)
            return out[0].index_copy(0, rows, mixed.reshape(-1, mixed.shape[-1]).index_select(0, slots)).unsqueeze(0)

        def _mix(self, x: torch.Tensor, fla: bool = False, varlen: Optional[dict] = None) -> torch.Tensor:
            """transformers' ``Qwen3NextGatedDeltaNet.forward`` (``Qwen3_5GatedDeltaNet.forward`` for the
            split projections) without a cache, ``[b, s, h]`` in and out; ``fla``: the convolution and
            the delta rule on flash-linear-attention's kernels (:mod:`.kernels`), ``varlen`` the
            varlen segments of a ``[1, t, h]`` pack as fla's keyword arguments
            (:attr:`VarlenLayout.fla_arguments`)."""
            spec = self.spec
            batch, seq_len = x.shape[:2]
            mixed, z, b, a = self._project(x) if spec.projections == "split" else self._project_fused(x)
            kernels = linear_kernels.load_fla() if fla else None
            varlen = varlen or {}
            if kernels is not None:
                mixed = kernels.causal_conv1d(mixed.transpose(1, 2), self.conv1d.weight.squeeze(1),
                                              activation=spec.activation, **varlen)[0]  # fmt: skip
            else:
                mixed = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), spec.activation).transpose(1, 2)
            query, key, value = torch.split(mixed, [spec.key_dim, spec.key_dim, spec.value_dim], dim=-1)
            query = query.reshape(batch, seq_len, -1, spec.key_head_dim)
            key = key.reshape(batch, seq_len, -1, spec.key_head_dim)
            value = value.reshape(batch, seq_len, -1, spec.value_head_dim)
            beta = b.sigmoid()
            compute = torch.promote_types(a.dtype, torch.float32)  # fp32 as transformers; fp64 stays fp64
            g = -self.A_log.to(compute).exp() * F.softplus(a.to(compute) + self.dt_bias)
            if kernels is not None:
                core = kernels.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                                      **varlen)[0]  # fmt: skip
            else:
                core = chunk_gated_delta_rule(query, key, value, g, beta, spec.chunk_size)
            z_shape = z.shape
            core = self.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
            core = core.reshape(z_shape).reshape(batch, seq_len, -1)
            return self.out_proj(core)

        def _project(self, x: torch.Tensor) -> tuple:
            """Qwen3.5's four projections: ``[q; k; v]`` as ``[b, channels, s]`` (the convolution's
            input), ``z`` ``[b, s, v heads, dv]``, ``b`` and ``a`` ``[b, s, v heads]``."""
            batch, seq_len = x.shape[:2]
            mixed = self.in_proj_qkv(x).transpose(1, 2)
            z = self.in_proj_z(x).reshape(batch, seq_len, -1, self.spec.value_head_dim)
            return mixed, z, self.in_proj_b(x), self.in_proj_a(x)

        def _project_fused(self, x: torch.Tensor) -> tuple:
            """Qwen3-Next's two fused projections, unpacked as :meth:`_project` returns them."""
            batch, seq_len = x.shape[:2]
            query, key, value, z, b, a = self._split_projections(self.in_proj_qkvz(x), self.in_proj_ba(x))
            query, key, value = (t.reshape(batch, seq_len, -1) for t in (query, key, value))
            return torch.cat((query, key, value), dim=-1).transpose(1, 2), z, b, a

        def _split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple:
            """transformers' ``fix_query_key_value_ordering``: per key head ``[q, k, v, z]`` and ``[b, a]``."""
            spec = self.spec
            ratio = spec.num_value_heads // spec.num_key_heads
            qkvz = qkvz.view(*qkvz.shape[:-1], spec.num_key_heads, 2 * spec.key_head_dim + 2 * ratio * spec.value_head_dim)
            ba = ba.view(*ba.shape[:-1], spec.num_key_heads, 2 * ratio)
            dk, dv = spec.key_head_dim, ratio * spec.value_head_dim
            query, key, value, z = torch.split(qkvz, [dk, dk, dv, dv], dim=3)
            b, a = torch.split(ba, [ratio, ratio], dim=3)
            value = value.reshape(value.size(0), value.size(1), -1, spec.value_head_dim)
            z = z.reshape(z.size(0), z.size(1), -1, spec.value_head_dim)
            b = b.reshape(b.size(0), b.size(1), spec.num_value_heads)
            a = a.reshape(a.size(0), a.size(1), spec.num_value_heads)
            return query, key, value, z, b, a

    return PortableGatedDeltaNet


@functools.lru_cache(maxsize=None)
def gated_attention_class() -> type:
    """Megatron-Core's ``SelfAttention`` whose output gate is HF's ``out * sigmoid(gate)`` in the
    activations' dtype (Megatron-Core's takes the sigmoid in fp32 and compiles it)."""
    from megatron.core.transformer.attention import SelfAttention

    class GatedSelfAttention(SelfAttention):
        """``SelfAttention`` with ``attention_output_gate`` applied in transformers' op order."""

        def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            return x * torch.sigmoid(gate.contiguous().view(*x.shape))

    return GatedSelfAttention


def check_buildable(arch: ArchConfig, backend: str, numerics: NumericsProfile, *, cuda: bool = True) -> None:
    """Refuse, by name, the builds the gated DeltaNet layer does not support yet (``cuda``: the model
    is built on the GPU; ``linear_attention_kernel="fla"`` needs it and an importable ``fla``)."""
    if backend not in BACKENDS:
        raise ZooError(f"{arch.architecture}: the gated DeltaNet layer is built on backends {BACKENDS}, not {backend!r}")
    if numerics.linear_attention_kernel == "fla":
        linear_kernels.check_kernel("fla", "cuda" if cuda else "cpu")
    if numerics.kernels == "vllm":
        raise ZooError(f"{arch.architecture}: numerics {numerics.name!r} (vLLM's kernels) has no gated DeltaNet layer")
    if arch.mtp_num_layers:
        raise ZooError(f"{arch.architecture}: multi-token prediction is not built for gated DeltaNet models yet")


def with_input_norm(layer: Any, arch: ArchConfig, backend: str, numerics: NumericsProfile) -> Any:
    """``layer`` with a norm of its own before the token mixer: on ``te`` with the norm fused into
    ``linear_qkv`` (``fuse_norm_into_linear``) the layer spec has none, and the gated DeltaNet layer
    has no ``linear_qkv`` to fuse it into. Its distributed-checkpoint key stays the fused one
    (``self_attention.linear_qkv.layer_norm_weight``), as on every backend."""
    from megatron.core.transformer.identity_op import IdentityOp

    from mcore_zoo.specs.gpt import _pieces

    if layer.submodules.input_layernorm is not IdentityOp:
        return layer
    norm = _pieces(arch, backend, numerics.with_knobs(fuse_norm_into_linear=False))["input_layernorm"]
    keys = dict(layer.submodules.sharded_state_dict_keys_map or {})
    keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=norm, sharded_state_dict_keys_map=keys))  # fmt: skip


def hybrid_layer_specs(arch: ArchConfig, backend: str, numerics: NumericsProfile, *, config: Any,
                       vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> Any:  # fmt: skip
    """``TransformerBlockSubmodules`` of one (virtual) pipeline stage: per global layer index the
    gated DeltaNet or the gated attention layer (``arch.gated_deltanet.layer_types``), each with the
    MoE block or the dense MLP (``arch.moe``); zero-centred norms where ``arch.zero_centered_norm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mcore_zoo.specs.gpt import _pieces, gpt_layer_spec, stage_layer_indices

    check_buildable(arch, backend, numerics, cuda=not config.use_cpu_initialization)
    spec = arch.gated_deltanet
    linear = ModuleSpec(module=gated_deltanet_class(), params={"spec": spec, "pack": numerics.linear_attention_pack,
                                                               "kernel": numerics.linear_attention_kernel})  # fmt: skip
    dense = gpt_layer_spec(arch, backend, numerics)
    moe = gpt_layer_spec(arch, backend, numerics, moe=True) if arch.moe is not None else None
    layers = []
    for index in stage_layer_indices(config, vp_stage, pp_rank):
        layer = moe if moe is not None and arch.moe.is_moe_layer(index) else dense
        if spec.is_linear_layer(index):
            layer = with_input_norm(layer, arch, backend, numerics)
            mixer = linear
        elif arch.attention_output_gate:
            mixer = dataclasses.replace(layer.submodules.self_attention, module=gated_attention_class())
        else:
            mixer = layer.submodules.self_attention
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=mixer)))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=_pieces(arch, backend, numerics)["final_norm"])
