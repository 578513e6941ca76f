"""Config reading of DeepSeek sparse attention: the lightning indexer's fields (``index_n_heads``,
``index_head_dim``, ``index_topk``, the per-layer ``layer_types`` / ``indexer_types``) ->
:class:`~mcore_zoo.config.arch.DSASpec`, and :func:`read_deepseek_dsa`, the whole converter of
DeepSeek-V3.2 and GLM-5 (the DeepSeek-V3 reading of :func:`~mcore_zoo.families.mla.config.read_deepseek`
plus the indexer).
"""

from __future__ import annotations

import dataclasses

from mcore_zoo.config.arch import ArchConfig, DSASpec
from mcore_zoo.config.reader import ConfigReader, positive_int
from mcore_zoo.families.mla.config import read_deepseek

#: transformers' indexer builds its key norm as ``nn.LayerNorm(index_head_dim, eps=1e-6)``
INDEXER_K_NORM_EPS = 1e-6
#: the name every ``layer_types`` entry carries: ``indexed_attention`` (transformers 5.24),
#: ``deepseek_sparse_attention`` in the configs transformers 5.17 writes (the same layer)
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def read_dsa(reader: ConfigReader, *, rope_dim: int, num_layers: int, rope_interleave: bool) -> DSASpec:
    """The indexer fields -> :class:`DSASpec`. ``rope_interleave``: the indexer's RoPE layout of the
    architecture (transformers fixes it per model: rotate-half pairs for DeepSeek-V3.2, interleaved
    pairs for GLM-5); ``layer_types`` must name DeepSeek sparse attention (:data:`DSA_LAYER_TYPES`)
    for every layer."""
    heads = reader.map_checked("index_n_heads", "DSASpec.index_n_heads (indexer query heads)", positive_int,
                               reason="must be > 0")  # fmt: skip
    head_dim = reader.map_checked("index_head_dim", "DSASpec.index_head_dim (indexer query / key width)",
                                  lambda v: positive_int(v) and v >= rope_dim,
                                  reason=f"must be >= qk_rope_head_dim = {rope_dim} (RoPE on its first dims)")  # fmt: skip
    topk = reader.map_checked("index_topk", "DSASpec.index_topk (keys each query attends to)", positive_int,
                              reason="must be > 0")  # fmt: skip
    reader.expect("layer_types", lambda v: v is None or (len(set(v)) == 1 and len(v) == num_layers
                                                         and v[0] in DSA_LAYER_TYPES), default=None,
                  reason=f"every layer is DeepSeek sparse attention: {num_layers} x one of {DSA_LAYER_TYPES}",
                  detail="every layer 'indexed_attention' (the indexer in each MLA layer)")  # fmt: skip
    return DSASpec(index_n_heads=heads, index_head_dim=head_dim, index_topk=topk, rope_interleave=rope_interleave,
                   k_norm_eps=INDEXER_K_NORM_EPS)  # fmt: skip


def read_mlp_layer_types(reader: ConfigReader, num_layers: int) -> None:
    """``mlp_layer_types``: transformers derives it from ``first_k_dense_replace``; any other pattern
    is refused (the MoE family reads the dense lead-in from ``first_k_dense_replace``)."""
    dense = min(int(reader.peek("first_k_dense_replace") or 0), num_layers)
    derived = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    reader.expect("mlp_layer_types", lambda v: v is None or list(v) == derived, default=None,
                  reason=f"must be first_k_dense_replace={dense} dense layers, then sparse ones: {derived}",
                  detail="derived: first_k_dense_replace dense layers, then MoE layers")  # fmt: skip


def read_deepseek_dsa(reader: ConfigReader, *, indexer_rope_interleave: bool) -> ArchConfig:
    """The DeepSeek-V3.2 / GLM-5 converter: DeepSeek-V3's reading (MLA with a q latent, the grouped
    sigmoid router with expert bias, shared experts, dense lead-in layers, MTP, FP8 blocks) plus the
    indexer (:func:`read_dsa`) and ``mlp_layer_types``."""
    layers = reader.peek("num_hidden_layers")
    read_mlp_layer_types(reader, layers)
    arch = read_deepseek(reader, v3=True)
    if arch.mla.q_lora_rank is None:
        raise reader.unsupported("q_lora_rank", None, "transformers' DeepSeek sparse attention always projects q"
                                 " through the q latent (its indexer reads it)")  # fmt: skip
    dsa = read_dsa(reader, rope_dim=arch.mla.qk_rope_head_dim, num_layers=layers, rope_interleave=indexer_rope_interleave)
    return arch.replace(mla=dataclasses.replace(arch.mla, indexer=dsa))


def read_glm_indexer_fields(reader: ConfigReader, num_layers: int) -> None:
    """GLM-5's indexer fields: ``indexer_types`` must run the indexer in every layer (``shared`` layers,
    which reuse the previous full layer's selection - GLM-5.2's ``index_topk_freq`` - are refused by
    name), the schedule fields it is derived from are recorded as read through it, and
    ``indexer_rope_interleave`` must say what transformers' GLM indexer computes (interleaved pairs)."""
    types = reader.peek("indexer_types")
    if types is not None and list(types) != ["full"] * num_layers:
        raise reader.unsupported("indexer_types", types, "layers that reuse the previous full layer's top-k selection"
                                 " ('shared': cross-layer index sharing) are not built; every layer must be 'full'")  # fmt: skip
    reader.map("indexer_types", "every layer runs its own lightning indexer ('full')", None)
    for name in ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"):
        reader.ignore(name, "read by transformers only to derive indexer_types, which is checked")
    reader.expect("indexer_rope_interleave", lambda v: v is None or bool(v), default=None,
                  reason="transformers' GLM-5 indexer always rotates interleaved pairs",
                  detail="true: the indexer rotates interleaved pairs (what transformers' GLM-5 computes)")  # fmt: skip
    reader.expect("index_share_for_mtp_iteration", lambda v: not v, default=None,
                  reason="MTP depths that reuse the main model's selection are not built (each MTP layer runs its"
                  " own indexer)", detail="absent / false: each MTP layer runs its own indexer")  # fmt: skip
