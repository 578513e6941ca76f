"""vLLM's batch-invariant kernels with autograd, for the ``vllm-exact`` numerics profile.

With ``VLLM_BATCH_INVARIANT=1`` (and ``enforce_eager=True``) vLLM computes a dense decoder with a
fixed set of kernels whose per-token results do not depend on the batch: a Triton persistent GEMM
(``matmul_persistent``; bias added after), a Triton RMSNorm (no residual), its CUDA fused
add + RMSNorm (with a residual), RoPE in torch ops (``forward_static``), its CUDA SiLU-and-mul
kernel, FlashAttention-3 over the paged KV cache with ``num_splits=1``, and for log-probs its GPU
model runner's fused Triton kernel on the model-dtype logits (``compute_token_logprobs``) - or,
where the engine runs its V1 model runner (vLLM 0.26's default for MoE models outside a short
list: :func:`engine_model_runner`), ``log_softmax`` in fp32 (batch-invariant Triton kernel). An
unquantized MoE block (Qwen3-MoE) runs its ``FusedMoE`` layer with the ``topk_softmax`` router
kernel and ``TritonExperts`` - two Triton fused-MoE GEMMs at a fixed tile config, SiLU-and-mul
between them, the routing weight applied in the second GEMM's fp32 accumulator, ``moe_sum``
over the k slots (:func:`moe_topk_softmax`, :func:`fused_experts`).
(Which implementation each op runs was read from the engine:
``bench/gpu/vllm_exact_probe.py`` reports the dispatch and compares layer 0 op by op.)
This module calls exactly those kernels (imported from the installed vLLM) so that a trainer's
forward reproduces vLLM's log-probs bit for bit, and gives each one a backward (computed with
ordinary torch ops in fp32 / the model dtype: only the forward must match vLLM).

Contract of every op here: inputs on one CUDA device, the model dtype (bf16 / fp16) unless said
otherwise; outputs new tensors (vLLM's in-place kernels run on copies).

The kernel table is swappable (:func:`use_kernels`): :class:`ReferenceKernels` implements the same
arithmetic with torch ops, so the backward formulas are tested on the CPU; bitwise agreement with
vLLM itself needs vLLM's kernels and a GPU (tests/gpu/test_vllm_exact_gpu.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..errors import ZooError

ENV = "VLLM_BATCH_INVARIANT"
PAGE_SIZE = 16  # vLLM's KV-cache block size for FlashAttention on CUDA (FA3 tiles depend on it)
#: vLLM's fused add + RMSNorm kernel picks its thread-block size by the number of tokens of the call
#: (1024 threads below 256 tokens, 256 from 256 on), which changes its reduction order: vLLM itself
#: is not batch-invariant across that boundary. The trainer launches it on at most this many rows,
#: reproducing every engine step of fewer than 256 tokens (decode steps of < 256 sequences).
FUSED_NORM_TOKENS = 255
#: the Triton fused-MoE kernel's tiles under ``VLLM_BATCH_INVARIANT=1`` (vLLM 0.26's
#: ``fused_moe.get_default_config``; its tuned per-shape configs are skipped in that mode)
MOE_BATCH_INVARIANT_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8, "SPLIT_K": 1}


def decode_equals_prefill(head_size: int) -> bool:
    """Whether vLLM's FlashAttention-3 (paged cache of :data:`PAGE_SIZE`-token blocks, ``num_splits=1``)
    gives a token's attention output the same bits in a decode step (``max_seqlen_q=1``: one query
    per sequence over its cached keys) as in a prefill of its whole sequence - the computation the
    trainer's pack reproduces.

    Measured on an H100 with vLLM 0.26 (``bench/gpu/vllm_exact_decode_probe.py``; asserted by
    ``tests/gpu/test_vllm_exact_gpu.py``): equal at head sizes 80, 96, 128, 192 and 256; at 16, 32
    and 64 the rows at positions >= 128 (past the first 128-key tile) differ in the last bits. FA3
    runs a call with ``max_seqlen_q == 1`` as non-causal except at 64 < head size <= 128 with a
    paged cache; at 16 and 32 that switch is the whole difference (the same call with
    ``max_seqlen_q=2`` equals the prefill, so vLLM itself gives a token other bits in a pure decode
    step than in a step that also prefills another request); at 64 a one-query call differs from
    the prefill with ``max_seqlen_q=2`` as well.
    """
    return head_size > 64


class VLLMKernels:
    """vLLM 0.26's batch-invariant kernels (CUDA). Constructing it checks they can run."""

    def __init__(self) -> None:
        require_vllm()
        from vllm.model_executor.layers import batch_invariant as bi

        self._bi = bi
        self._ops = torch.ops._C

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``[n, in] @ [out, in].T -> [n, out]`` (vLLM's ``linear_batch_invariant`` without bias)."""
        return self._bi.matmul_persistent(x, weight.t())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """vLLM's ``RMSNorm(x)`` without residual: the Triton row kernel."""
        return self._bi.rms_norm_batch_invariant(x, weight, eps)

    def residual_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """vLLM's ``RMSNorm(input, residual)`` output where ``x = input + residual`` (already summed
        in the model dtype, as the kernel sums them): the CUDA fused kernel, run on ``0 + x``, in
        launches of at most :data:`FUSED_NORM_TOKENS` rows (see there)."""
        out = torch.zeros_like(x)
        residual = x.contiguous().clone()
        weight = weight.contiguous()
        for start in range(0, x.shape[0], FUSED_NORM_TOKENS):
            end = min(start + FUSED_NORM_TOKENS, x.shape[0])
            self._ops.fused_add_rms_norm(out[start:end], residual[start:end], weight, eps)
        return out

    def rotary(self, positions: torch.Tensor, x: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
               neox: bool = True) -> torch.Tensor:  # fmt: skip
        """RoPE of ``x [n, heads * head_size]`` at ``positions [n]``, NeoX style (halves) or GPT-J
        style (``neox=False``: adjacent pairs, DeepSeek's MLA): vLLM's
        ``RotaryEmbedding.forward_static``, the torch ops its engine runs under ``enforce_eager`` in
        batch-invariant mode (the RoPE custom op is not enabled there; measured on vLLM 0.26 for the
        dense models: ``forward_native``), in the model dtype."""
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        out, _ = RotaryEmbedding.forward_static(positions, x, None, head_size, cos_sin_cache.shape[-1], cos_sin_cache, neox)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :d]) * x[:, d:]`` (vLLM's CUDA kernel)."""
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        self._ops.silu_and_mul(out, x.contiguous())
        return out

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row log-softmax of fp32 ``x [n, V]`` (vLLM's Triton kernel)."""
        return self._bi.log_softmax(x, dim=-1)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """``log_softmax(logits)[target]`` per row as vLLM's GPU model runner (the default engine
        worker of 0.26) computes sampled and prompt log-probs: its fused Triton kernel
        (``compute_token_logprobs``: max, then sum of exp in fp32, then the targets only) on the
        logits in the model dtype - the kernel's reduction follows the dtype it loads, so fp32 copies
        of the same logits differ in the last bit. ``None`` where this vLLM has no such kernel."""
        try:
            from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
        except ImportError:
            return None
        return compute_token_logprobs(logits.contiguous(), targets.reshape(-1, 1))[:, 0]

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                        scale: float, window: Optional[int]) -> torch.Tensor:  # fmt: skip
        """Causal attention of packed sequences, as vLLM's FlashAttention backend computes a prefill.

        ``q [T, h, d]``, ``k / v [T, g, d]`` (sequences back to back, ``lengths`` int [B]); K/V are
        laid out in a paged cache of :data:`PAGE_SIZE`-token blocks (one block table row per
        sequence) because FlashAttention-3 picks its tiles by the cache layout.
        """
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cache_k, cache_v, table, seqused, cu = _paged(k, v, lengths=lengths)
        out = torch.empty_like(q)
        descale = torch.ones(1, dtype=torch.float32, device=q.device).expand(lengths.numel(), k.shape[1])
        flash_attn_varlen_func(
            q=q, k=cache_k, v=cache_v, out=out, cu_seqlens_q=cu, max_seqlen_q=int(lengths.max()),
            seqused_k=seqused, max_seqlen_k=int(lengths.max()), softmax_scale=scale, causal=True,
            alibi_slopes=None, window_size=[-1, -1] if window is None else [window - 1, 0], block_table=table,
            softcap=0.0, scheduler_metadata=None, fa_version=get_flash_attn_version(), q_descale=None,
            k_descale=descale, v_descale=descale, num_splits=1,
        )  # fmt: skip
        return out

    def mla_absorbed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                               w_uk_t: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """MLA attention in its absorbed form, as vLLM's ``FLASH_ATTN_MLA`` backend computes every
        token of a step whose requests have at most 512 query tokens (``forward_mqa``): the
        batch-invariant Triton ``bmm`` of ``q_nope`` and ``W_UK``, FlashAttention-3 with ``q_v`` over
        a paged latent cache (``[kv_c | k_pe]`` per token, one head), the ``bmm`` with ``W_UV``.
        Shapes: see :func:`mla_absorbed_attention`."""
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        w_uk_t, w_uv = w_uk_t.contiguous(), w_uv.contiguous()  # vLLM keeps copies of them
        ql_nope = self._bi.bmm_batch_invariant(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)  # [T, N, L]
        latent = torch.cat([kv_c, k_pe], dim=-1)[:, None, :]
        cache, table, seqused, cu = _paged(latent, lengths=lengths)
        cache = cache[:, :, 0, :]  # [blocks, PAGE_SIZE, L + R]
        rank = kv_c.shape[-1]
        attn = flash_attn_varlen_func(
            q=q_pe, k=cache[..., rank:].unsqueeze(-2), v=cache[..., :rank].unsqueeze(-2), q_v=ql_nope,
            max_seqlen_q=int(lengths.max()), cu_seqlens_q=cu, max_seqlen_k=int(lengths.max()), seqused_k=seqused,
            block_table=table, softmax_scale=scale, causal=True, fa_version=3, num_splits=1,
        )  # fmt: skip
        return self._bi.bmm_batch_invariant(attn.transpose(0, 1), w_uv).transpose(0, 1)  # [T, N, V]

    # ---- MoE (unquantized, TP1): the path of vLLM's ``FusedMoE`` with ``TritonExperts``
    def moe_topk_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights fp32 [n, k], experts int32 [n, k])`` from router logits ``[n, E]`` (the model
        dtype): vLLM's ``fused_topk`` (its ``FusedTopKRouter``), the CUDA ``topk_softmax`` kernel -
        softmax over all experts in fp32, the k largest in descending order, divided by their sum
        when ``renormalize`` (``norm_topk_prob``)."""
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

        weights, ids, _ = fused_topk(logits, logits.contiguous(), top_k, renormalize)
        return weights, ids

    def moe_grouped_topk(self, logits: torch.Tensor, top_k: int, num_groups: int, topk_group: int,
                         renormalize: bool, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(weights fp32 [n, k], experts int32 [n, k])`` of the sigmoid group-limited router with a
        score-correction bias (DeepSeek-V3): vLLM's ``fused_grouped_topk`` - the CUDA
        ``grouped_topk`` kernel its ``GroupedTopKRouter`` calls in that case - without the routed
        scale (vLLM applies it to the block's output)."""
        from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import fused_grouped_topk

        return fused_grouped_topk(logits, logits, top_k, renormalize, bias, num_expert_group=num_groups,
                                  topk_group=topk_group, scoring_func="sigmoid", routed_scaling_factor=1.0)  # fmt: skip

    def moe_config(self, w13_shape: tuple, w2_shape: tuple, top_k: int, num_tokens: int) -> dict:
        """The Triton fused-MoE kernel's tile config as ``TritonExperts`` picks it; under
        ``VLLM_BATCH_INVARIANT=1`` vLLM's fixed one (``get_default_config``: BLOCK 64 / 64 / 32,
        GROUP 8, SPLIT_K 1)."""
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        return try_get_optimal_moe_config(tuple(w13_shape), tuple(w2_shape), top_k, None, num_tokens)

    def moe_gemm(self, a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor],
                 per_slot: bool, config: dict, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """One of ``TritonExperts``' two grouped GEMMs on vLLM's Triton ``fused_moe_kernel``:
        ``out[t, j] = a[row] @ w[ids[t, j]].T`` -> ``[n, k, N]`` in ``a``'s dtype, with ``row = t``
        (``a [n, K]``, the first GEMM: top_k = k) or ``row = t * k + j`` (``per_slot``: ``a [n * k, K]``,
        the second GEMM: top_k = 1). fp32 accumulation; ``weights [n, k]`` (fp32): the accumulator
        is multiplied by the slot's routing weight in fp32 before the one cast (the second GEMM,
        ``mul_routed_weight``). ``expert_map`` (int32 ``[E_global]``, vLLM's: the local index of a
        global expert, -1 where another rank holds it): ``ids`` are global and ``w`` holds this
        rank's experts; the kernel writes zeros for the slots of experts mapped to -1."""
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            _prepare_expert_assignment,
            invoke_fused_moe_triton_kernel,
        )
        from vllm.triton_utils import tl

        n, k = ids.shape
        experts = w.shape[0] if expert_map is None else expert_map.shape[0]  # global_num_experts
        sorted_ids, expert_ids, padded = _prepare_expert_assignment(ids, config, n, k, experts, expert_map)
        out = a.new_empty(n, k, w.shape[1])
        compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[a.dtype]
        invoke_fused_moe_triton_kernel(
            a.contiguous(), w.contiguous(), out, None, None, weights, sorted_ids, expert_ids, padded,
            weights is not None, 1 if per_slot else k, config, compute_type=compute_type, use_fp8_w8a8=False,
            use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
            block_shape=None, B_bias=None,
        )  # fmt: skip
        return out

    def moe_sum(self, y: torch.Tensor) -> torch.Tensor:
        """``y [n, k, H]`` summed over the k slots (vLLM's CUDA ``moe_sum``, as ``TritonExperts``
        reduces)."""
        from vllm import _custom_ops as ops

        out = y.new_empty(y.shape[0], y.shape[2])
        ops.moe_sum(y.contiguous(), out)
        return out


