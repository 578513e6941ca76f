"""Zoo-owned core attention for the ``portable`` backend: THD packing without Transformer Engine.

Megatron-Core's local ``DotProductAttention`` rejects packed (THD) input. :class:`PortableAttention`
is a drop-in ``core_attention`` module (same constructor and call signature as mcore's) that runs
BSHD and THD on CPU and GPU with one of these kernels:

* ``eager`` - HF's ``eager_attention_forward`` op for op (matmul, scale, additive mask, fp32
  softmax, cast, dropout, matmul); each packed sequence is computed on exactly its own length
  (sequences of equal length in one batched call: batched matmuls give each batch element the same
  result as alone), so packed sequences get exactly what HF computes for them alone or batched.
* ``sdpa`` - ``torch.nn.functional.scaled_dot_product_attention`` called the way HF's ``sdpa``
  implementation calls it, one call per packed sequence: SDPA picks its kernel by batch shape, so
  a packed sequence gets what HF sdpa computes for that sequence alone (not what it computes for it
  inside a batch - HF's own sdpa differs between those two). Each call takes a contiguous slice of
  the pack in HF's layout and the outputs are joined with one ``torch.cat`` (alignment padding
  gives zero rows); the pack's bounds are read to the host once per pack
  (:func:`mcore_zoo.specs.pack_rows.host_bounds`), not once per layer.
* ``varlen`` - ``torch.nn.attention.varlen.varlen_attn`` (CUDA, one call for the whole pack).
* ``flash`` - the flash-attn package's ``flash_attn_varlen_func`` (CUDA, one call).
* ``auto`` - ``varlen`` on CUDA when available, else ``flash`` when installed, else ``sdpa``.

Context parallelism (THD only): each rank holds the zigzag share of every sequence (chunks ``r`` and
``2 * cp - 1 - r`` of ``2 * cp``, see :func:`mcore_zoo.packing.zigzag_index`). Keys and values are
all-gathered over the context-parallel group (differentiable: the backward all-reduces and keeps
this rank's rows), each sequence's K/V is reassembled in position order, and every local query
chunk attends to the keys up to its own position (sdpa / eager math per chunk, whatever
``kernel`` says; ``varlen`` / ``flash`` fall back to ``sdpa`` there). Memory per rank: the whole
pack's K/V, ``T x 2 x groups x head_dim`` - the simple all-gather scheme, not a ring.

Shapes (``np``/``ng`` = attention heads / query groups of this tensor-parallel rank):
BSHD/SBHD in ``[s, b, np|ng, hn]`` -> out ``[s, b, np*hn]``; THD in ``[t, np|ng, hn]`` -> out
``[t, np*hn]``. Sliding windows follow HF (a query sees the last ``W`` keys, itself included),
per layer as ``config.window_attn_skip_freq`` says.

Attention sinks (``config.softmax_type == "learnable"``, gpt-oss): a learned logit per head,
``softmax_offset [np]`` (Megatron-Core's name and split), joins every query's softmax as one more
column and is dropped after it, in transformers' op order (scores, mask, the sink column
concatenated, its row maximum subtracted, a softmax in the scores' dtype, the sink column
dropped). Only the ``eager`` math expresses it: every kernel runs ``eager`` then.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..distributed.collectives import all_gather_rows
from ..placement import group_rank
from .pack_rows import host_bounds, pack_pieces

KERNELS = ("auto", "eager", "sdpa", "varlen", "flash")


def _repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, ng, s, d] -> [b, ng*n_rep, s, d], as HF's ``repeat_kv``."""
    batch, groups, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, groups, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, groups * n_rep, slen, head_dim)


