"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) on the zoo's MLA layer.

The layer is the MLA family's :class:`~mcore_zoo.families.mla.spec` attention (HF RoPE, scale and
latent norms) with two additions:

* :class:`LightningIndexer` - transformers' ``DeepseekV32Indexer`` op for op (``wq_b`` on the
  normalised q latent, ``LayerNorm(wk(x))``, RoPE on the first ``qk_rope_head_dim`` dims - rotate-half
  pairs for DeepSeek-V3.2, interleaved pairs for GLM-5 - fp32 scores ``relu(q . k * scale)``
  weighted per head by ``weights_proj(x) * heads ** -0.5`` and summed, the causal mask added as
  transformers' eager mask (0 / the dtype's minimum), ``topk`` over keys). Each packed (THD)
  sequence is scored alone, on exactly its own ``[1, L, L]`` scores - the tensor transformers
  scores it on - so a query never selects another sequence's keys and ties break as they do in
  transformers. It runs without gradients (transformers' indexer is ``no_grad``; its parameters do
  not require gradients): Megatron-Core's KL indexer loss is not part of the model.
* :class:`SparsePortableAttention` - the zoo's portable core attention restricted to the
  selected causal keys (transformers' eager path: the unselected keys get the dtype's minimum
  added). ``eager`` reproduces transformers bitwise; ``sdpa`` (the ``default`` profile's kernel on
  CPU) takes the same selection as a boolean mask; ``varlen`` / ``flash`` cannot take a
  selection and fall back to ``sdpa``.

Megatron-Core 0.16's ``experimental_attention_variant/dsa.py`` is not used: its indexer rotates the
last rope dims (transformers: the first), applies a Hadamard rotation, folds the softmax scale into
the head weights, takes its key-norm epsilon from ``layernorm_epsilon`` (transformers: 1e-6), rejects
packed sequences and selects over the whole batch row; each changes the selection or its ties.