def _paged(*per_token: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Packed per-token tensors (``k / v [T, g, d]``; MLA: the latents ``[T, 1, L + R]``) -> one paged
    cache ``[blocks, PAGE_SIZE, ...]`` each, then the int32 block table ``[B, max_blocks]``,
    ``seqused_k`` int32 ``[B]`` and ``cu_seqlens_q`` int32 ``[B + 1]``."""
    k = per_token[0]
    device = k.device
    lengths = lengths.to(device=device, dtype=torch.int32)
    blocks = (lengths + PAGE_SIZE - 1) // PAGE_SIZE
    first = torch.cumsum(blocks, 0) - blocks
    total = int(blocks.sum())
    width = int(blocks.max())
    table = first[:, None] + torch.arange(width, device=device, dtype=torch.int32)[None, :]
    table = torch.where(torch.arange(width, device=device)[None, :] < blocks[:, None], table, 0).to(torch.int32)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.long())
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    pos = torch.arange(k.shape[0], device=device) - cu[:-1].long()[seq]
    slot = first.long()[seq] * PAGE_SIZE + pos
    caches = []
    for t in per_token:
        cache = t.new_zeros(total * PAGE_SIZE, *t.shape[1:])
        cache[slot] = t
        caches.append(cache.view(total, PAGE_SIZE, *t.shape[1:]))
    return (*caches, table, lengths, cu)


class ReferenceKernels:
    """The same arithmetic as :class:`VLLMKernels` in torch ops (any device): what vLLM's kernels
    compute up to their reduction order. For testing the backward formulas on the CPU."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (_acc(x) @ _acc(weight).t()).to(x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _acc(x)
        inv = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * inv * _acc(weight)).to(x.dtype)

    def residual_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = _acc(x)
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * inv).to(x.dtype) * weight

    def rotary(self, positions: torch.Tensor, x: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
               neox: bool = True) -> torch.Tensor:  # fmt: skip
        cos, sin = cos_sin_cache[positions].to(x.dtype).chunk(2, dim=-1)  # [n, rot / 2]
        c, s = cos[:, None, :], sin[:, None, :]
        return _rotate(x.reshape(x.shape[0], -1, head_size), c, s, neox).reshape(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(_acc(x[:, :d])).to(x.dtype) * x[:, d:]

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        return None  # no engine kernel: the log-softmax's values stand

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                        scale: float, window: Optional[int]) -> torch.Tensor:  # fmt: skip
        return _reference_attention(q, k, v, lengths, scale, window)

    def mla_absorbed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                               w_uk_t: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        ql_nope = torch.einsum("tnp,npl->tnl", _acc(q_nope), _acc(w_uk_t)).to(q_nope.dtype)
        attn = _reference_latent_attention(ql_nope, q_pe, kv_c, k_pe, lengths, scale).to(q_nope.dtype)
        return torch.einsum("tnl,nlv->tnv", _acc(attn), _acc(w_uv)).to(q_nope.dtype)

    def moe_topk_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(_acc(logits), dim=-1)
        ids = torch.topk(probs, top_k, dim=-1).indices.to(torch.int32)  # descending, as the kernel
        return _routing_weights(_acc(logits), ids, renormalize), ids

    def moe_grouped_topk(self, logits: torch.Tensor, top_k: int, num_groups: int, topk_group: int,
                         renormalize: bool, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        biased = _sigmoid_scores(logits) + bias.float()  # selection only
        n, experts = biased.shape
        groups = biased.view(n, num_groups, experts // num_groups).topk(min(2, experts // num_groups), dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups, dtype=torch.bool).scatter(1, groups.topk(topk_group, dim=-1).indices, True)
        masked = biased.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
        ids = masked.topk(top_k, dim=-1).indices.to(torch.int32)  # descending biased score, as the kernel
        return _grouped_weights(logits, ids, renormalize), ids

    def moe_config(self, w13_shape: tuple, w2_shape: tuple, top_k: int, num_tokens: int) -> dict:
        return dict(MOE_BATCH_INVARIANT_CONFIG)

    def moe_gemm(self, a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor],
                 per_slot: bool, config: dict, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        n, k = ids.shape
        flat = _local_experts(ids, expert_map)
        src = _slot_rows(n, k, per_slot, a.device)
        out = torch.zeros(n * k, w.shape[1], dtype=_acc(a).dtype, device=a.device)  # slots of other ranks: 0
        for e in flat.unique().tolist():
            if e < 0:
                continue
            sel = (flat == e).nonzero().squeeze(1)
            out[sel] = _acc(a[src[sel]]) @ _acc(w[e]).t()
        if weights is not None:
            out = out * _acc(weights).reshape(-1, 1)
        return out.to(a.dtype).view(n, k, w.shape[1])

    def moe_sum(self, y: torch.Tensor) -> torch.Tensor:
        return _acc(y).sum(dim=1).to(y.dtype)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                         window: Optional[int]) -> torch.Tensor:  # fmt: skip
    """Causal (optionally windowed) attention per packed sequence in fp32, differentiable:
    ``q [T, h, d]``, ``k / v [T, g, d]`` -> ``[T, h, d]`` in ``q``'s dtype."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths.tolist():
        qs, ks, vs = (_acc(t[start : start + n]).transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i = torch.arange(n, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        scores = (qs @ ks.transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


def _reference_latent_attention(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                                lengths: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention over the latents per packed sequence (:func:`_reference_attention`: fp32,
    fp64 stays, differentiable): scores ``scale * (q_pe . k_pe + ql_nope . kv_c)`` - one dot product
    of ``[ql_nope | q_pe]`` with the shared key ``[kv_c | k_pe]`` - values ``kv_c``. ``ql_nope
    [T, N, L]``, ``q_pe [T, N, R]``, ``kv_c [T, L]``, ``k_pe [T, R]`` -> ``[T, N, L]``."""
    q = torch.cat([_acc(ql_nope), _acc(q_pe)], dim=-1)
    k = torch.cat([_acc(kv_c), _acc(k_pe)], dim=-1)[:, None, :]
    return _reference_attention(q, k, _acc(kv_c)[:, None, :], lengths, scale, None)


def _mla_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                   w_uk_t: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """:func:`mla_absorbed_attention` in one precision (the inputs' accumulation dtype), differentiable."""
    ql_nope = torch.einsum("tnp,npl->tnl", q_nope, w_uk_t)
    return torch.einsum("tnl,nlv->tnv", _reference_latent_attention(ql_nope, q_pe, kv_c, k_pe, lengths, scale), w_uv)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its accumulation dtype: fp32, or fp64 for fp64 tensors."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


_ACTIVE = threading.local()


def kernels() -> Any:
    """The kernel table in use (vLLM's unless :func:`use_kernels` says otherwise)."""
    table = getattr(_ACTIVE, "kernels", None)
    if table is None:
        table = _vllm_kernels()
    return table


_VLLM: Optional[VLLMKernels] = None


def _vllm_kernels() -> VLLMKernels:
    global _VLLM
    if _VLLM is None:
        _VLLM = VLLMKernels()
    return _VLLM


def using_reference() -> bool:
    """Whether this thread runs :class:`ReferenceKernels` (no vLLM needed)."""
    return isinstance(getattr(_ACTIVE, "kernels", None), ReferenceKernels)


@contextlib.contextmanager
def use_kernels(table: Any) -> Iterator[None]:
    """Run the ops of this module with ``table`` (e.g. :class:`ReferenceKernels`) on this thread."""
    saved = getattr(_ACTIVE, "kernels", None)
    _ACTIVE.kernels = table
    try:
        yield
    finally:
        _ACTIVE.kernels = saved


def require_vllm() -> None:
    """Raise a :class:`ZooError` naming what is missing for vLLM's batch-invariant kernels: CUDA,
    vLLM, and ``VLLM_BATCH_INVARIANT=1`` in the environment (vLLM's CUDA kernels read it once)."""
    if not torch.cuda.is_available():
        raise ZooError("numerics 'vllm-exact' runs vLLM's CUDA kernels: it needs a CUDA GPU")
    if os.environ.get(ENV) != "1":
        raise ZooError(
            f"numerics 'vllm-exact' matches vLLM's batch-invariant mode: set {ENV}=1 in the environment before"
            " vLLM is imported (its kernels read it once), in the trainer as in the engine"
        )
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        from vllm.model_executor.layers import batch_invariant  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the installation
        raise ZooError(f"numerics 'vllm-exact' needs vLLM's kernels; importing vLLM failed: {exc}") from exc


# ---------------------------------------------------------------------------- autograd ops
def _fp32_grads(fn: Any, inputs: tuple[torch.Tensor, ...], needs: tuple[bool, ...], grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    """Gradients of ``fn(*inputs)`` recomputed in fp32 (fp64 stays fp64) for ``grad``, for the
    inputs flagged in ``needs``, each cast back to its input's dtype."""
    with torch.enable_grad():
        leaves = [_acc(t.detach()).requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        out = fn(*leaves)
        wanted = [x for x in leaves if x.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, _acc(grad), allow_unused=True)) if wanted else iter(())
    return tuple(next(got).to(t.dtype) if x.requires_grad else None for x, t in zip(leaves, inputs))


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        return kernels().linear(flat, weight).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0])
        gx = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in]`` times ``weight [out, in]`` transposed, then ``+ bias`` as a separate op (vLLM)."""
    out = _Linear.apply(x, weight)
    return out if bias is None else out + bias


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, residual_kernel: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        flat = x.reshape(-1, x.shape[-1])
        table = kernels()
        out = table.residual_rms_norm(flat, weight, eps) if residual_kernel else table.rms_norm(flat, weight, eps)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        gx, gw = _fp32_grads(lambda a, w: _rms(a, w, ctx.eps), (x, weight), ctx.needs_input_grad[:2], grad)
        return gx, gw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: bool) -> torch.Tensor:
    """RMSNorm over the last dim of ``x``. ``residual``: vLLM's fused add + norm kernel (the norm
    vLLM applies where a residual is passed: every decoder norm but the first layer's input norm,
    and the final norm); else its Triton kernel (first input norm, q / k norms)."""
    return _RMSNorm.apply(x, weight, float(eps), bool(residual))


def _rotate(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor, neox: bool) -> torch.Tensor:
    """``t [n, h, head_size]``'s first ``2 * c.shape[-1]`` dims rotated by the angles whose cos / sin
    are ``c`` / ``s`` (``[n, 1, rot / 2]``), the rest passed through: pairs ``(i, i + rot / 2)``
    (NeoX) or ``(2i, 2i + 1)`` (GPT-J), in ``t``'s dtype, as vLLM's ``ApplyRotaryEmb.forward_static``."""
    half = c.shape[-1]
    rot, rest = t[..., : 2 * half], t[..., 2 * half :]
    x1, x2 = (rot[..., :half], rot[..., half:]) if neox else (rot[..., ::2], rot[..., 1::2])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.cat([o1, o2], dim=-1) if neox else torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, head_size: int,
                neox: bool) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(positions, cache)
        ctx.head_size, ctx.neox = head_size, neox
        return kernels().rotary(positions, x, head_size, cache, neox)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        positions, cache = ctx.saved_tensors
        # the rotation by -angle (fp32, cast to the gradient's dtype)
        cos, sin = _acc(cache[positions]).chunk(2, dim=-1)
        g = _acc(grad).reshape(grad.shape[0], -1, ctx.head_size)
        gx = _rotate(g, cos[:, None, :], -sin[:, None, :], ctx.neox)
        return gx.reshape(grad.shape).to(grad.dtype), None, None, None, None


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int, *,
           neox: bool = True) -> torch.Tensor:  # fmt: skip
    """RoPE of ``x [n, heads * head_size]`` at ``positions [n]`` (vLLM's kernel; ``cos_sin_cache
    [P, rot]`` as vLLM builds it: ``cat(cos, sin)``): NeoX style, or GPT-J style (``neox=False``,
    adjacent pairs, as vLLM rotates DeepSeek's MLA)."""
    return _Rotary.apply(x, positions, cos_sin_cache, int(head_size), bool(neox))


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        return kernels().silu_and_mul(flat).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        (x,) = ctx.saved_tensors
        d = x.shape[-1] // 2
        return _fp32_grads(lambda a: torch.nn.functional.silu(a[..., :d]) * a[..., d:], (x,), ctx.needs_input_grad[:1], grad)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x [..., 2 * d]`` = ``[gate; up]`` (vLLM's kernel)."""
    return _SiluAndMul.apply(x)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = kernels().log_softmax(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(-1, keepdim=True)


#: vLLM 0.26's ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`` (``vllm/config/vllm.py``): the MoE
#: architectures its engine runs on the V2 model runner by default (the installed vLLM's own set is
#: read where it has one)
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "InklingForCausalLM", "InklingForConditionalGeneration",
    "LongcatFlashNgramForCausalLM", "Qwen2MoeForCausalLM",
})  # fmt: skip


def engine_model_runner(architecture: str, is_moe: bool) -> str:
    """Which GPU model runner a vLLM engine serving ``architecture`` runs - ``"v2"`` or ``"v1"`` - as
    vLLM 0.26 decides it for a generation model (``VllmConfig.use_v2_model_runner``):
    ``VLLM_USE_V2_MODEL_RUNNER`` when set, else V2 for a model without MoE layers or one of
    :data:`DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`, V1 for the other MoE models. The two compute
    sampled and prompt log-probs differently (V2: its fused Triton kernel on the model-dtype logits;
    V1: ``log_softmax`` of the logits cast to fp32), and the last bit can differ between them."""
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if forced is not None:  # read as vLLM's envs.py reads it: bool(int(value))
        try:
            return "v2" if int(forced) else "v1"
        except ValueError:
            raise ZooError(f"VLLM_USE_V2_MODEL_RUNNER={forced!r}: vLLM reads it as an integer (0 or 1)") from None
    try:
        from vllm.config.vllm import DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES as installed
    except ImportError:
        installed = DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
    return "v2" if not is_moe or architecture in installed else "v1"


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                               compute_entropy: bool = True,
                               runner: str = "v2") -> tuple[torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """vLLM's per-token log-probs: ``log_softmax(logits.float() / temperature)[target]`` (fp32, the
    division as vLLM's sampler does it for processed log-probs; temperature 1 = its raw log-probs),
    and the entropy. ``logits [..., V]`` (all of the vocabulary on this rank), ``targets`` int like
    ``logits[..., 0]``; negative targets give 0. ``runner`` (:func:`engine_model_runner`): at
    temperature 1, ``"v2"`` gives the value of the V2 model runner's fused kernel on the model-dtype
    logits, ``"v1"`` that of the fp32 log-softmax (the V1 runner's raw log-probs)."""
    if runner not in ("v1", "v2"):
        raise ValueError(f"runner must be 'v1' or 'v2', got {runner!r}")
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    x = _acc(flat)  # bf16 / fp16 -> fp32, as vLLM's sampler
    if temperature != 1.0:
        x = x / temperature
    lp_all = _LogSoftmax.apply(x.contiguous())
    t = targets.reshape(-1).long()
    valid = t >= 0
    lp = lp_all.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1) * valid
    if temperature == 1.0 and runner == "v2":
        # the forward value as the engine's fused kernel gives it (on the model-dtype logits);
        # the gradient stays that of the log-softmax above
        exact = kernels().token_logprobs(flat, t.clamp(min=0))
        if exact is not None:
            lp = (exact * valid).detach() + (lp - lp.detach())  # + 0.0: the value is exact's bits
    entropy = None
    if compute_entropy:
        entropy = -(lp_all.exp() * lp_all).sum(-1).view(shape)
    return lp.view(shape), entropy


