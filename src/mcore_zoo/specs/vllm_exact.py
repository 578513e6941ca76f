"""Megatron-Core modules for the ``vllm-exact`` profile: vLLM's batch-invariant kernels in GPTModel.

vLLM (``VLLM_BATCH_INVARIANT=1``, ``enforce_eager=True``) computes a dense decoder layer as::

    x, residual = input_layernorm(x, residual)        # first layer: Triton norm of x, residual = x
    q, k, v = split(linear(x, W_qkv) + b_qkv)          # Triton persistent GEMM, bias added after
    q, k = q_norm(q), k_norm(k)                        # Qwen3: Triton norm per head
    q, k = rotary(positions, q, k)                     # CUDA kernel, bf16 cos / sin cache
    x = linear(flash_attention(q, k, v), W_o)          # FA over the paged cache, num_splits=1
    x, residual = post_attention_layernorm(x, residual)  # CUDA fused add + norm
    x = linear(silu_and_mul(linear(x, W_gate_up)), W_down)

and after the last layer ``norm(x, residual)`` (fused add + norm), the LM head with the same GEMM
and log-probs with its Triton log-softmax over fp32 logits. Megatron-Core's layer adds the residual
itself (``residual + x`` in the model dtype, the same rounding as the fused kernel's add) and then
normalises the sum: :class:`VLLMResidualRMSNorm` runs the fused kernel on that sum, which gives the
kernel's own output. The modules here are mcore's (same parameters, same checkpoint mapping) with
their arithmetic routed to :mod:`mcore_zoo.kernels.vllm_ops`.

Tensor parallelism splits the layers as vLLM's tensor-parallel engine does (q / k / v and gate /
up by heads and rows, ``o_proj`` / ``down_proj`` by input columns with an all-reduce of the partial
sums in the model dtype, from TP3 on in the order of NCCL's tree as vLLM's batch-invariant mode
pins it (:class:`VLLMRowParallelLinear`), vocabulary-parallel embedding and LM head with the logits gathered before
the log-prob kernel), so at the engine's TP size the trainer computes each token as that engine
does.

Mixture of experts (Qwen3-MoE): vLLM computes the block with ``FusedMoE`` - unquantized bf16 on
an SM90 GPU at TP1 in batch-invariant mode the oracle's only kernel that declares batch invariance,
``TritonExperts`` (FlashInfer's are moved behind Triton on SM90 and do not declare it)::

    logits = linear(x, W_gate)                          # ReplicatedLinear: Triton persistent GEMM, bf16
    weights, ids = topk_softmax(logits, k, norm_topk)   # CUDA kernel: fp32 softmax, top k, / sum
    h = fused_moe(x, w13[ids])                          # Triton fused-MoE GEMM, fixed batch-invariant tiles
    a = silu_and_mul(h)                                 # CUDA kernel, per (token, slot) row
    y = fused_moe(a, w2[ids]) * weights                 # weight applied to the fp32 accumulator, then bf16
    out = moe_sum(y)                                    # CUDA kernel: the k slots of a token summed

:class:`VLLMMoELayer` runs exactly these ops (:func:`mcore_zoo.kernels.vllm_ops.fused_experts`) on
Megatron-Core's own parameters: the router's ``weight`` and the sequential experts'
``linear_fc1`` (``[gate; up]``) / ``linear_fc2`` weights, so the checkpoint mapping is the
MoE built-ins' own.

At ``tensor_parallel_size`` N (data parallel 1) vLLM 0.26 runs the same block on every rank over
all tokens (the gate is a ``ReplicatedLinear``) and all-reduces the ranks' outputs after
``moe_sum``: ``MoERunner._maybe_reduce_final_output`` calls ``tensor_model_parallel_all_reduce``
(``layers/fused_moe/runner/moe_runner.py``, the TP group's ``all_reduce`` that ``RowParallelLinear``
calls, ``layers/linear.py``; batch-invariant mode turns the custom all-reduce off,
``config/parallel.py``, and pins NCCL's tree, ``layers/batch_invariant.py``). Without expert
parallelism each rank holds every expert's intermediate shard (``w13`` = ``[gate rows of rank r;
up rows of rank r]``, ``w2`` the matching input columns: ``RoutedExperts._load_w13`` / ``_load_w2``);
the trainer's layout is TP N with expert-TP N, where Megatron-Core's ``linear_fc1`` / ``linear_fc2``
of each expert hold those shards. With ``enable_expert_parallel=True`` ``FusedMoEParallelConfig.make``
turns the TP ranks into EP ranks (``ep_size = tp_size``, expert TP 1), the experts are placed
``linear`` by default (rank r: ``[r * E / N, (r + 1) * E / N)``, ``expert_map_manager.py``), every
rank routes every token, the Triton kernel writes zeros for the slots of other ranks' experts
(``expert_map`` -1) and, with no all-to-all at data parallel 1 (``use_all2all_kernels``), the same
all-reduce sums the ranks; the trainer's layout is TP N x EP N at expert-TP 1.

DeepSeek-V3 (``DeepseekV3ForCausalLM``: multi-head latent attention, the grouped sigmoid router,
a shared expert): :func:`vllm_mla_attention_class` computes the attention in the absorbed form of
vLLM's ``FLASH_ATTN_MLA`` backend (the form every token takes when the engine caps a step's
requests at 512 query tokens, ``long_prefill_token_threshold=512``); :class:`VLLMRouter` runs
vLLM's ``grouped_topk`` kernel; :meth:`VLLMMoELayer.combine` scales the routed sum by
``routed_scaling_factor`` and adds the shared expert as vLLM's ``MoERunner`` does.

Scope (refused otherwise, naming the reason): dense RMSNorm + SwiGLU + NeoX RoPE decoders (the
dense built-ins) at any TP, Qwen3-MoE (softmax top-k router, no shared expert) at TP1 or at the two
TP N layouts above, and DeepSeek-V3 at TP1 or TP N with expert-TP N (its MLA split as vLLM's TP
engine splits it; measured against an engine at TP1, checked on the CPU at TP2) at widths where
vLLM keeps its batch-invariant GEMMs (:func:`token_count_kernels`: not DeepSeek-V3's / Kimi-K2's
own 7168); context parallel size 1,
no sequence parallelism. Measured against engines of the same layout (H100s, 2026-11-27,
bench/gpu/vllm_exact_tp.py): every decoder layer bitwise at TP1; at TP1, TP2 and TP2 x EP2 every
sampled and prompt log-prob bitwise, with the log-prob head following the engine's model runner;
DeepSeek-V3 at TP1 (H200, 2026-11-28, bench/gpu/vllm_exact_batch_probe.py): every layer's
attention, MoE and output bitwise alone and batched, every sampled and prompt log-prob bitwise
(docs/rollout.md).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from ..errors import ZooError
from ..kernels import vllm_ops
from .portable import PortableAttention


def _vllm_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 gradient_accumulation_fusion: bool = False, allreduce_dgrad: bool = False,
                 sequence_parallel: bool = False, tp_group: Any = None, **_: Any) -> torch.Tensor:  # fmt: skip
    """mcore's ``linear_with_grad_accumulation_and_async_allreduce`` contract on vLLM's GEMM.

    Under tensor parallelism (no sequence parallelism) a column-parallel layer gets its replicated
    input as it is and ``allreduce_dgrad``: the input's gradient is all-reduced over ``tp_group`` in
    the backward (mcore's ``copy_to_tensor_model_parallel_region``); a row-parallel layer returns
    its partial sums, which mcore all-reduces in the model dtype - as vLLM's ``RowParallelLinear``
    (NCCL, the custom all-reduce being off in batch-invariant mode)."""
    if gradient_accumulation_fusion:
        raise ZooError("numerics 'vllm-exact' does not support gradient_accumulation_fusion")
    if sequence_parallel:
        raise ZooError("numerics 'vllm-exact' does not support sequence parallelism")
    if allreduce_dgrad:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return vllm_ops.linear(input, weight, bias)


class VLLMColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM is vLLM's batch-invariant one (bias added after)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _vllm_linear(input, weight, *args, **kwargs)


class VLLMRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose GEMM is vLLM's batch-invariant one, its partial sums added as
    vLLM's batch-invariant engine adds them.

    vLLM's batch-invariant mode turns off its custom and symmetric-memory all-reduces and pins NCCL
    to the tree algorithm on one channel (``NCCL_ALGO=allreduce:tree``, ``NCCL_PROTO=Simple``,
    ``NCCL_MAX_NCHANNELS=1``): on one node the ranks form a chain and every element is added
    ``p0 + (p1 + (p2 + p3))``, rounding to bf16 on each hop. Megatron-Core's all-reduce runs on
    the trainer's own communicator, whose algorithm and channels NCCL picks by message size and
    whose order of addition varies along the tensor (a ring adds each chunk starting from another
    rank). Two partials add the same in any order, so at TP2 either is exact; from TP3 on the
    layer all-gathers the partials and adds them in the chain's order
    (:func:`mcore_zoo.distributed.collectives.chain_all_reduce`)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _vllm_linear(input, weight, *args, **kwargs)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        from ..placement import group_size

        if self.tp_group is None or group_size(self.tp_group) <= 2:
            return super().forward(input_)
        from ..distributed.collectives import chain_all_reduce

        if not self.input_is_parallel:
            raise ZooError("numerics 'vllm-exact': a row-parallel layer takes its input already split over TP")
        output = chain_all_reduce(self._forward_impl(input_, self.weight), self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class _VLLMNorm(torch.nn.Module):
    residual = False

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ZooError(f"numerics 'vllm-exact' implements RMSNorm only, the model uses {config.normalization}")
        if getattr(config, "sequence_parallel", False):
            raise ZooError("numerics 'vllm-exact' does not support sequence parallelism")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.variance_epsilon = eps
        setattr(self.weight, "sequence_parallel", False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vllm_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=self.residual)

    def extra_repr(self) -> str:
        kind = "fused add + norm (CUDA)" if self.residual else "Triton"
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, kernel=vllm {kind}"


class VLLMRMSNorm(_VLLMNorm):
    """vLLM's RMSNorm without a residual (Triton): the first layer's input norm, q / k norms."""


class VLLMResidualRMSNorm(_VLLMNorm):
    """vLLM's fused add + RMSNorm (CUDA), applied to the already-summed residual stream: every other
    decoder norm and the final norm."""

    residual = True


class VLLMMLP(MLP):
    """mcore's MLP (``linear_fc1`` = ``[gate; up]``) with vLLM's SiLU-and-mul kernel between the GEMMs."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        x, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            x = x + bias
        return self.linear_fc2(vllm_ops.silu_and_mul(x))


def _thd_bounds(packed_seq_params: Any) -> Optional[torch.Tensor]:
    """A THD pack's sequence bounds (int ``cu_seqlens`` ``[B + 1]``; the padded ones where the pack
    has them: a sequence's padding follows its real tokens, which never see it), or ``None`` for
    SBHD input."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def _thd_lengths(cu: torch.Tensor) -> torch.Tensor:
    """The lengths of the pack's non-empty sequences (the attention kernels' ``lengths``)."""
    lengths = cu.diff()
    return lengths[lengths > 0]


def _sbhd_rows(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, ...]`` -> ``[b * s, ...]``: the batch's sequences back to back."""
    s, b = t.shape[0], t.shape[1]
    return t.transpose(0, 1).reshape(b * s, *t.shape[2:])


