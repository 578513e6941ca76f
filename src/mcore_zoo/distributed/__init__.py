"""The only package that issues collectives: launching, loading, the one forward and the one export.

* :func:`launch` - run a function on N fresh processes with a process group (tests, CLI, benches);
  :func:`rank_threads` - the intra-op thread count each launched rank runs at.
* :func:`load_hf_weights` - sharded loading under any layout (:mod:`.load`).
* :func:`packed_forward` / :func:`generic_forward` - the THD-packed forward under TP (+SP) / PP /
  VPP / CP (:mod:`.forward`).
* :func:`iter_hf_weights`, :func:`iter_hf_buckets`, :func:`iter_hf_shards`,
  :func:`save_hf_checkpoint` - export from any layout, in bounded buckets, optionally re-split for
  an inference TP size (:mod:`.export`).
* :func:`copy_weights` - one model's weights into another at another layout, streamed in buckets
  (:mod:`.copy`).
* :func:`wrap_for_training` - Megatron-Core's DDP wrapper and optimizer on the model's process
  groups (:mod:`.optimizer`).
* :func:`token_logprobs_and_entropy` - per-token log-probs and entropy from vocab-parallel logits,
  chunked, with a hand-written backward (:mod:`.vocab_parallel`).

Every function takes a model (or its handle) and reads this rank's place from the handle's
:class:`~mcore_zoo.placement.Placement`.
"""

from .copy import CopyReport, copy_weights
from .export import ExportEntry, export_plan, iter_hf_buckets, iter_hf_shards, iter_hf_weights, save_hf_checkpoint
from .forward import generic_forward, packed_forward
from .launch import launch, rank_threads
from .load import load_hf_state_dict, load_hf_weights
from .optimizer import TrainingSetup, wrap_for_training
from .vocab_parallel import token_logprobs_and_entropy

__all__ = [
    "launch",
    "rank_threads",
    "load_hf_weights",
    "load_hf_state_dict",
    "packed_forward",
    "generic_forward",
    "iter_hf_weights",
    "iter_hf_buckets",
    "iter_hf_shards",
    "save_hf_checkpoint",
    "export_plan",
    "ExportEntry",
    "token_logprobs_and_entropy",
    "wrap_for_training",
    "TrainingSetup",
    "copy_weights",
    "CopyReport",
]
