"""Whether vLLM's FlashAttention-3 gives a token the same bits in a decode step as in a prefill,
per head size - the premise of ``vllm-exact``'s head-size rule
(:func:`mcore_zoo.kernels.vllm_ops.decode_equals_prefill`).

Run on the GPU machine with vLLM (``source bench/gpu/vllm-env.sh``)::

    python3 bench/gpu/vllm_exact_decode_probe.py --out /tmp/fa.json

Random bf16 q / k / v for four sequences (85, 112, 148, 53 tokens; 8 query heads, 2 KV heads) in a
paged cache of 16-token blocks; every token's attention output computed (a) the way the trainer
computes a pack (one causal call, ``max_seqlen_q`` = the longest sequence) and (b) the way a vLLM
decode step computes it (one query per sequence over its first ``pos + 1`` keys,
``max_seqlen_q=1``), and (c) as (b) with ``max_seqlen_q=2`` (a step that also prefills: FA3 keeps
such a call causal). For each head size: how many rows of (b) and (c) equal (a) bit for bit, and
the first positions that do not. The GPU test
``tests/gpu/test_vllm_exact_gpu.py::test_flash_attention_decode_steps_equal_prefill_where_the_profile_says_so``
asserts the rule with the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-size", type=int, action="append", help="default: 16 32 64 80 96 128 192 256")
    ap.add_argument("--out")
    args = ap.parse_args()
    from test_vllm_exact_gpu import decode_vs_prefill

    sizes = args.head_size or [16, 32, 64, 80, 96, 128, 192, 256]
    result = {f"head_size_{hd}": {f"decode_max_q{m}": decode_vs_prefill(hd, max_q=m) for m in (1, 2)} for hd in sizes}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
