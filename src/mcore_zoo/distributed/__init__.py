"""Multi-process helpers: launching, parallel layouts, the distributed forward and export.

* :func:`launch` - run a function on N fresh processes with a process group (tests, CLI, benches).
* :func:`forward` - the THD-packed forward under TP (+SP) / PP / VPP / CP.
* :func:`iter_hf_buckets`, :func:`iter_hf_shards` - export from any layout, in bounded buckets,
  optionally re-split for an inference TP size.
* :func:`current_layout` - this rank's place in the parallel state, checked against a model.
* :func:`token_logprobs_and_entropy` - per-token log-probs and entropy from vocab-parallel logits,
  chunked, with a hand-written backward (:mod:`.vocab_parallel`).
"""

from .export import ExportEntry, export_plan, iter_hf_buckets, iter_hf_shards
from .forward import forward
from .launch import launch
from .layout import Layout, current_layout
from .vocab_parallel import token_logprobs_and_entropy

__all__ = [
    "launch",
    "forward",
    "iter_hf_buckets",
    "iter_hf_shards",
    "export_plan",
    "ExportEntry",
    "current_layout",
    "Layout",
    "token_logprobs_and_entropy",
]
