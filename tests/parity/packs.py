"""THD packs of mixed lengths and of many short sequences, each sequence against transformers run on
it alone, at one and at two torch threads (the CPU BLAS picks its kernel, and splits the rows over
threads, by the GEMM's shape: the ``hf-exact`` pack must give each GEMM one sequence's rows)."""

from __future__ import annotations

from typing import Any

import torch

import mcore_zoo

from ..conftest import random_sequences

#: a mixed pack with sequences of 1-3 tokens, and a pack of many short sequences; alignment 1 and 8
PACKS = (([13, 7, 3, 1], 1), ([2] * 8 + [5, 1, 3], 8))
THREADS = (1, 2)


def assert_packs_equal_alone(model: Any, hf: Any, *, seed: int = 3) -> None:
    """Every sequence of every pack in :data:`PACKS` bitwise equal to ``hf`` on it alone, at each
    thread count of :data:`THREADS`."""
    threads = torch.get_num_threads()
    try:
        for count in THREADS:
            torch.set_num_threads(count)
            for k, (lengths, align) in enumerate(PACKS):
                seqs = random_sequences(lengths, hf.config.vocab_size, seed=seed + k)
                with torch.no_grad():
                    packed = mcore_zoo.packed_forward(model, seqs, seq_format="thd", align=align).logits
                    for seq, got in zip(seqs, packed):
                        ref = hf(seq[None]).logits[0]
                        diff = (got.float() - ref.float()).abs().max().item()
                        assert torch.equal(got.to(ref.dtype), ref), (
                            f"{count} threads, pack {lengths} (align {align}): the sequence of {seq.numel()} tokens"
                            f" differs from transformers on it alone by {diff:.3g}")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