class VLLMAttention(PortableAttention):
    """Core attention with vLLM's FlashAttention prefill (paged KV cache, ``num_splits=1``).

    Same constructor and call as :class:`~mcore_zoo.specs.portable.PortableAttention`; THD
    ``[t, (1,) np|ng, hn]`` -> ``[t, np * hn]`` (each padded slot of the pack attended as one
    sequence: padding sits after a sequence's real tokens, which never see it), SBHD
    ``[s, b, np|ng, hn]`` -> ``[s, b, np * hn]``. The softmax scale is ``head_dim ** -0.5`` (vLLM's)
    unless the config sets one.
    """

    def __init__(self, config: Any, layer_number: int, *args: Any, softmax_scale: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, softmax_scale=softmax_scale, kernel="sdpa", **kwargs)
        if self.cp_group is not None and self.cp_group.size() > 1:
            raise ZooError("numerics 'vllm-exact' supports context parallel size 1 only")
        if softmax_scale is None:
            self.scale = self.head_dim**-0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Any = None, attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
        if attention_bias is not None:
            raise NotImplementedError("vllm-exact attention does not take an attention bias")
        if self.training and self.dropout_p:
            raise ZooError("numerics 'vllm-exact': attention dropout must be 0 (vLLM has none)")
        cu = _thd_bounds(packed_seq_params)
        if cu is not None:
            if query.dim() == 4:
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            out = vllm_ops.attention(query, key, value, _thd_lengths(cu), scale=self.scale, window=self.window)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[0], query.shape[1]
        lengths = torch.full((b,), s, dtype=torch.int32, device=query.device)
        out = vllm_ops.attention(_sbhd_rows(query), _sbhd_rows(key), _sbhd_rows(value), lengths, scale=self.scale,
                                 window=self.window)  # fmt: skip
        return out.view(b, s, -1).transpose(0, 1).contiguous()

    def extra_repr(self) -> str:
        return f"heads={self.heads}, groups={self.groups}, window={self.window}, kernel=vllm flash-attention (paged)"


