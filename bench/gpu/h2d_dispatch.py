"""Host time to issue one ``non_blocking`` host-to-device copy from a pinned buffer, alone and
beside background threads.

    python bench/gpu/h2d_dispatch.py [--threads 8] [--file PATH] [--kinds readers,memcpy]

The reference for ``load_gpu.py --breakdown``'s "ring.copy (dispatch)" per copy: 20 copies of 3 MB
(one Qwen3-30B-A3B expert matrix, 768 x 2048 bf16) from a view into a 16 MiB pinned buffer into
device tensors on a side stream, 4 trials; per trial the host microseconds per copy issued, whether
the stream was already done when the last copy was issued (``False``: the copies are asynchronous),
and the milliseconds until the stream finished. Also 2 KB copies, 16 MB copies, a destination that
is half of a parameter, and device-to-device copies.

Then the 3 MB copies again (200 per trial) while ``--threads`` background threads run, one kind at
a time (``--kinds``, default ``readers,memcpy``) - what separates the causes of the load's slower
dispatch:

* ``readers``: a thread pool reading 6 MiB batches of ``--file`` (default: a 256 MiB file written
  under /tmp, read once first so it is in the page cache) with ``os.preadv`` into pinned memory, one
  future per batch, as the staging ring's read pool does (Python between reads, the lock released
  during each read);
* ``memcpy``: threads copying 64 MiB host tensors with ``Tensor.copy_`` (the interpreter lock
  released for the whole copy): memory bandwidth taken, almost no Python;
* ``python``: threads running pure Python (the lock taken, no memory traffic; slow: every copy
  waits for the interpreter's switch interval).

If ``readers`` and ``python`` slow the dispatch and ``memcpy`` does not, the cost is the
interpreter lock; if ``memcpy`` does too, memory bandwidth. Last, five 3 MB copies out of one
pinned buffer issued one ``copy_`` each against one ``torch._foreach_copy_`` call (the lock
released once), alone and beside the readers; the copies' bytes are checked.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch


def issue_times(issue: Callable[[int], None], stream: torch.cuda.Stream, k: int, reps: int) -> list[tuple[float, bool, float]]:
    """``reps`` times: ``issue(i)`` for ``i < k`` on ``stream`` from an idle device ->
    ``(host us per issue, stream done when all were issued, ms until it was)``."""
    res = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.cuda.stream(stream):
            for i in range(k):
                issue(i)
        t1 = time.perf_counter()
        done = stream.query()
        stream.synchronize()
        res.append(((t1 - t0) / k * 1e6, done, (time.perf_counter() - t0) * 1e3))
    return res


def trial(name: str, dests: list[torch.Tensor], source: torch.Tensor, stream: torch.cuda.Stream, k: int = 20) -> None:
    res = issue_times(lambda i: dests[i % len(dests)].copy_(source, non_blocking=True), stream, k, 4)
    print(f"{name}: us per copy issued {[round(r[0], 1) for r in res]}, stream done when issued {[r[1] for r in res]}, "
          f"ms to done {[round(r[2], 2) for r in res]}")  # fmt: skip


class Background:
    """``threads`` threads doing one kind of work (the module docstring) until stopped."""

    def __init__(self, kind: str, threads: int, path: str) -> None:
        self.kind, self.threads, self.path = kind, threads, path
        self.stop = threading.Event()
        self.workers: list[threading.Thread] = []

    def __enter__(self) -> "Background":
        if self.kind == "readers":
            self.workers = [threading.Thread(target=self._readers, daemon=True)]
        else:
            target = self._memcpy if self.kind == "memcpy" else self._python
            self.workers = [threading.Thread(target=target, daemon=True) for _ in range(self.threads)]
        for w in self.workers:
            w.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for w in self.workers:
            w.join()

    def _readers(self) -> None:
        batch = 6 << 20
        size = os.path.getsize(self.path) // batch * batch
        bufs = [torch.empty(batch, dtype=torch.uint8, pin_memory=torch.cuda.is_available()) for _ in range(2 * self.threads)]
        fd = os.open(self.path, os.O_RDONLY)

        def read(i: int, offset: int) -> None:
            os.preadv(fd, [memoryview(bufs[i % len(bufs)].numpy())], offset)

        with ThreadPoolExecutor(self.threads) as pool:
            i = 0
            while not self.stop.is_set():
                futures = [pool.submit(read, i + j, ((i + j) * batch) % size) for j in range(len(bufs))]
                for f in futures:
                    f.result()
                i += len(bufs)
        os.close(fd)

    def _memcpy(self) -> None:
        a, b = torch.ones(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8)
        while not self.stop.is_set():
            b.copy_(a)

    def _python(self) -> None:
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--file", default=None, help="a file to read in the background (default: 256 MiB under /tmp)")
    ap.add_argument("--kinds", default="readers,memcpy", help="background kinds, comma-separated: readers, memcpy, python")
    args = ap.parse_args()
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
    path = args.file
    if path is None:
        path = "/tmp/h2d_dispatch_read.bin"
        if not os.path.exists(path) or os.path.getsize(path) != 256 << 20:
            with open(path, "wb") as f:
                f.write(os.urandom(256 << 20))
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    trial("3 MB x 200, alone", dst, src.view(-1), stream, k=200)
    for kind in args.kinds.split(","):
        with Background(kind, args.threads, path):
            trial(f"3 MB x 200, beside {args.threads} {kind} thread(s)", dst, src.view(-1), stream, k=200)
    srcs = [typed[i * n : (i + 1) * n] for i in range(5)]
    typed[: 5 * n].copy_(torch.randn(5 * n).to(torch.bfloat16))
    dsts = dst[:5]
    torch._foreach_copy_(dsts, srcs, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(d.cpu(), x) for d, x in zip(dsts, srcs)), "foreach copy: bytes differ"
    foreach_trials(dsts, srcs, stream, "alone")
    with Background("readers", args.threads, path):
        foreach_trials(dsts, srcs, stream, f"beside {args.threads} readers thread(s)")


def foreach_trials(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: torch.cuda.Stream, label: str,
                   k: int = 40) -> None:  # fmt: skip
    """Host microseconds to issue ``len(dsts)`` copies: one ``copy_`` each, then one ``_foreach_copy_``."""
    def each(_: int) -> None:
        for d, x in zip(dsts, srcs):
            d.copy_(x, non_blocking=True)

    def foreach(_: int) -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    for name, issue in (("copy_ each", each), ("_foreach_copy_", foreach)):
        res = [round(r[0], 1) for r in issue_times(issue, stream, k, 3)]
        print(f"{len(dsts)} x 3 MB, {name}, {label}: us per {len(dsts)} copies issued {res}")


if __name__ == "__main__":
    main()