# ---------------------------------------------------------------------------- attention
class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                window: Optional[int]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(q, k, v, lengths)
        ctx.scale, ctx.window = scale, window
        return kernels().paged_attention(q, k, v, lengths, scale, window)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, lengths = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = _differentiable_attention(*leaves, lengths, ctx.scale, ctx.window)
            gq, gk, gv = torch.autograd.grad(out, leaves, grad)
        return gq, gk, gv, None, None, None


def _differentiable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                              window: Optional[int]) -> torch.Tensor:  # fmt: skip
    """The backward's recomputation: torch's varlen flash attention on CUDA where it can express the
    call (causal, no window), else per-sequence fp32 math."""
    if q.is_cuda and window is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        if varlen_attn is not None:
            import inspect

            params = inspect.signature(varlen_attn).parameters
            cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=q.device)
            cu[1:] = torch.cumsum(lengths.to(q.device), 0)
            n = int(lengths.max())
            kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
            if "scale" in params:
                kwargs["scale"] = scale
            elif abs(scale - q.shape[-1] ** -0.5) > 0:
                return _reference_attention(q, k, v, lengths, scale, window)
            rep = q.shape[1] // k.shape[1]
            if rep > 1:
                if "enable_gqa" in params:
                    kwargs["enable_gqa"] = True
                else:
                    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            return varlen_attn(q, k, v, cu, cu, n, n, **kwargs)
    return _reference_attention(q, k, v, lengths, scale, window)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, scale: float,
              window: Optional[int] = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of packed sequences (``q [T, h, d]``, ``k / v [T, g, d]``, ``lengths`` [B])
    with vLLM's FlashAttention prefill; backward by recomputation (see :func:`_differentiable_attention`)."""
    return _Attention.apply(q, k, v, lengths, float(scale), window)