@functools.lru_cache(maxsize=None)
def vllm_mla_attention_class() -> type:
    """:class:`VLLMMLASelfAttention`: the MLA layer of ``vllm-exact`` (built once; it extends the zoo's
    ``MLASelfAttention`` subclass, :func:`mcore_zoo.families.mla.spec.mla_attention_class`)."""
    from ..families.mla.spec import mla_attention_class

    class VLLMMLASelfAttention(mla_attention_class()):  # type: ignore[misc, valid-type]
        """DeepSeek's multi-head latent attention as vLLM's ``DeepseekV2MLAAttention`` computes it with
        the ``FLASH_ATTN_MLA`` backend in batch-invariant mode, for tokens of steps whose requests
        have at most 512 query tokens (the engine started with ``long_prefill_token_threshold=512``:
        then every token, prompt or sampled, takes this path; docs/rollout.md)::

            [q_c | kv_c | k_pe] = linear(x, [W_q_a; W_kv_a])   # fused_qkv_a_proj: one GEMM (q_lora_rank)
            q = linear(rms_norm(q_c), W_q_b)                    # Triton norm (eps: rms_norm_eps), [n, N, P + R]
            kv_c = rms_norm(kv_c)                               # Triton norm; k_pe is not normalised
            q_pe, k_pe = rotary(q_pe), rotary(k_pe)             # GPT-J pairs, vLLM's cos / sin cache
            o = mla_absorbed_attention(q_nope, q_pe, kv_c, k_pe, W_UK_T, W_UV)  # bmm, FA3 q_v, bmm
            out = linear(o, W_o)                                # o_proj

        Without a query LoRA the query is ``linear(x, W_q)`` and the latent ``linear(x, W_kv_a)``, two
        GEMMs. The parameters are Megatron-Core's MLA layer's (``linear_q_down_proj``,
        ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``,
        ``linear_kv_up_proj``, ``linear_proj``), so the checkpoint mapping is the MLA family's own;
        ``W_UK_T`` / ``W_UV`` are views of ``linear_kv_up_proj.weight``
        (:func:`vllm_ops.mla_absorbed_weights`). The softmax scale is HF's (the same Python float
        vLLM computes: ``(P + R) ** -0.5 * mscale ** 2``). Under tensor parallelism the layer is
        split as vLLM's TP engine splits it: the down projections' outputs whole on every rank
        (:meth:`_whole_down`), the query up projection and ``W_UK_T`` / ``W_UV`` by heads,
        ``o_proj`` by input columns with its partial sums all-reduced (:class:`VLLMRowParallelLinear`).

        ``forward(hidden_states [s, b, H] | THD [t, 1, H], attention_mask, ..., packed_seq_params)
        -> (output of the same layout, bias)``; positions restart at every sequence of a THD pack
        (its padded bounds, as the other vllm-exact attention), or run ``0 .. s - 1`` per SBHD row."""

        def __init__(self, config: Any, submodules: Any, layer_number: int, **kwargs: Any) -> None:
            super().__init__(config, submodules, layer_number, **kwargs)
            for name in ("linear_q_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_down_proj",
                         "linear_kv_up_proj", "linear_proj"):  # fmt: skip
                linear = getattr(self, name, None)
                if getattr(linear, "bias", None) is not None:
                    raise ZooError(f"numerics 'vllm-exact': MLA {name} has a bias (vLLM's DeepSeek layer has none)")
            tp = getattr(self.linear_kv_up_proj, "tp_group", None)
            self._zoo_tp_group = tp if tp is not None and tp.size() > 1 else None

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *args: Any,
                    packed_seq_params: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
            if args or any(kwargs.get(k) is not None for k in ("key_value_states", "inference_context", "inference_params")):
                raise ZooError("numerics 'vllm-exact': MLA runs training forwards only (no key-value states, no"
                               " inference context)")  # fmt: skip
            if self.training and self.config.attention_dropout:
                raise ZooError("numerics 'vllm-exact': attention dropout must be 0 (vLLM has none)")
            cfg = self.config
            rope = getattr(cfg, "zoo_vllm_rope", None)
            if rope is None:
                raise ZooError("numerics 'vllm-exact': the MLA layer has no vLLM RoPE cache (build the model with"
                               " mcore_zoo.build_model)")  # fmt: skip
            cu = _thd_bounds(packed_seq_params)
            thd = cu is not None
            if thd:
                x = hidden_states.reshape(-1, hidden_states.shape[-1])
                lengths = _thd_lengths(cu)
                positions = vllm_ops.sequence_positions(cu).to(x.device)
            else:
                s, b = hidden_states.shape[0], hidden_states.shape[1]
                x = _sbhd_rows(hidden_states)
                lengths = torch.full((b,), s, dtype=torch.int32, device=x.device)
                positions = torch.arange(s, device=x.device).repeat(b)
            n = x.shape[0]
            heads = self.num_attention_heads_per_partition
            nope, pe, v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
            latent = cfg.kv_lora_rank
            group = self._zoo_tp_group
            if group is not None:  # the replicated input's gradient: summed over the ranks' shares
                from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

                x = copy_to_tensor_model_parallel_region(x, group=group)
            if cfg.q_lora_rank is not None and group is None:
                fused = torch.cat([self.linear_q_down_proj.weight, self.linear_kv_down_proj.weight])
                q_c, kv_c, k_pe = vllm_ops.linear(x, fused).split([cfg.q_lora_rank, latent, pe], dim=-1)
                q = vllm_ops.linear(self.q_layernorm(q_c), self.linear_q_up_proj.weight)
            elif cfg.q_lora_rank is not None:
                q_c = self.q_layernorm(self._whole_down(x, self.linear_q_down_proj.weight))
                q = vllm_ops.linear(self._heads_share(q_c), self.linear_q_up_proj.weight)
                kv_c, k_pe = self._whole_down(x, self.linear_kv_down_proj.weight).split([latent, pe], dim=-1)
            else:
                kv_c, k_pe = self._whole_down(x, self.linear_kv_down_proj.weight).split([latent, pe], dim=-1)
                q = vllm_ops.linear(x, self.linear_q_proj.weight)
            q_nope, q_pe = q.view(n, heads, nope + pe).split([nope, pe], dim=-1)
            kv_c = self._heads_share(self.kv_layernorm(kv_c))
            q_pe = rope.rotate(q_pe.reshape(n, heads * pe), positions).view(n, heads, pe)
            k_pe = self._heads_share(rope.rotate(k_pe.contiguous(), positions))
            w_uk_t, w_uv = vllm_ops.mla_absorbed_weights(self.linear_kv_up_proj.weight, heads, nope, v)
            o = vllm_ops.mla_absorbed_attention(q_nope, q_pe, kv_c, k_pe, w_uk_t, w_uv, lengths, scale=self.softmax_scale)
            out, bias = self.linear_proj(o.reshape(n, heads * v))
            if not thd:
                out = out.view(b, s, -1).transpose(0, 1).contiguous()
            else:
                out = out.view(*hidden_states.shape[:-1], -1)
            return out, bias

        def _whole_down(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            """A down projection's whole output ``[n, out]`` on every rank, as vLLM's replicated
            ``fused_qkv_a_proj`` / ``kv_a_proj_with_mqa`` computes it: under TP this rank's rows
            (Megatron-Core splits the weight) by vLLM's GEMM, gathered over TP. Each output column
            is then the dot product the whole GEMM computes for it; that the batch-invariant GEMM's
            bits do not depend on the number of columns is its fixed tiling's premise, not measured
            on a GPU for this split. Backward: each rank keeps its columns' gradient (whole:
            :meth:`_heads_share` summed it over TP where the heads split)."""
            y = vllm_ops.linear(x, weight)
            if self._zoo_tp_group is None:
                return y
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            return gather_from_tensor_model_parallel_region(y, group=self._zoo_tp_group)

        def _heads_share(self, t: torch.Tensor) -> torch.Tensor:
            """A replicated tensor (normalised latent, RoPE'd ``k_pe``, normalised ``q_c``) entering
            this rank's heads: identity forward; backward under TP, its gradient (this rank's heads'
            share) summed over TP, so every replicated step before it - the latent norms' weights
            included - gets the whole gradient on every rank."""
            if self._zoo_tp_group is None:
                return t
            from ..families.mla.spec import sum_grad_over_tp

            return sum_grad_over_tp(t, self._zoo_tp_group)

    return VLLMMLASelfAttention


def mla_attention_spec(arch: Any, backend: str, numerics: Any, pieces: dict[str, Any]) -> Any:
    """The ``self_attention`` spec of a ``vllm-exact`` MLA layer: the MLA family's
    (:func:`mcore_zoo.families.mla.spec.mla_attention_spec`) built as :class:`VLLMMLASelfAttention`,
    its latent norms at ``rms_norm_eps`` (vLLM builds them so; transformers at 1e-6)."""
    from ..families.mla.spec import mla_attention_spec as family_spec

    return family_spec(arch, backend, numerics, pieces, module=vllm_mla_attention_class(), latent_norm_eps=arch.norm_eps)


class VLLMRouter(TopKRouter):
    """Megatron-Core's ``TopKRouter`` (same ``weight``, same routing replay object) computing the
    routing as vLLM's ``FusedMoE`` does: the logits by vLLM's GEMM in the model dtype (vLLM's gate
    is a ``ReplicatedLinear`` in the model dtype; a router weight kept in fp32 is cast to it), the
    experts and weights by vLLM's ``topk_softmax`` kernel (:func:`vllm_ops.moe_topk_softmax`).

    ``renormalize``: divide the top-k weights by their sum (``norm_topk_prob``, vLLM's
    ``renormalize``). ``groups = (n_group, topk_group)``: DeepSeek-V3's router instead - sigmoid
    scores, the score-correction bias (Megatron-Core's ``expert_bias``, fp32) for the choice only,
    expert groups, vLLM's ``grouped_topk`` kernel (:func:`vllm_ops.moe_grouped_topk`), the weights
    without ``routed_scaling_factor`` (:class:`VLLMMoELayer` scales the block's output). ``forward(x [n, H]) -> (weights fp32 [n, k], routing_map bool [n, E], experts int32 [n, k])``:
    the experts in the kernel's slot order, which is the order the block sums them in. With routing
    replay (``moe_enable_routing_replay``) the router records / replays its experts through
    Megatron-Core's ``RouterReplay`` (:mod:`mcore_zoo.routing`); replayed experts that are the
    kernel's own choice keep the kernel's weights bit for bit."""

    def __init__(self, config: Any, pg_collection: Any = None, *, renormalize: bool,
                 groups: Optional[tuple[int, int]] = None, **router_kwargs: Any) -> None:  # fmt: skip
        # router_kwargs: what the release's MoELayer passes besides (megatron-core 0.19: is_mtp_layer)
        super().__init__(config=config, pg_collection=pg_collection, **router_kwargs)
        self.renormalize = bool(renormalize)
        self.groups = groups
        if groups is not None and getattr(self, "expert_bias", None) is None:
            raise ZooError("numerics 'vllm-exact': the grouped sigmoid router needs the score-correction bias"
                           " (moe_router_enable_expert_bias)")  # fmt: skip

    def _topk(self, logits: torch.Tensor, topk: int, routes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's top-k kernel of this router (``routes``: replayed experts)."""
        if self.groups is None:
            return vllm_ops.moe_topk_softmax(logits, topk, renormalize=self.renormalize, routes=routes)
        groups, kept = self.groups
        return vllm_ops.moe_grouped_topk(logits, topk, num_groups=groups, topk_group=kept, renormalize=self.renormalize,
                                         bias=self.expert_bias, routes=routes)  # fmt: skip

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        x = input.reshape(-1, input.shape[-1])
        logits = vllm_ops.linear(x, self.weight.to(x.dtype))
        routes = None
        replay = getattr(self, "router_replay", None)
        if replay is not None:
            def select(scores: torch.Tensor, topk: int, *_: Any, **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
                weights, ids = self._topk(scores, topk)
                return weights, ids.long()

            _, routes = replay.get_replay_topk(logits.detach(), self.topk, None, None, select)
        weights, ids = self._topk(logits, self.topk, routes)
        routing_map = torch.zeros(x.shape[0], self.num_experts, dtype=torch.bool, device=x.device)
        routing_map = routing_map.scatter(1, ids.long(), True)
        counts = getattr(self, "local_tokens_per_expert", None)
        if counts is not None and torch.is_grad_enabled():  # what Megatron-Core's bias update reads
            with torch.no_grad():
                counts += routing_map.sum(dim=0)
        return weights, routing_map, ids


class VLLMMoELayer(MoELayer):
    """Megatron-Core's ``MoELayer`` (router, sequential experts, parameters and checkpoint keys as
    they are) whose forward is vLLM's fused MoE block (see the module docstring): no token
    dispatch; every token's k experts in one pair of fused grouped GEMMs.

    Layouts, each the one of vLLM's engine at ``tensor_parallel_size`` = the trainer's TP (data
    parallel 1; :func:`check_moe_supported` refuses others):

    - TP1: the whole block on one rank.
    - TP N, expert tensor parallel N (vLLM without expert parallelism): every rank holds every
      expert's intermediate shard (``linear_fc1`` = ``[gate shard; up shard]``, ``linear_fc2`` its
      input columns - what vLLM's ``w13`` / ``w2`` hold on that rank), routes all tokens with the
      replicated router and computes its partial block output on the shards.
    - TP N, expert parallel N, expert TP 1 (vLLM's ``enable_expert_parallel=True``): rank r holds
      the experts ``[r * E / N, (r + 1) * E / N)`` whole (vLLM's default ``linear`` placement, mcore's
      ``local_expert_indices``), routes all tokens and computes the slots of its own experts;
      the others' are 0 (vLLM's ``expert_map``, :func:`vllm_ops.fused_experts`).

    The ranks' partial outputs (model dtype) are then summed by the all-reduce vLLM's
    ``MoERunner`` issues after the combine, ``tensor_model_parallel_all_reduce`` - the one of the
    dense row-parallel layers (:func:`mcore_zoo.distributed.collectives.tree_order_all_reduce`,
    see :class:`VLLMRowParallelLinear`). Backward: the input and the routing weights enter the
    rank's partial through Megatron-Core's ``copy_to_tensor_model_parallel_region`` (their
    gradients summed over TP), so the replicated router gets the whole gradient on every rank.

    Cost: vLLM's kernels take the local experts' weights stacked, ``w13 [E, 2I, H]`` and
    ``w2 [E, H, I]``; the layer stacks the per-expert parameters in every forward (one copy of the
    layer's local expert weights, in the model dtype, alive until the backward), and the
    backward's per-expert weight gradients flow back through the stack to each expert's own
    parameters."""

    #: its forward is its own: Megatron-Core's refusal of training at TP > 1 without sequence
    #: parallelism (its token dispatcher) does not apply (see distributed.forward.check_moe_training_layout)
    trains_at_tp_without_sequence_parallel = True

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, None]:  # fmt: skip
        if intermediate_tensors is not None:
            raise ZooError("numerics 'vllm-exact': the MoE block runs whole (no partial CUDA-graph capture)")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, _, ids = self.router(x)
        w13, w2 = self.stacked_expert_weights()
        group = self.block_reduce_group()
        if group is None:
            return self.combine(x, vllm_ops.fused_experts(x, w13, w2, weights, ids)).view(hidden_states.shape), None
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        from ..distributed.collectives import tree_order_all_reduce

        x = copy_to_tensor_model_parallel_region(x, group=group)
        weights = copy_to_tensor_model_parallel_region(weights, group=group)
        partial = vllm_ops.fused_experts(x, w13, w2, weights, ids, expert_map=self.expert_map(ids.device))
        return tree_order_all_reduce(self.combine(x, partial), group).view(hidden_states.shape), None

    def combine(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The block's output (this rank's partial under TP) as vLLM's ``MoERunner`` forms it from
        the routed experts' sum ``routed [n, H]``: times ``routed_scaling_factor`` (a model-dtype
        tensor times a Python float, where the factor is not 1), then the shared expert's output
        added (``shared + routed``, model dtype) - before the TP all-reduce. The shared expert is
        vLLM's ``DeepseekV2MLP`` on Megatron-Core's ``shared_experts`` weights (this rank's shards):
        ``linear_fc2(silu_and_mul(linear_fc1(x)))`` on vLLM's GEMM and activation kernels."""
        scale = getattr(self.config, "moe_router_topk_scaling_factor", None)
        if scale is not None and scale != 1.0:
            routed = routed * scale
        shared = getattr(self, "shared_experts", None)
        if shared is None:
            return routed
        if getattr(shared, "use_shared_expert_gate", False):
            raise ZooError("numerics 'vllm-exact' has no gated shared expert (Qwen2-MoE's sigmoid gate)")
        h = vllm_ops.silu_and_mul(vllm_ops.linear(x, shared.linear_fc1.weight))
        return vllm_ops.linear(h, shared.linear_fc2.weight) + routed

    def block_reduce_group(self) -> Any:
        """The group whose partial block outputs are summed: the tensor-parallel group (``None`` at
        TP1). Its ranks must be those that hold the other expert shards (expert-TP group) or the
        other experts (expert-parallel group), as in vLLM's engine at data parallel 1; another
        arrangement of Megatron-Core's groups is refused naming them."""
        from ..placement import group_size

        tp = getattr(self, "tp_group", None)
        if tp is None or group_size(tp) == 1:
            return None
        cached = getattr(self, "_zoo_reduce_group", None)
        if cached is not None:
            return cached
        import torch.distributed as dist

        experts = getattr(self.experts, "local_experts", None) or []
        etp = experts[0].linear_fc1.tp_group if experts else None
        ep = getattr(self, "ep_group", None)
        ranks = {name: (dist.get_process_group_ranks(g) if g is not None and group_size(g) > 1 else None)
                 for name, g in (("tp", tp), ("expert-tp", etp), ("ep", ep))}  # fmt: skip
        split = [name for name in ("expert-tp", "ep") if ranks[name] is not None]
        if split != ["expert-tp"] and split != ["ep"] or ranks[split[0]] != ranks["tp"]:
            raise ZooError(f"numerics 'vllm-exact': the MoE block sums its partial outputs over the tensor-parallel"
                           f" group {ranks['tp']}, which must hold either every expert's shards (expert-TP group,"
                           f" here {ranks['expert-tp']}) or all the experts (expert-parallel group, here {ranks['ep']}),"
                           " as vLLM's engine at data parallel 1")  # fmt: skip
        self._zoo_reduce_group = tp
        return tp

    def expert_map(self, device: torch.device) -> Optional[torch.Tensor]:
        """vLLM's ``expert_map`` of this rank (int32 ``[E]``: local index of each global expert, -1
        for another rank's), ``None`` without expert parallelism; made once per device."""
        local = list(getattr(self, "local_expert_indices", range(self.config.num_moe_experts)))
        if len(local) == self.config.num_moe_experts:
            return None
        cache = self.__dict__.setdefault("_zoo_expert_maps", {})
        if device not in cache:
            mapping = [-1] * self.config.num_moe_experts
            for i, e in enumerate(local):
                mapping[e] = i
            cache[device] = torch.tensor(mapping, dtype=torch.int32, device=device)
        return cache[device]

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E_local, 2I_local, H], w2 [E_local, H, I_local])`` stacked from the local experts'
        ``linear_fc1`` / ``linear_fc2`` weights (differentiable)."""
        experts = getattr(self.experts, "local_experts", None)
        if experts is None:
            raise ZooError(f"numerics 'vllm-exact' takes sequential experts, not {type(self.experts).__name__}")
        w13 = torch.stack([e.linear_fc1.weight for e in experts])
        w2 = torch.stack([e.linear_fc2.weight for e in experts])
        return w13, w2


def moe_submodule(arch: Any, pieces: dict[str, Any]) -> Any:
    """The ``TransformerLayerSubmodules.mlp`` of a ``vllm-exact`` MoE layer: :class:`VLLMMoELayer`
    with :class:`VLLMRouter` (grouped for a sigmoid router) and Megatron-Core's sequential experts
    and shared experts of ``pieces``' linears (their weights are what vLLM's kernels read)."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..compat import patch_moe_utils_without_te

    patch_moe_utils_without_te()
    moe = arch.moe
    linears = MLPSubmodules(linear_fc1=pieces["linear_fc1"], linear_fc2=pieces["linear_fc2"])
    groups = (moe.num_groups or 1, moe.group_topk or 1) if moe.router_score_function == "sigmoid" else None
    router = functools.partial(VLLMRouter, renormalize=moe.normalize_topk, groups=groups)
    shared = None
    if moe.shared_expert_ffn_hidden_size:  # its weights only: VLLMMoELayer.combine computes it
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        shared = ModuleSpec(module=SharedExpertMLP, submodules=linears)
    submodules = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=linears), shared_experts=shared,
                               router=router)  # fmt: skip
    if hasattr(MLP, "as_mlp_submodule"):  # 0.19: builder partials (see compat.mlp_submodule)
        return functools.partial(VLLMMoELayer, submodules=submodules)
    return ModuleSpec(module=VLLMMoELayer, submodules=submodules)


