"""FP8 block round trip: does ``quantize(dequantize(q, s)) == (q, s)`` hold? (CPU, a few minutes)

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/fp8_roundtrip.py [--chunk 65536] [--blocks 2048]

fp32 rounding of ``q * s``, ``448 / amax`` and ``1 / x`` commutes with multiplying ``s`` by a
power of two as long as every value stays a normal fp32 number (``2^-117 <= s <= 2^119``), so one
binade of scales, measured exhaustively, stands for all of them. It prints:

* **plain**: the reference quantizer re-applied to the fp32 dequantization of a reference block
  (largest magnitude 448): how many scales change, by how many ulp - over every forward scale
  ``448 / amax`` of a binade, and over every ``amax`` of a binade;
* **window**: the largest distance (ulp) between a scale and the reference scale recomputed from
  its dequantization (:data:`mcore_zoo.weights.fp8.SCALE_WINDOW` must cover it);
* **all-codes block**: a block holding all 254 finite e4m3 values, for every scale of the binade:
  ``requantize_block(dequantize_block(q, s))`` returns the same fp8 bytes and the same scale;
* **448-only block**: the worst case (only +-448 and 0): how often the scale comes back, and that
  the export always dequantizes to the same fp32 values;
* **bf16 width**: how many fp32 scales a bf16 (fp16) dequantized 128x128 block is consistent with;
* **random blocks**: reference-quantized random normal weights of several block shapes, loaded in
  fp32 and in bf16 and exported with ``requantize_block``: fp8 bytes, scale bytes, and whether a
  second load gives the same values.
"""

from __future__ import annotations

import argparse
import time

import torch

from mcore_zoo.weights.fp8 import (
    FP8_E4M3_MAX,
    SCALE_WINDOW,
    dequantize_block,
    quantize_block,
    requantize_block,
)


def binade(start: int = 0x3F800000) -> torch.Tensor:
    """All 2^23 fp32 values of one binade ([1, 2) by default)."""
    return torch.arange(start, start + (1 << 23), dtype=torch.int64).to(torch.int32).view(torch.float32)


def ref_inv(amax: torch.Tensor) -> torch.Tensor:
    scales = FP8_E4M3_MAX / amax
    return (1.0 / scales).to(torch.float32)


def plain_and_window() -> None:
    sc = binade()  # every forward scale 448 / amax of one binade
    s = 1.0 / sc  # the stored scale_inv the reference writes
    s2 = ref_inv(s * FP8_E4M3_MAX)  # recomputed from the dequantized block (max |q| = 448)
    diff = s2.view(torch.int32).long() - s.view(torch.int32).long()
    vals, counts = torch.unique(diff, return_counts=True)
    print(f"plain re-quantization, reference scales (2^23): changed {float((diff != 0).float().mean()):.4%};"
          f" ulp histogram {dict(zip(vals.tolist(), counts.tolist()))}")  # fmt: skip
    amax = binade()  # every block amax of a binade, quantized by the reference
    s_a = ref_inv(amax)
    d_a = ref_inv(s_a * FP8_E4M3_MAX).view(torch.int32).long() - s_a.view(torch.int32).long()
    vals, counts = torch.unique(d_a, return_counts=True)
    print(f"plain re-quantization, every amax (2^23): changed {float((d_a != 0).float().mean()):.4%};"
          f" ulp histogram {dict(zip(vals.tolist(), counts.tolist()))}")  # fmt: skip
    every = binade()  # every scale, not only those the reference writes (e.g. DeepSeek's amax / 448)
    d_all = ref_inv(every * FP8_E4M3_MAX).view(torch.int32).long() - every.view(torch.int32).long()
    print(f"window: max |ulp| between s and the recomputed scale: reference scales {int(diff.abs().max())},"
          f" all scales {int(d_all.abs().max())} (SCALE_WINDOW = {SCALE_WINDOW})")  # fmt: skip


def codes() -> torch.Tensor:
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return q[~q.float().isnan()]  # 254 finite values, +-0 included