class _MLAAbsorbed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                w_uk_t: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(q_nope, q_pe, kv_c, k_pe, w_uk_t, w_uv, lengths)
        ctx.scale = scale
        return kernels().mla_absorbed_attention(q_nope, q_pe, kv_c, k_pe, w_uk_t, w_uv, lengths, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        *inputs, lengths = ctx.saved_tensors
        grads = _fp32_grads(lambda *t: _mla_reference(*t, lengths, ctx.scale), tuple(inputs), ctx.needs_input_grad[:6], grad)
        return (*grads, None, None)


def mla_absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                           w_uk_t: torch.Tensor, w_uv: torch.Tensor, lengths: torch.Tensor, *, scale: float) -> torch.Tensor:  # fmt: skip
    """Multi-head latent attention of packed causal sequences in the absorbed form vLLM's MLA
    backend computes (see :meth:`VLLMKernels.mla_absorbed_attention`):
    ``out = (softmax(scale * (q_pe . k_pe + (q_nope W_UK) . kv_c)) kv_c) W_UV`` per head.

    ``q_nope [T, N, P]`` and ``q_pe [T, N, R]`` (after RoPE): the query's two parts per head;
    ``kv_c [T, L]`` the normalised latent and ``k_pe [T, R]`` the shared RoPE key (after RoPE);
    ``w_uk_t [N, P, L]`` / ``w_uv [N, L, V]`` the up projection's key and value parts per head
    (:func:`mla_absorbed_weights`); ``lengths`` int ``[B]`` the sequences, back to back.
    Returns ``[T, N, V]`` in the inputs' dtype. Equal in exact arithmetic to attention over the
    up-projected keys ``[kv_c W_UK^T | k_pe]`` and values ``kv_c W_UV``, not in bits. Backward: that
    same formula in fp32, recomputed."""
    return _MLAAbsorbed.apply(q_nope, q_pe, kv_c, k_pe, w_uk_t, w_uv, lengths, float(scale))