def pieces() -> dict[str, Any]:
    """The module classes of a ``vllm-exact`` layer (see :func:`mcore_zoo.specs.gpt._pieces`)."""
    return dict(
        input_layernorm=VLLMResidualRMSNorm,
        pre_mlp_layernorm=VLLMResidualRMSNorm,
        linear_qkv=VLLMColumnParallelLinear,
        linear_proj=VLLMRowParallelLinear,
        core_attention=VLLMAttention,
        linear_fc1=VLLMColumnParallelLinear,
        linear_fc2=VLLMRowParallelLinear,
        qk_norm=VLLMRMSNorm,
        final_norm=VLLMResidualRMSNorm,
        first_input_layernorm=VLLMRMSNorm,
        mlp=VLLMMLP,
    )


def check_supported(arch: Any, config: Any, numerics: Any) -> None:
    """Refuse, naming the reason, what the ``vllm-exact`` forward does not reproduce with the
    profile ``numerics`` (its ``vllm_decode`` knob)."""
    name = arch.architecture
    if arch.mla is not None:
        check_mla_supported(arch, config)
    if arch.moe is not None:
        check_moe_supported(arch, config, numerics)
    if arch.normalization != "RMSNorm":
        raise ZooError(f"{name}: numerics 'vllm-exact' needs RMSNorm, the model uses {arch.normalization}")
    if not getattr(config, "gated_linear_unit", False) or getattr(config, "activation_func", None) is not torch.nn.functional.silu:
        raise ZooError(f"{name}: numerics 'vllm-exact' needs a SwiGLU MLP (vLLM's silu_and_mul)")
    head_size = getattr(config, "kv_channels", None) or arch.head_dim
    # MLA: every token takes the absorbed kernel; a one-query decode step there equals the prefill
    # (measured on an H200 at DeepSeek-V3's head sizes: tests/gpu/test_vllm_exact_gpu.py)
    if arch.mla is None and numerics.vllm_decode == "exact" and not vllm_ops.decode_equals_prefill(head_size):
        raise ZooError(
            f"{name}: numerics 'vllm-exact' cannot reproduce vLLM's decode steps at head size {head_size}: at head"
            " sizes <= 64 vLLM's FlashAttention-3 computes a one-query decode step with another tiling than a"
            " prefill, so tokens at positions >= 128 that the engine sampled while decoding differ in the last"
            " bits (mcore_zoo.kernels.vllm_ops.decode_equals_prefill). To compute every token as vLLM's prefill"
            " does (prompt tokens and positions < 128 stay bitwise), use"
            " get_profile('vllm-exact').with_knobs(vllm_decode='prefill')"
        )
    padded = getattr(arch, "padded_vocab_size", None)
    if padded is not None and padded != arch.vocab_size:
        raise ZooError(f"{name}: numerics 'vllm-exact' needs the HF vocabulary ({arch.vocab_size}) as it is, not padded"
                       f" to {padded} (make_vocab_size_divisible_by): vLLM's log-prob kernel reduces over the real"
                       " vocabulary only")  # fmt: skip
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ZooError(f"{name}: numerics 'vllm-exact' supports context_parallel_size=1 only, got {config.context_parallel_size}")
    if getattr(config, "sequence_parallel", False):
        raise ZooError(f"{name}: numerics 'vllm-exact' does not support sequence parallelism")
    if arch.mla is None and getattr(config, "rotary_interleaved", False):
        raise ZooError(f"{name}: numerics 'vllm-exact' implements NeoX-style RoPE for the dense attention")