def scan_block(q_row: torch.Tensor, chunk: int, label: str) -> None:
    scales = binade()
    exact_q = exact_s = same_values = plain_s = 0
    t0 = time.time()
    for i in range(0, scales.numel(), chunk):
        s = scales[i : i + chunk, None]  # one block per row: block (1, n)
        n = q_row.numel()
        q = q_row.expand(s.shape[0], n).contiguous()
        w = dequantize_block(q, s.contiguous(), torch.float32, block=(1, n))
        q2, s2 = requantize_block(w, block=(1, n))
        exact_q += int((q2.view(torch.uint8) == q.view(torch.uint8)).all(dim=1).sum())
        exact_s += int((s2.view(torch.int32) == s.view(torch.int32)).sum())
        same_values += int(
            (dequantize_block(q2, s2, torch.float32, block=(1, n)).view(torch.int32) == w.view(torch.int32))
            .all(dim=1)
            .sum()
        )
        plain_s += int((quantize_block(w, block=(1, n))[1].view(torch.int32) == s.view(torch.int32)).sum())
    total = scales.numel()
    print(f"{label}: 2^23 scales, fp8 bytes back {exact_q}/{total}, scale back {exact_s}/{total},"
          f" export dequantizes to the same fp32 {same_values}/{total}; plain quantizer's scale back"
          f" {plain_s}/{total} ({time.time() - t0:.0f} s)")  # fmt: skip


def random_blocks(blocks: int) -> None:
    g = torch.Generator().manual_seed(0)
    for bm, bn in [(128, 128), (16, 16), (4, 4), (1, 8), (1, 1)]:
        n = max(1, blocks * 128 * 128 // (bm * bn * 64)) if bm * bn < 16384 else blocks
        w = torch.randn(n * bm, bn, generator=g) * 0.02
        q, s = quantize_block(w, block=(bm, bn))
        line = f"random normal weights, block {bm}x{bn}, {n} blocks:"
        for dtype in (torch.float32, torch.bfloat16):
            loaded = dequantize_block(q, s, dtype, block=(bm, bn))
            q2, s2 = requantize_block(loaded, block=(bm, bn))
            again = dequantize_block(q2, s2, dtype, block=(bm, bn))
            ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
            same_q = bool(torch.equal(q2.view(torch.uint8), q.view(torch.uint8)))
            same_s = int((s2.view(torch.int32) == s.view(torch.int32)).sum())
            moved = (again.view(ints).int() - loaded.view(ints).int()).abs()
            rel = float(((s2.double() - s.double()).abs() / s.double()).max())
            line += (f" {str(dtype)[6:]}: fp8 bytes {'same' if same_q else 'DIFFER'}, scales same {same_s}/{s.numel()}"
                     f" (max rel {rel:.1e}), reload: {int((moved > 0).sum())}/{moved.numel()} values differ"
                     f" (max {int(moved.max())} ulp);")  # fmt: skip
        print(line)


def bf16_width(blocks: int) -> None:
    """How many fp32 scales a bf16 / fp16 dequantized 128x128 block is consistent with."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(blocks * 128, 128, generator=g) * 0.02
    q, s = quantize_block(w)
    qa = q.double().abs().reshape(blocks, -1)
    s0 = s.reshape(-1)
    ulp = (torch.nextafter(s0, torch.tensor(float("inf"))) - s0).double()
    for dtype in (torch.bfloat16, torch.float16):
        wa = dequantize_block(q, s, dtype).abs().reshape(blocks, -1)
        v, b = wa.double(), wa.view(torch.int16)
        prev, nxt = (b - 1).clamp(min=0).view(dtype).double(), (b + 1).view(dtype).double()
        nz = qa > 0
        low = torch.where(nz, (v + prev) / 2 / qa.clamp(min=1e-30), -float("inf")).amax(1)
        high = torch.where(nz, (v + nxt) / 2 / qa.clamp(min=1e-30), float("inf")).amin(1)
        width = (high - low) / ulp
        inside = bool(((s0.double() >= low) & (s0.double() <= high)).all())
        print(
            f"{str(dtype)[6:]} 128x128 blocks ({blocks}): consistent with {float(width.min()):.0f} to"
            f" {float(width.max()):.0f} fp32 scales (median {float(width.median()):.0f}); original inside: {inside}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk", type=int, default=1 << 16)
    parser.add_argument("--blocks", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    plain_and_window()
    scan_block(codes(), args.chunk, "all-codes block (254 finite e4m3 values)")
    scan_block(
        torch.tensor([448.0, -448.0, 0.0]).to(torch.float8_e4m3fn), args.chunk, "448-only block (+-448, 0)"
    )
    random_blocks(args.blocks)
    bf16_width(256)


if __name__ == "__main__":
    main()