def mla_absorbed_weights(kv_up: torch.Tensor, heads: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK_T [N, P, L], W_UV [N, L, V])`` as views of the up projection's weight ``kv_up``
    ``[N * (P + V), L]`` (rows per head ``[k_nope (P) | v (V)]``: HF's ``kv_b_proj``, Megatron-Core's
    ``linear_kv_up_proj``), as vLLM's MLA layer derives them after loading; differentiable (the
    gradients reach ``kv_up``)."""
    rank = kv_up.shape[-1]
    if kv_up.shape[0] != heads * (nope + v):
        raise ZooError(f"mla_absorbed_weights: up projection {tuple(kv_up.shape)} is not {heads} heads x ({nope} + {v}) rows")
    w_uk, w_uv = kv_up.t().view(rank, heads, nope + v).split([nope, v], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


# ---------------------------------------------------------------------------- mixture of experts
def _routing_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """``softmax(logits)`` over all experts at the chosen ``ids [n, k]``, divided by their sum when
    ``renormalize`` (differentiable; in ``logits``' dtype)."""
    weights = torch.softmax(logits, dim=-1).gather(1, ids.long())
    return weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights


def _local_experts(ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """``ids [n, k]`` flattened to ``[n * k]`` int64 local expert indices: ``expert_map[ids]``
    (-1: an expert of another rank) or ``ids`` themselves without a map."""
    flat = ids.reshape(-1).long()
    return flat if expert_map is None else expert_map.to(flat.device).long()[flat]


def _slot_rows(n: int, k: int, per_slot: bool, device: torch.device) -> torch.Tensor:
    """The input row of each of the ``n * k`` slots of an expert GEMM: its token (``t``) or itself."""
    rows = torch.arange(n * k, device=device)
    return rows if per_slot else rows // k


class _RouterTopK(torch.autograd.Function):
    """A router's top-k: ``choose(logits) -> (weights fp32 [n, k], experts int32 [n, k])`` (the
    kernel) and ``weigh(logits, experts)``, the weights' formula in torch ops (differentiable): the
    weights of replayed routes that are not the kernel's choice, and the backward (fp32)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, choose: Any, weigh: Any,
                routes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        weights, ids = choose(logits)
        if routes is not None:  # replayed experts: the kernel's weights where it chose the same ones
            routes = routes.to(device=ids.device, dtype=ids.dtype)
            same = (ids == routes).all(dim=-1, keepdim=True)
            weights = torch.where(same, weights, weigh(_acc(logits), routes).to(weights.dtype))
            ids = routes
        ctx.save_for_backward(logits, ids)
        ctx.weigh = weigh
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _ids_grad: Any) -> tuple[Optional[torch.Tensor], ...]:
        logits, ids = ctx.saved_tensors
        (gl,) = _fp32_grads(lambda x: ctx.weigh(x, ids), (logits,), ctx.needs_input_grad[:1], grad)
        return gl, None, None, None


def moe_topk_softmax(logits: torch.Tensor, top_k: int, *, renormalize: bool,
                     routes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """vLLM's softmax top-k router on ``logits [n, E]``: ``(weights fp32 [n, k], experts int32 [n, k])``,
    the experts in the kernel's order (descending weight), the weights divided by their sum when
    ``renormalize``. ``routes [n, k]``: use these experts (routing replay); a token whose routes are
    the kernel's own choice keeps the kernel's weights, any other gets the same formula in torch
    ops (fp32). Differentiable in ``logits`` (softmax over all experts, gathered, renormalised)."""
    return _RouterTopK.apply(logits, lambda x: kernels().moe_topk_softmax(x, int(top_k), bool(renormalize)),
                             lambda x, ids: _routing_weights(x, ids, bool(renormalize)), routes)  # fmt: skip


def _sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    """The grouped router's scores in fp32: ``0.5 * tanh(0.5 x) + 0.5``, the form vLLM's
    ``grouped_topk`` kernel computes the sigmoid in (differentiable)."""
    return 0.5 * torch.tanh(0.5 * _acc(logits)) + 0.5


def _grouped_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The unbiased scores of the chosen ``ids [n, k]``, divided by their sum (+ 1e-20, as the
    kernel) when ``renormalize``: fp32 ``[n, k]`` (differentiable in ``logits``)."""
    weights = _sigmoid_scores(logits).gather(1, ids.long())
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if renormalize else weights


def moe_grouped_topk(logits: torch.Tensor, top_k: int, *, num_groups: int, topk_group: int, renormalize: bool,
                     bias: torch.Tensor, routes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """vLLM's sigmoid group-limited router with a score-correction bias (DeepSeek-V3's
    ``noaux_tc``; vLLM's CUDA ``grouped_topk``) on ``logits [n, E]`` (the model dtype: vLLM's gate
    GEMM) and ``bias`` fp32 ``[E]`` (``e_score_correction_bias``):

    1. scores ``s = 0.5 * tanh(0.5 * logits) + 0.5`` in fp32; ``s + bias`` chooses, ``s`` weighs;
    2. the ``E / num_groups`` experts of each group score the group by the sum of their two best
       biased scores; the ``topk_group`` best groups stay;
    3. the ``top_k`` best experts by biased score among them, in descending order (the slot order
       of the block's sum);
    4. their unbiased scores, divided by their sum (+ 1e-20) when ``renormalize``.

    ``(weights fp32 [n, k], experts int32 [n, k])``, without ``routed_scaling_factor``: vLLM multiplies
    the block's output by it (``apply_routed_scale_to_output``). ``routes [n, k]``: use these
    experts (routing replay); a token whose routes are the kernel's own choice keeps the kernel's
    weights, any other gets step 4 in torch ops (fp32). Differentiable in ``logits`` (step 4; the
    bias only selects)."""
    experts = logits.shape[-1]
    if num_groups < 1 or experts % num_groups or not 0 < topk_group <= num_groups:
        raise ZooError(f"moe_grouped_topk: {experts} experts in {num_groups} groups, {topk_group} of them kept: the"
                       " groups must divide the experts and keep at least one group")  # fmt: skip
    if top_k > topk_group * (experts // num_groups):
        raise ZooError(f"moe_grouped_topk: top-{top_k} of the {topk_group * (experts // num_groups)} experts in the"
                       f" {topk_group} kept groups")  # fmt: skip
    if bias.shape != (experts,):
        raise ZooError(f"moe_grouped_topk: bias of shape {tuple(bias.shape)} for {experts} experts")

    def choose(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels().moe_grouped_topk(x, int(top_k), int(num_groups), int(topk_group), bool(renormalize), bias)

    return _RouterTopK.apply(logits, choose, lambda x, ids: _grouped_weights(x, ids, bool(renormalize)), routes)


class _MoEGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, weights: Optional[torch.Tensor],
                per_slot: bool, config: dict, expert_map: Optional[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(a, w, ids, weights, expert_map)
        ctx.per_slot = per_slot
        return kernels().moe_gemm(a, w, ids, weights, per_slot, config, expert_map)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        a, w, ids, weights, expert_map = ctx.saved_tensors
        need_a, need_w, _, need_s = ctx.needs_input_grad[:4]
        n, k = ids.shape
        flat = _local_experts(ids, expert_map)
        src = _slot_rows(n, k, ctx.per_slot, a.device)
        g = grad.reshape(n * k, -1)
        ga = torch.zeros(a.shape, dtype=_acc(a).dtype, device=a.device) if need_a else None
        gw = torch.zeros_like(w) if need_w else None
        gs = torch.zeros(n * k, dtype=_acc(weights).dtype, device=a.device) if need_s else None
        for e in flat.unique().tolist():  # per expert, in fp32: one expert's weight at a time
            if e < 0:  # another rank's expert: its slots' output was 0, so are their gradients here
                continue
            sel = (flat == e).nonzero().squeeze(1)
            rows, ge, we = _acc(a[src[sel]]), _acc(g[sel]), _acc(w[e])
            if weights is not None:
                if need_s:
                    gs[sel] = (ge * (rows @ we.t())).sum(dim=-1)
                ge = ge * _acc(weights.reshape(-1)[sel])[:, None]
            if need_w:
                gw[e] = (ge.t() @ rows).to(w.dtype)
            if need_a:
                ga.index_add_(0, src[sel], ge @ we)
        return (None if ga is None else ga.to(a.dtype), gw, None,
                None if gs is None else gs.view(n, k).to(weights.dtype), None, None, None)  # fmt: skip


class _MoESum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        ctx.k = y.shape[1]
        return kernels().moe_sum(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad[:, None, :].expand(-1, ctx.k, -1).contiguous()


def moe_sum(y: torch.Tensor) -> torch.Tensor:
    """``y [n, k, H]`` summed over its k slots (vLLM's ``moe_sum``)."""
    return _MoESum.apply(y)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The routed experts of an unquantized MoE block as vLLM's ``TritonExperts`` computes them
    (batch-invariant mode), on ``x [n, H]`` (model dtype), ``w13 [E, 2I, H]`` (``[gate; up]``),
    ``w2 [E, H, I]``, ``weights fp32 [n, k]`` and ``ids [n, k]`` from :func:`moe_topk_softmax`:

    1. ``h [n, k, 2I] = x @ w13[ids].T`` - Triton fused-MoE GEMM, fp32 accumulation, one cast;
    2. ``a [n * k, I] = silu(h_gate) * h_up`` - vLLM's CUDA ``silu_and_mul`` (as the dense MLP);
    3. ``y [n, k, H] = (a @ w2[ids].T) * weights`` - the same GEMM, the routing weight multiplied
       into the fp32 accumulator before the cast to the model dtype;
    4. ``out [n, H] = sum_k y`` - vLLM's ``moe_sum``.

    Under tensor parallelism (vLLM without expert parallelism) ``w13`` / ``w2`` are this rank's
    shards of every expert (``I`` = the local intermediate size, ``w13`` = ``[gate shard; up shard]``)
    and ``out`` is this rank's partial sum. Under expert parallelism ``w13`` / ``w2`` hold this
    rank's whole experts, ``ids`` stay global and ``expert_map`` (int32 ``[E_global]``, vLLM's
    ``expert_map``: the local index of each global expert, -1 for another rank's) maps them: a slot
    routed to another rank's expert is 0 in both GEMMs and ``moe_sum`` adds it as 0 - as the engine,
    whose Triton kernel writes zeros for the blocks of expert -1. The caller all-reduces the partial
    sums (:class:`mcore_zoo.specs.vllm_exact.VLLMMoELayer`).

    Differentiable in ``x``, ``w13``, ``w2`` and ``weights`` (ordinary torch ops in fp32, one expert
    at a time; another rank's slots get no gradient here)."""
    n, k = ids.shape
    if expert_map is not None:  # no device sync: the values are checked where they are on the CPU
        bad = expert_map.dim() != 1 or expert_map.dtype != torch.int32
        if not bad and expert_map.device.type == "cpu":
            bad = int(expert_map.max()) >= w13.shape[0] or int((expert_map >= 0).sum()) != w13.shape[0]
        if bad:
            raise ZooError(f"fused_experts: expert_map {expert_map.dtype} {tuple(expert_map.shape)} is not an int32"
                           f" map of global experts onto the {w13.shape[0]} local experts of w13 {tuple(w13.shape)}")  # fmt: skip
    config = kernels().moe_config(tuple(w13.shape), tuple(w2.shape), k, n)
    h = _MoEGemm.apply(x, w13, ids, None, False, config, expert_map)
    a = silu_and_mul(h.reshape(n * k, -1))
    return moe_sum(_MoEGemm.apply(a, w2, ids, weights, True, config, expert_map))


# ---------------------------------------------------------------------------- RoPE tables
def sequence_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's position in its sequence (int64 ``[T]``, on ``cu_seqlens``' device) for a pack
    whose sequences have the bounds ``cu_seqlens`` (int ``[B + 1]``): ``0 .. n - 1`` per sequence."""
    lengths = cu_seqlens.diff().long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(int(lengths.sum()), device=cu_seqlens.device) - starts


@dataclass
class VLLMRope:
    """vLLM's RoPE for one model: its ``cos_sin_cache`` (built by vLLM's ``get_rope`` on the GPU in
    the model dtype, as the engine builds it), the head size and the pair layout (``neox``: NeoX
    halves; ``False``: GPT-J adjacent pairs, DeepSeek's MLA)."""

    cos_sin_cache: torch.Tensor
    head_size: int
    neox: bool = True

    @classmethod
    def from_hf_config(cls, hf_config: dict, head_size: int, dtype: torch.dtype, device: torch.device, *,
                       mla: bool = False) -> "VLLMRope":  # fmt: skip
        """The engine's cache for ``hf_config``. ``mla``: the RoPE of DeepSeek's MLA layer
        (``deepseek_v2.py``'s ``DeepseekV2MLAAttention``): ``head_size`` = ``qk_rope_head_dim``,
        GPT-J pairs, a scaled ``rope_type`` rewritten to ``deepseek_yarn``
        (``DeepseekScalingRotaryEmbedding``: its cache ``cat(cos, sin) * mscale`` over
        ``original_max_position_embeddings * factor`` positions)."""
        import transformers
        from vllm.model_executor.layers.rotary_embedding import get_rope

        try:
            from vllm.transformers_utils.config import patch_rope_parameters
        except ImportError:  # pragma: no cover - older vLLM
            patch_rope_parameters = None
        config = transformers.AutoConfig.for_model(hf_config["model_type"], **{k: v for k, v in hf_config.items() if k != "model_type"})
        if patch_rope_parameters is not None:
            patch_rope_parameters(config)
        parameters = getattr(config, "rope_parameters", None)
        if mla and parameters and parameters.get("rope_type", "default") != "default":
            parameters = dict(parameters)  # as DeepseekV2MLAAttention rewrites it
            parameters["rope_type"] = "deepseek_yarn" if parameters.get("apply_yarn_scaling", True) else "deepseek_llama_scaling"
        from vllm.config import VllmConfig, set_current_vllm_config

        with set_current_vllm_config(VllmConfig()), torch.device(device):  # vLLM's custom ops need a config
            rope = get_rope(head_size, max_position=int(getattr(config, "max_position_embeddings", 8192)),
                            is_neox_style=not mla, rope_parameters=parameters, dtype=dtype)  # fmt: skip
        return cls(rope.cos_sin_cache.to(device=device, dtype=dtype), head_size, not mla)

    @classmethod
    def reference(cls, inv_freq: torch.Tensor, max_positions: int, head_size: int, dtype: torch.dtype,
                  device: torch.device, *, scale: float = 1.0, neox: bool = True) -> "VLLMRope":  # fmt: skip
        """The cache as vLLM's ``RotaryEmbedding`` builds it from ``inv_freq`` (``cat(cos, sin)``
        of ``positions x inv_freq`` in fp32, times ``scale`` (YaRN's attention factor, as
        ``DeepseekScalingRotaryEmbedding`` applies it) where it is not 1, cast to ``dtype``), on any
        device: for :class:`ReferenceKernels` runs."""
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.einsum("i,j -> ij", t, inv_freq.to(device=device, dtype=torch.float32))
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cls(torch.cat((cos, sin), dim=-1).to(dtype), head_size, neox)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:func:`rotary` of ``x [n, heads * head_size]`` at ``positions [n]`` with this cache."""
        return rotary(x, positions, self.cos_sin_cache, self.head_size, neox=self.neox)

    def apply(self, t: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """RoPE of Megatron-Core's ``t``: THD ``[T, (1,) h, d]`` with ``cu_seqlens`` (positions restart at
        every sequence), or SBHD ``[s, b, h, d]`` (positions ``0 .. s - 1``)."""
        shape = t.shape
        if cu_seqlens is not None:
            positions = sequence_positions(cu_seqlens).to(t.device)
            rows = positions.numel()
        else:
            s, b = shape[0], shape[1]
            positions = torch.arange(s, device=t.device).repeat_interleave(b)
            rows = s * b
        if rows != t.numel() // (shape[-1] * shape[-2]):
            raise ZooError(f"vllm-exact RoPE: {rows} positions for a query / key of shape {tuple(shape)}")
        flat = t.reshape(rows, -1)
        return self.rotate(flat, positions).view(shape)