#: the multi-head latent attention architectures whose layer :func:`vllm_mla_attention_class` computes as vLLM does
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def check_mla_supported(arch: Any, config: Any) -> None:
    """Refuse, naming the reason, an MLA model the ``vllm-exact`` layer does not compute as vLLM's
    ``DeepseekV2MLAAttention`` does: architectures other than DeepSeek-V3's, DeepSeek sparse
    attention, RoPE other than GPT-J pairs with default or YaRN scaling, the widths where vLLM
    picks GEMM kernels by token count (:func:`token_count_kernels`)."""
    name, mla = arch.architecture, arch.mla
    if name not in MLA_ARCHITECTURES:
        raise ZooError(f"{name}: numerics 'vllm-exact' computes the multi-head latent attention of"
                       f" {', '.join(MLA_ARCHITECTURES)} only")  # fmt: skip
    if mla.indexer is not None:
        raise ZooError(f"{name}: numerics 'vllm-exact' has no kernels for DeepSeek sparse attention (the lightning"
                       " indexer) yet")  # fmt: skip
    if not mla.rope_interleave or mla.rope_complex:
        raise ZooError(f"{name}: numerics 'vllm-exact' rotates MLA's rope dims as GPT-J pairs (vLLM's"
                       " is_neox_style=False); this model's RoPE is another")  # fmt: skip
    if arch.rope.rope_type not in ("default", "yarn"):
        raise ZooError(f"{name}: numerics 'vllm-exact' builds MLA's RoPE cache for rope_type default or yarn"
                       f" (vLLM's deepseek_yarn), not {arch.rope.rope_type!r}")  # fmt: skip
    switches = token_count_kernels(arch)
    if switches:
        raise ZooError(f"{name}: at this width vLLM 0.26 picks {' and '.join(switches)} by the step's token count, not"
                       " its batch-invariant GEMM: the engine itself gives a token other bits in a step of up to 16"
                       " tokens than in a larger one, so numerics 'vllm-exact' cannot reproduce every token")  # fmt: skip


