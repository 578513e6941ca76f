"""Host time to issue one ``non_blocking`` host-to-device copy from a pinned buffer, alone.

    python bench/gpu/h2d_dispatch.py

The reference for ``load_gpu.py --breakdown``'s "ring.copy (dispatch)" per copy: 20 copies of 3 MB
(one Qwen3-30B-A3B expert matrix, 768 x 2048 bf16) from a view into a 16 MiB pinned buffer into
device tensors on a side stream, 4 trials; per trial the host microseconds per copy issued, whether
the stream was already done when the last copy was issued (``False``: the copies are asynchronous),
and the milliseconds until the stream finished. Also 2 KB copies, 16 MB copies, a destination that
is half of a parameter, and device-to-device copies.
"""

from __future__ import annotations

import time

import torch


def trial(name: str, dests: list[torch.Tensor], source: torch.Tensor, stream: torch.cuda.Stream, k: int = 20) -> None:
    res = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.cuda.stream(stream):
            for d in dests[:k]:
                d.copy_(source, non_blocking=True)
        t1 = time.perf_counter()
        done = stream.query()
        stream.synchronize()
        res.append(((t1 - t0) / k * 1e6, done, (time.perf_counter() - t0) * 1e3))
    print(f"{name}: us per copy issued {[round(r[0], 1) for r in res]}, stream done when issued {[r[1] for r in res]}, "
          f"ms to done {[round(r[2], 2) for r in res]}")  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    n = 768 * 2048
    buf = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    print("pinned:", buf.is_pinned(), "|", torch.cuda.get_device_name(), "| torch", torch.__version__)
    weight = torch.nn.Parameter(torch.empty(2 * n, dtype=torch.bfloat16, device=dev))
    dst = [torch.empty(n, dtype=torch.bfloat16, device=dev) for _ in range(20)]
    stream = torch.cuda.Stream()
    typed = buf.view(torch.bfloat16)
    src = typed.as_strided((768, 2048), (2048, 1), 512)
    trial("3 MB", dst, src.view(-1), stream)
    trial("3 MB, 2-d view", [d.view(768, 2048) for d in dst], src, stream)
    trial("3 MB into half a parameter", [weight[:n].view(768, 2048)] * 20, src, stream)
    trial("2 KB", [d[:1024] for d in dst], typed[:1024], stream)
    trial("16 MB", [torch.empty(8 << 20, dtype=torch.bfloat16, device=dev) for _ in range(5)], typed[: 8 << 20], stream, k=5)
    trial("3 MB device to device", dst, torch.empty(n, dtype=torch.bfloat16, device=dev), stream)


if __name__ == "__main__":
    main()