Context parallelism is refused (the indexer would need every rank's keys); tensor parallelism
replicates the indexer (each rank selects the same keys), sequence parallelism gathers its inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mcore_zoo.config.arch import ArchConfig, DSASpec
from mcore_zoo.errors import ZooError
from mcore_zoo.specs.pack_rows import host_bounds
from mcore_zoo.specs.portable import PortableAttention, resolve_kernel


@dataclasses.dataclass
class Selection:
    """The keys each query may attend to, as the indexer chose them (causal mask included).

    ``segments`` ``None``: one ``[b, 1, s, s]`` boolean mask (BSHD); else ``(start, length)`` of
    every packed sequence and one ``[1, 1, L, L]`` mask each (THD)."""

    masks: Any
    segments: Optional[list] = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_rotate_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rope_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """transformers' ``apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=2)``: the pairs
    ``(x0, x1), (x2, x3), ...`` rotated, the result de-interleaved."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(2)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(2)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
            torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))  # fmt: skip


class LightningIndexer(torch.nn.Module):
    """The indexer of one DSA layer (see the module docstring). Parameters: ``linear_wq_b``
    (``q_lora_rank -> heads * head_dim``), ``linear_wk`` (``hidden -> head_dim``), ``k_norm`` (a
    LayerNorm with bias), ``linear_weights_proj`` (``hidden -> heads``); replicated over TP."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        from mcore_zoo.config.rope import inv_freq

        mla = arch.mla
        spec: DSASpec = mla.indexer
        self.heads, self.head_dim, self.topk = spec.index_n_heads, spec.index_head_dim, spec.index_topk
        self.rope_dim = mla.qk_rope_head_dim
        self.interleave = spec.rope_interleave
        self.linear_wq_b = torch.nn.Linear(mla.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.linear_wk = torch.nn.Linear(arch.hidden_size, self.head_dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=spec.k_norm_eps)
        self.linear_weights_proj = torch.nn.Linear(arch.hidden_size, self.heads, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)
        freqs, scaling = inv_freq(arch.rope, self.rope_dim, arch.max_position_embeddings)
        self._inv_freq = freqs  # fp32, CPU: not a buffer, so a dtype cast of the model leaves it as HF keeps it
        self._attention_scaling = float(scaling)

    def _cos_sin(self, length: int, batch: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """HF's rotary embedding for positions ``0 .. length - 1``: ``[batch, length, rope_dim]``."""
        inv = self._inv_freq.to(device)
        pos = torch.arange(length, device=device)[None, :].expand(batch, -1)
        freqs = (inv[None, :, None].float().expand(batch, -1, 1) @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._attention_scaling).to(dtype), (emb.sin() * self._attention_scaling).to(dtype)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, s, hidden]``, ``q_resid`` ``[b, s, q_lora_rank]``, ``allowed`` bool
        ``[b|1, s, s]`` (the causal / padding mask) -> bool ``[b, 1, s, s]``: the chosen keys among
        the allowed ones."""
        b, s, _ = x.shape
        cos, sin = self._cos_sin(s, b, x.dtype, x.device)
        q = self.linear_wq_b(q_resid).view(b, s, self.heads, self.head_dim)
        q_rot, q_pass = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = self.k_norm(self.linear_wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rope = rope_interleaved if self.interleave else rope_rotate_half
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim**-0.5
        scores = F.relu(scores)
        weights = self.linear_weights_proj(x.to(self.linear_weights_proj.weight.dtype)).float() * (self.heads**-0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        index_scores = index_scores + mask
        top = index_scores.topk(min(self.topk, s), dim=-1).indices
        chosen = torch.zeros(index_scores.shape, dtype=torch.bool, device=x.device).scatter(-1, top, True)
        return (chosen & allowed).unsqueeze(1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, packed_seq_params: Any = None,
                padding: Optional[torch.Tensor] = None) -> Selection:  # fmt: skip
        """``x`` ``[s, b, hidden]`` (THD: ``[t, 1, hidden]``), ``q_resid`` ``[s, b, q_lora_rank]``
        (THD: ``[t, q_lora_rank]``); ``padding``: Megatron-Core's ``[b, 1, s, s]`` mask (True =
        masked) of a BSHD batch -> the :class:`Selection` of every query."""
        x, q_resid = x.detach(), q_resid.detach()
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            x, q_resid = x.reshape(x.shape[0], -1), q_resid.reshape(q_resid.shape[0], -1)
            starts = packed_seq_params.cu_seqlens_q_padded
            starts = packed_seq_params.cu_seqlens_q if starts is None else starts
            ends = host_bounds(packed_seq_params.cu_seqlens_q)  # read once per pack, not per layer
            segments = [(a, b - e) for a, e, b in zip(host_bounds(starts), ends, ends[1:]) if b - e]
            masks = [self.select(x[a : a + n][None], q_resid[a : a + n][None], _causal(n, x.device)[None])
                     for a, n in segments]  # fmt: skip
            return Selection(masks, segments)
        s = x.shape[0]
        allowed = _causal(s, x.device)[None]
        if padding is not None:
            allowed = allowed & ~padding.bool()[:, 0]
        return Selection(self.select(x.transpose(0, 1), q_resid.transpose(0, 1), allowed))


def _causal(length: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(length, device=device)
    return idx[None, :] <= idx[:, None]


class SparsePortableAttention(PortableAttention):
    """:class:`PortableAttention` over the keys its layer's indexer selected (``self.selection``, set
    by the layer before each call; see the module docstring)."""

    selection: Optional[Selection] = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
        if attention_bias is not None:
            raise NotImplementedError("SparsePortableAttention does not take an attention bias")
        selection = self.selection
        if selection is None:
            raise ZooError("DeepSeek sparse attention: the core attention ran without its indexer's selection")
        kernel = resolve_kernel(self.kernel, query.device)
        kernel = "sdpa" if kernel in ("varlen", "flash") else kernel
        if selection.segments is not None:
            if query.dim() == 4:  # [t, 1, h, d]
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            out = query.new_zeros(query.shape[0], self.heads, self.v_dim)
            for (start, length), allowed in zip(selection.segments, selection.masks):
                rows = slice(start, start + length)
                q, k, v = (t[rows].unsqueeze(0).transpose(1, 2) for t in (query, key, value))
                out[rows] = self._attend(q, k, v, kernel, allowed)[0]
            return out.reshape(out.shape[0], -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v, kernel, selection.masks)
        b, s = out.shape[0], out.shape[1]
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()


@functools.lru_cache(maxsize=None)
def _dsa_attention_class() -> Any:
    from mcore_zoo.families.mla.spec import mla_attention_class

    base = mla_attention_class()

    class ZooDSASelfAttention(base):  # type: ignore[misc, valid-type]
        """The MLA layer with DeepSeek sparse attention: the indexer picks the keys, the core
        attention (:class:`SparsePortableAttention`) attends to them."""

        def __init__(self, config: Any, submodules: Any, layer_number: int, *, arch: ArchConfig, **kwargs: Any) -> None:
            super().__init__(config, submodules, layer_number, arch=arch, **kwargs)
            if not isinstance(self.core_attention, SparsePortableAttention):
                raise ZooError(f"DeepSeek sparse attention needs SparsePortableAttention, the layer built"
                               f" {type(self.core_attention).__name__}")  # fmt: skip
            cp = getattr(self.pg_collection, "cp", None)
            if cp is not None and cp.size() > 1:
                raise ZooError("DeepSeek sparse attention under context parallelism is not supported: the indexer"
                               " scores every key of a sequence")  # fmt: skip
            self.indexer = LightningIndexer(arch)
            self._padding = None

        def forward(self, hidden_states: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            self._padding = attention_mask
            try:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            finally:
                self._padding = None

        def get_query_key_value_tensors(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
            packed = kwargs.get("packed_seq_params", args[2] if len(args) > 2 else None)
            x, q_resid = hidden_states, out[3]
            if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                with torch.no_grad():
                    x = gather_from_sequence_parallel_region(x.detach(), group=self.tp_group)
                    q_resid = gather_from_sequence_parallel_region(q_resid.detach(), group=self.tp_group)
            self.core_attention.selection = self.indexer(x, q_resid, packed, self._padding)
            return out

    return ZooDSASelfAttention


def dsa_attention_spec(arch: ArchConfig, backend: str, numerics: Any, mla_spec: Any) -> Any:
    """The MLA ``self_attention`` spec ``mla_spec`` turned into DeepSeek sparse attention: the DSA layer
    class and :class:`SparsePortableAttention` with the profile's kernel (``eager`` on ``local``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if backend not in ("local", "portable", "te"):
        raise ZooError(f"{arch.architecture}: DeepSeek sparse attention is built for te, local and portable")
    kernel = numerics.attention if numerics.attention != "backend" else ("eager" if backend == "local" else "auto")
    core = ModuleSpec(module=SparsePortableAttention, params={"kernel": kernel})
    submodules = dataclasses.replace(mla_spec.submodules, core_attention=core)
    return dataclasses.replace(mla_spec, module=_dsa_attention_class(), submodules=submodules)
