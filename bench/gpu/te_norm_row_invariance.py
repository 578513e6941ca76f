"""Does Transformer Engine's RMSNorm give a row the same bits whatever surrounds it?

Run on a GPU with Transformer Engine installed::

    python bench/gpu/te_norm_row_invariance.py

Normalises a ``[4096, 1024]`` bf16 tensor once, then sub-sets of its rows (other row counts, a
one-row offset, a buffer that is not 16-byte aligned) and prints, for each, whether the rows came
out bit-identical to the same rows of the full call. TE's native normalization kernels choose
between a vectorised ("tuned") and a general kernel by row count and pointer alignment, and the two
reduce in different orders; ``NVTE_NORM_FWD_USE_CUDNN=1`` selects TE's cuDNN normalization instead.
Results: docs/parity/parallel.md (why ``te`` pipeline parallelism was not bitwise).
"""

from __future__ import annotations

import torch


def main() -> None:
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    hidden = 1024
    norm = te.RMSNorm(hidden, eps=1e-5, params_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        x = (torch.randn(4096, hidden, device="cuda") * 3).bfloat16()
        full = norm(x)
        for rows in (1, 37, 949, 952, 1000, 2048, 4095):
            print(f"first {rows} rows alone: bitwise {torch.equal(norm(x[:rows].clone()), full[:rows])}")
        print(f"rows 1.. (one-row offset): bitwise {torch.equal(norm(x[1:].clone()), full[1:])}")
        buf = torch.empty(4096 * hidden + 8, dtype=torch.bfloat16, device="cuda")
        view = buf[8:].view(4096, hidden)
        view.copy_(x)
        print(f"16-byte aligned copy: bitwise {torch.equal(norm(view), full)}")
        view = buf[1 : 1 + 4096 * hidden].view(4096, hidden)
        view.copy_(x)
        print(f"2-byte aligned copy: bitwise {torch.equal(norm(view), full)}")


if __name__ == "__main__":
    main()