#: (out, in) of the fused q / kv down projection for which vLLM's DeepSeek layer runs
#: ``dsv3_fused_a_gemm`` (up to 16 tokens) or cuBLAS (``DeepSeekV2FusedQkvAProjLinear``)
MIN_LATENCY_A_GEMM = (2112, 7168)
#: (hidden, experts) for which vLLM's ``GateLinear`` runs ``dsv3_router_gemm`` up to 16 tokens
DSV3_ROUTER_GEMM = {(7168, 256), (7168, 384), (6144, 256)}


def token_count_kernels(arch: Any) -> list[str]:
    """The GEMMs vLLM 0.26 (bf16, Hopper / Blackwell) runs with a kernel chosen by the step's token
    count for ``arch`` (``deepseek_v2.py``, ``fused_moe/router/gate_linear.py``): they exist only at
    DeepSeek-V3's / Kimi-K2's / GLM-5's own widths. Empty for every other width."""
    mla, moe, found = arch.mla, arch.moe, []
    hidden = arch.hidden_size
    if mla is not None and mla.q_lora_rank is not None:
        fused = mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim
        if (fused, hidden) == MIN_LATENCY_A_GEMM:
            found.append(f"the fused q / kv down projection ({fused} x {hidden}: dsv3_fused_a_gemm or cuBLAS)")
    if moe is not None and (hidden, moe.num_experts) in DSV3_ROUTER_GEMM:
        found.append(f"the router GEMM ({moe.num_experts} x {hidden}: dsv3_router_gemm)")
    return found