def _allowed_mask(sq: int, sk: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """Bool [sq, sk], True where the query may attend (causal, bottom-right aligned, windowed)."""
    q_idx = torch.arange(sq, device=device)[:, None] + (sk - sq)
    k_idx = torch.arange(sk, device=device)[None, :]
    allowed = k_idx <= q_idx
    if window is not None:
        allowed = allowed & (k_idx > q_idx - window)
    return allowed


def _sink_parameter(config: Any, heads: int) -> torch.nn.Parameter:
    """This rank's ``[heads]`` sink logits, split over tensor parallelism like the heads, initialised
    as Megatron-Core initialises its ``softmax_offset``."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() else torch.device(
        "cuda", torch.cuda.current_device())  # fmt: skip
    param = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype, device=device))
    if config.perform_initialization:
        config.init_method(param)
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss attention probabilities: ``scores [b, h, sq, sk]`` (scaled, masked)
    with each head's sink logit as one more column, the row maximum subtracted, a softmax in the
    scores' dtype, the sink column dropped."""
    sink_column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
    combined = torch.cat([scores, sink_column.to(scores.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
    return probs[..., :-1]


def _varlen_available() -> bool:
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _flash_attn_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func
    except ImportError:
        pass
    try:
        from flash_attn.cute import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func
    except ImportError:
        return None


def resolve_kernel(kernel: str, device: torch.device) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"unknown portable attention kernel {kernel!r}; known: {KERNELS}")
    if kernel != "auto":
        return kernel
    if device.type == "cuda":
        if _varlen_available():
            return "varlen"
        if _flash_attn_varlen() is not None:
            return "flash"
    return "sdpa"


class PortableAttention(torch.nn.Module):
    """Core attention (see module docstring). Built by mcore's ``SelfAttention`` like its own."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        kernel: str = "auto",
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        **_: Any,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.utils import is_layer_window_attention

        if kernel not in KERNELS:
            raise ValueError(f"unknown portable attention kernel {kernel!r}; known: {KERNELS}")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.kernel = kernel
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = k_channels or config.kv_channels
        self.v_dim = v_channels or self.head_dim  # MLA: values narrower than keys
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.window: Optional[int] = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"PortableAttention supports causal windows only, got {config.window_size}")
            self.window = None if left < 0 else left + 1
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        self.softmax_offset: Optional[torch.nn.Parameter] = None
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "learnable":
            self.softmax_offset = _sink_parameter(config, self.heads)
        elif softmax_type != "vanilla":
            raise ValueError(f"PortableAttention: softmax_type {softmax_type!r} is not supported ('vanilla', 'learnable')")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """Distributed-checkpoint entries: the sink logits (``softmax_offset``) split over tensor
        parallelism along the heads, as Megatron-Core's own core attention declares them (a module
        without this method would be saved as replicated, each rank's half taken for the whole)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=get_tensor_model_parallel_group_if_none(self.tp_group), dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip

    # ------------------------------------------------------------------ entry point
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("PortableAttention does not take an attention bias")
        kernel = "eager" if self.softmax_offset is not None else resolve_kernel(self.kernel, query.device)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, packed_seq_params, kernel)
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        allowed = None
        if attention_mask is not None:  # mcore convention: True = masked out
            allowed = ~attention_mask.bool()
            causal = _allowed_mask(q.shape[2], k.shape[2], self.window, q.device)
            allowed = allowed & causal
        out = self._attend(q, k, v, kernel, allowed)  # [b, s, h, d]
        b, s = out.shape[0], out.shape[1]
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    # ------------------------------------------------------------------ THD
    def _thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, kernel: str) -> torch.Tensor:
        if query.dim() == 4:  # [t, 1, h, d]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        if self.cp_group is not None and self.cp_group.size() > 1:
            return self._thd_context_parallel(query, key, value, params, "sdpa" if kernel in ("varlen", "flash") else kernel)
        if kernel in ("varlen", "flash"):
            return self._thd_fused(query, key, value, params, kernel)
        if kernel == "sdpa":
            out = self._thd_sdpa_slices(query, key, value, params)
            if out is not None:
                return out
        starts = host_bounds(params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q)
        ends = host_bounds(params.cu_seqlens_q)
        lengths = [b - a for a, b in zip(ends, ends[1:])]
        out = query.new_zeros(query.shape[0], self.heads, self.v_dim)
        # eager: sequences of equal length go through one batched call (batched matmuls give each
        # element the result it gets alone; fewer launches). sdpa (where _thd_sdpa_slices declines):
        # one call per sequence, as HF sdpa on that sequence alone (SDPA chooses kernels by batch shape).
        groups: dict[Any, list[int]] = {}
        for start, length in zip(starts, lengths):
            if length:
                groups.setdefault(length if kernel == "eager" else (length, start), []).append(start)
        for group_key, group in groups.items():
            length = group_key if kernel == "eager" else group_key[0]
            rows = torch.cat([torch.arange(s0, s0 + length, device=query.device) for s0 in group])
            shape = (len(group), length)
            q = query[rows].view(*shape, *query.shape[1:]).transpose(1, 2)  # [g, h, L, d]
            k = key[rows].view(*shape, *key.shape[1:]).transpose(1, 2)
            v = value[rows].view(*shape, *value.shape[1:]).transpose(1, 2)
            out[rows] = self._attend(q, k, v, kernel, None).reshape(-1, self.heads, self.v_dim)
        return out.reshape(out.shape[0], -1)

    def _thd_sdpa_slices(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> Optional[torch.Tensor]:
        """The ``sdpa`` kernel on a THD pack (no context parallelism): one SDPA call per sequence on
        contiguous slices of the pack, in the layout HF's sdpa implementation passes (``[1, h, L, d]``,
        a transpose of a contiguous ``[1, L, h, d]``), its output rows joined with one ``torch.cat``
        (alignment padding: zero rows). Same calls and values as gathering each sequence's rows into
        a tensor of its own; the backward is one ``cat`` of the input slices' gradients instead of a
        scatter per sequence. ``None`` (the caller gathers rows instead) where the pack's bounds do
        not describe the rows or a slice would start off a 16-byte boundary (kernels may pick another
        path for a misaligned pointer than for the fresh allocation a gather gives)."""
        pieces = pack_pieces(query.shape[0], params)
        if pieces is None:
            return None
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out_row = self.heads * self.v_dim * query.element_size()  # the output's row: its gradient's slices
        if out_row % 16 or any(t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16 for t in (query, key, value)):
            return None
        if not pieces:
            return query.new_zeros(0, self.heads * self.v_dim)
        sizes = [end - start for start, end, _ in pieces]
        outs = []
        for (start, end, is_sequence), q, k, v in zip(pieces, query.split(sizes), key.split(sizes), value.split(sizes)):
            if not is_sequence:
                outs.append(query.new_zeros(end - start, self.heads, self.v_dim))
                continue
            q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))  # [1, h|g, L, d]
            outs.append(self._attend(q, k, v, "sdpa", None).reshape(-1, self.heads, self.v_dim))  # [L, h, d_v]
        return torch.cat(outs).reshape(query.shape[0], -1)

    def _thd_fused(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, kernel: str) -> torch.Tensor:
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        max_q = int(params.max_seqlen_q)
        max_k = int(params.max_seqlen_kv)
        left = -1 if self.window is None else self.window - 1
        dropout = self.dropout_p if self.training else 0.0
        if kernel == "varlen":
            if dropout:
                raise NotImplementedError("torch varlen attention has no dropout; use kernel='flash' or 'sdpa'")
            out = self._varlen(query, key, value, cu_q.int(), cu_k.int(), max_q, max_k, left)
            if out is None:  # this torch's varlen_attn cannot express the call: one SDPA call per sequence
                return self._thd(query, key, value, params, "sdpa")
        else:
            fn = _flash_attn_varlen()
            if fn is None:
                raise RuntimeError("kernel='flash' needs the flash-attn package")
            out = fn(
                query, key, value, cu_q.int(), cu_k.int(), max_q, max_k,
                dropout_p=dropout, softmax_scale=self.scale, causal=True, window_size=(left, 0),
            )  # fmt: skip
            if isinstance(out, tuple):
                out = out[0]
        return out.reshape(out.shape[0], -1)

    def _thd_context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, kernel: str) -> torch.Tensor:
        """THD under context parallelism (see module docstring). ``cu_seqlens*`` are global."""
        group = self.cp_group
        cp, rank = group.size(), group_rank(group)
        keys = all_gather_rows(key.contiguous(), group)  # [cp, t_local, g, d]
        values = all_gather_rows(value.contiguous(), group)
        padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = host_bounds(padded)
        ends = host_bounds(params.cu_seqlens_q)
        lengths = [b - a for a, b in zip(ends, ends[1:])]
        out = query.new_zeros(query.shape[0], self.heads, self.v_dim)
        for i, length in enumerate(lengths):
            slot = bounds[i + 1] - bounds[i]
            chunk = slot // (2 * cp)
            local = bounds[i] // cp  # this sequence's first row on every rank
            if length == 0 or chunk == 0:
                continue
            # chunk j of the sequence lives on rank j (first half of its slot) or 2cp-1-j (second half)
            order = [(j, 0) if j < cp else (2 * cp - 1 - j, chunk) for j in range(2 * cp)]
            k_seq = torch.cat([keys[r, local + off : local + off + chunk] for r, off in order])
            v_seq = torch.cat([values[r, local + off : local + off + chunk] for r, off in order])
            for half, j in ((0, rank), (1, 2 * cp - 1 - rank)):
                n_q = min(max(length - j * chunk, 0), chunk)  # real (non-pad) queries of this chunk
                if n_q == 0:
                    continue
                end = j * chunk + n_q
                row = local + half * chunk
                q = query[row : row + n_q].unsqueeze(0).transpose(1, 2)  # [1, h, n_q, d]
                k = k_seq[:end].unsqueeze(0).transpose(1, 2)
                v = v_seq[:end].unsqueeze(0).transpose(1, 2)
                allowed = _allowed_mask(n_q, end, self.window, query.device)
                out[row : row + n_q] = self._attend(q, k, v, kernel, allowed)[0]
        return out.reshape(out.shape[0], -1)

    def _varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, max_q: int, max_k: int, left: int) -> Optional[torch.Tensor]:  # fmt: skip
        """``torch.nn.attention.varlen.varlen_attn`` with what this torch's signature offers
        (torch <= 2.11: ``is_causal`` only, default scale, equal head counts; later: ``scale``,
        ``window_size``, ``enable_gqa``). ``None`` when it cannot express this layer's attention."""
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        kwargs: dict[str, Any] = {}
        if "window_size" in params:
            kwargs["window_size"] = (left, 0)
        elif "is_causal" in params and left < 0:
            kwargs["is_causal"] = True
        else:
            return None
        if "scale" in params:
            kwargs["scale"] = self.scale
        elif self.scale != 1.0 / math.sqrt(self.head_dim):
            return None
        if self.heads != self.groups:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:
                n_rep = self.heads // self.groups
                key = key.repeat_interleave(n_rep, dim=1)
                value = value.repeat_interleave(n_rep, dim=1)
        return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)

    # ------------------------------------------------------------------ math
    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernel: str,
        allowed: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """[b, h, sq, d], [b, g, sk, d] -> [b, sq, h, d]; ``allowed`` bool [b|1, 1, sq, sk] or None."""
        n_rep = self.heads // self.groups
        dropout = self.dropout_p if self.training else 0.0
        if kernel == "eager":
            return self._eager(q, k, v, n_rep, dropout, allowed)
        if kernel in ("sdpa", "varlen", "flash"):
            return self._sdpa(q, k, v, n_rep, dropout, allowed)
        raise ValueError(kernel)

    def _eager(self, q, k, v, n_rep, dropout, allowed):  # type: ignore[no-untyped-def]
        key_states = _repeat_kv(k, n_rep)
        value_states = _repeat_kv(v, n_rep)
        attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * self.scale
        if allowed is None:
            allowed = _allowed_mask(q.shape[2], k.shape[2], self.window, q.device)
        if not bool(allowed.all()):
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)
            attn_weights = attn_weights + mask
        if self.softmax_offset is not None:
            attn_weights = _softmax_with_sinks(attn_weights, self.softmax_offset).to(value_states.dtype)
        else:
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        if dropout:
            attn_weights = self._dropout(attn_weights, dropout)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous()

    def _sdpa(self, q, k, v, n_rep, dropout, allowed):  # type: ignore[no-untyped-def]
        kwargs: dict[str, Any] = {}
        # HF skips the mask (is_causal) when the window cannot bite: no mask or kv_len <= window
        bites = self.window is not None and k.shape[2] > self.window
        is_causal = allowed is None and not bites and q.shape[2] > 1
        if allowed is None and bites:
            allowed = _allowed_mask(q.shape[2], k.shape[2], self.window, q.device)
        if n_rep > 1:
            if allowed is None and k.shape[-1] == v.shape[-1] <= 256:
                kwargs["enable_gqa"] = True
            else:
                k = _repeat_kv(k, n_rep)
                v = _repeat_kv(v, n_rep)
        if is_causal and k.shape[2] > q.shape[2]:
            k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.scale, is_causal=is_causal, **kwargs
        )
        return out.transpose(1, 2).contiguous()

    def _dropout(self, probs: torch.Tensor, p: float) -> torch.Tensor:
        from megatron.core import tensor_parallel

        if self.config.sequence_parallel:
            return F.dropout(probs, p=p, training=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(probs, p=p, training=True)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}, heads={self.heads}, groups={self.groups}, window={self.window}"