#: the MoE architectures whose block :class:`VLLMMoELayer` computes as vLLM does, and their router:
#: ``"softmax"`` (vLLM's ``topk_softmax``) or ``"grouped-sigmoid"`` (its ``grouped_topk``: sigmoid
#: scores, score-correction bias, expert groups; ``routed_scaling_factor`` on the output)
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "softmax", "DeepseekV3ForCausalLM": "grouped-sigmoid"}


def check_moe_supported(arch: Any, config: Any, numerics: Any) -> None:
    """Refuse, naming the reason, an MoE model or layout whose block the ``vllm-exact`` forward does
    not compute as vLLM does: architectures other than Qwen3-MoE's and DeepSeek-V3's router and
    experts, gated shared experts, and parallel layouts other than vLLM's at data parallel 1 (TP N
    with expert TP N, or TP N with expert parallel N and expert TP 1; no sequence parallelism)."""
    name, moe = arch.architecture, arch.moe
    if moe.softmax_over_topk or moe.clamped_swiglu is not None:
        raise ZooError(f"{name}: numerics 'vllm-exact' has no kernels for gpt-oss's MoE (softmax over the top-k"
                       " logits, clamped SwiGLU experts with biases) yet")  # fmt: skip
    if moe.shared_expert_gate:
        raise ZooError(f"{name}: numerics 'vllm-exact' has no gated shared-expert MoE yet (Qwen2-MoE's sigmoid"
                       " gate on the shared expert)")  # fmt: skip
    router = MOE_ARCHITECTURES.get(name)
    if router is None:
        raise ZooError(f"{name}: numerics 'vllm-exact' computes the MoE block of {', '.join(MOE_ARCHITECTURES)} only"
                       " (softmax top-k or DeepSeek-V3's grouped sigmoid router, SwiGLU experts)")  # fmt: skip
    if router == "softmax" and (moe.router_score_function != "softmax" or moe.router_expert_bias or moe.num_groups
                                or moe.topk_scaling_factor or moe.shared_expert_ffn_hidden_size):  # fmt: skip
        raise ZooError(f"{name}: numerics 'vllm-exact' implements vLLM's plain softmax top-k router for this"
                       " architecture (no sigmoid scores, expert bias, expert groups, scaling or shared expert)")  # fmt: skip
    if router == "grouped-sigmoid" and (moe.router_score_function != "sigmoid" or not moe.router_expert_bias
                                        or moe.group_score_topk != 2 or moe.group_mask_value != float("-inf")):  # fmt: skip
        raise ZooError(f"{name}: numerics 'vllm-exact' implements vLLM's grouped_topk router for this architecture:"
                       " sigmoid scores with the score-correction bias, groups scored by their best two, the"
                       " other groups masked out")  # fmt: skip
    if moe.aux_loss_coeff:
        raise ZooError(f"{name}: numerics 'vllm-exact' routes as vLLM's inference kernel, which has no"
                       f" load-balancing loss: set router_aux_loss_coef=0 (got {moe.aux_loss_coeff})")  # fmt: skip
    if numerics.grouped_experts:
        raise ZooError(f"{name}: numerics 'vllm-exact' runs vLLM's fused-MoE kernel on the sequential experts'"
                       " weights: set grouped_experts=False")  # fmt: skip
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp  # None: the expert split follows TP
    if (ep, etp) not in ((1, tp), (tp, 1)):
        raise ZooError(f"{name}: numerics 'vllm-exact' computes the MoE block in the layouts of vLLM's engine at"
                       f" tensor_parallel_size={tp} (data parallel 1): expert_tensor_parallel_size={tp} without expert"
                       f" parallelism (every expert's intermediate dimension split over TP), or"
                       f" expert_model_parallel_size={tp} with expert_tensor_parallel_size=1 (enable_expert_parallel=True:"
                       f" whole experts split over the TP ranks); got tensor_model_parallel_size={tp},"
                       f" expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}")  # fmt: skip
    if getattr(config, "sequence_parallel", False):
        raise ZooError(f"{name}: numerics 'vllm-exact' does not support sequence parallelism (vLLM's MoE block"
                       " at data parallel 1 takes every token on every TP rank)")  # fmt: skip


def install(model: torch.nn.Module, arch: Any, config: Any, dtype: torch.dtype) -> None:
    """Finish a ``vllm-exact`` GPTModel: its output layer on vLLM's GEMM and its RoPE on vLLM's
    kernel and cos / sin cache (``config.zoo_vllm_rope``, read by the RoPE hook, or by the MLA
    layers: GPT-J pairs of ``qk_rope_head_dim``)."""
    from .rope_dispatch import install as install_rope_dispatch

    reference = vllm_ops.using_reference()  # tests: torch kernels, no vLLM
    if not reference:
        vllm_ops.require_vllm()
    head = getattr(model, "output_layer", None)
    if head is not None and type(head) is ColumnParallelLinear:
        head.__class__ = VLLMColumnParallelLinear  # same module, vLLM's GEMM (no state changes)
    rotary = getattr(model, "rotary_pos_emb", None)
    if arch.mla is not None and getattr(config, "zoo_vllm_rope", None) is None:  # read by VLLMMLASelfAttention
        config.zoo_vllm_rope = _mla_rope(arch, dtype, reference, next(model.parameters()).device)
    elif rotary is not None and getattr(config, "zoo_vllm_rope", None) is None:
        if reference:
            device = next(model.parameters()).device
            config.zoo_vllm_rope = vllm_ops.VLLMRope.reference(rotary.inv_freq, arch.max_position_embeddings,
                                                               arch.head_dim, dtype, device)  # fmt: skip
        else:
            config.zoo_vllm_rope = vllm_ops.VLLMRope.from_hf_config(
                dict(arch.hf_config), arch.head_dim, dtype, torch.device("cuda", torch.cuda.current_device())
            )
    install_rope_dispatch()  # vLLM's RoPE for a config carrying zoo_vllm_rope


def _mla_rope(arch: Any, dtype: torch.dtype, reference: bool, device: torch.device) -> vllm_ops.VLLMRope:
    """MLA's RoPE cache: vLLM's (``get_rope`` on the GPU, ``deepseek_yarn``), or for the torch
    stand-ins the same formula on transformers' frequencies and YaRN attention factor."""
    rot = arch.mla.qk_rope_head_dim
    if not reference:
        return vllm_ops.VLLMRope.from_hf_config(dict(arch.hf_config), rot, dtype,
                                                torch.device("cuda", torch.cuda.current_device()), mla=True)  # fmt: skip
    from ..config.rope import inv_freq

    freqs, scaling = inv_freq(arch.rope, rot, arch.max_position_embeddings)
    return vllm_ops.VLLMRope.reference(freqs, arch.max_position_embeddings, rot, dtype, device, scale=float(scaling),
                                       neox=False)  # fmt: skip
