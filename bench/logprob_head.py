"""Log-prob / entropy head: time and peak memory of forward + backward, naive vs chunked, with
Megatron-Core's ``vocab_parallel_cross_entropy`` (the ``labels`` path of ``GPTModel``) on the same
logits as the reference. One process, tp = 1.

Run from the repository root (``PYTHONPATH=src`` or an editable install)::

    python bench/logprob_head.py                                   # CPU, small defaults
    python bench/logprob_head.py --device cuda --tokens 8192 --vocab 151936

Variants (each: a fresh leaf ``logits [T, V]`` of ``--dtype``, random targets and upstream
gradients; forward + backward of ``sum(g * logprob) [+ sum(h * entropy)]``):

* ``naive`` / ``naive-lp``: ``log_softmax(logits.float() / T)`` gathered (+ ``-(p log p).sum``),
  autograd's own backward - the full-logits path;
* ``chunked`` / ``chunked-lp``: :func:`mcore_zoo.distributed.vocab_parallel.token_logprobs_and_entropy`
  with / without entropy (on CUDA its Triton kernels, when Triton imports); ``chunked-lp-inplace``
  with ``inplace_backward=True``; ``chunked-torch`` / ``chunked-lp-torch``: the same head forced onto
  its chunked torch ops (``USE_TRITON = False``);
* ``megatron-ce``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (upstream
  gradient ``-g``, so the logits receive the same gradient as ``chunked-lp``; with a temperature
  other than 1 it is given ``logits / temperature``, one more copy in the logits' dtype).

Reported per variant: median (and min) wall time of forward + backward (``--repeat`` runs after a
warm-up, the variants taking turns),
``saved``: memory held between forward and backward beyond the inputs and outputs, ``peak``: the
highest memory above the inputs (logits, targets, upstream gradients) during forward + backward,
the gradient included; both also per token. CUDA: ``torch.cuda.memory_allocated`` /
``max_memory_allocated``. CPU: the process's resident set (``VmRSS`` / ``VmHWM``, reset through
``/proc/self/clear_refs``), measured in one run with glibc told to map every allocation of 64 KiB
or more on its own (``mallopt``), so that freed buffers leave the resident set at once and the
numbers are live bytes, not allocator caches; the timed runs then let the heap keep and reuse big
buffers (as a GPU caching allocator does), so that page faults do not dominate the CPU times.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

MB = 1 << 20
VARIANTS = ("naive", "chunked", "chunked-torch", "naive-lp", "chunked-lp", "chunked-lp-torch", "chunked-lp-inplace",
            "megatron-ce")


# ---------------------------------------------------------------------------- memory
class CpuMemory:
    """Resident-set accounting. ``exact()``: glibc maps every allocation >= 64 KiB on its own and
    unmaps it on free (RSS = live bytes; every big buffer page-faults anew, which is slow);
    ``fast()``: big buffers come from the heap and are reused (timing without page-fault noise)."""

    def __init__(self) -> None:
        try:
            self._mallopt = ctypes.CDLL("libc.so.6").mallopt
        except OSError:
            self._mallopt = None
            print("warning: no glibc mallopt; CPU peaks may include cached memory")
        self.exact()

    def exact(self) -> None:
        if self._mallopt:
            self._mallopt(-1, 0)  # M_TRIM_THRESHOLD: give freed heap tops back at once
            self._mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD, fixed

    def fast(self) -> None:
        if self._mallopt:
            self._mallopt(-1, 1 << 40)  # never trim
            self._mallopt(-3, 1 << 30)  # heap up to 1 GiB per allocation

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    def current(self) -> int:
        return self._status("VmRSS")

    def reset_peak(self) -> int:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self.current()

    def peak(self) -> int:
        return self._status("VmHWM")

    def sync(self) -> None:
        pass


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self.current()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def exact(self) -> None:
        pass

    def fast(self) -> None:
        pass


# ---------------------------------------------------------------------------- variants
def make_variant(name: str, temperature: float, chunk: Any, use_triton: Any = None) -> Callable[..., tuple[torch.Tensor, Any]]:
    from mcore_zoo.distributed.vocab_parallel import naive_logprobs_and_entropy, token_logprobs_and_entropy

    if name == "naive":
        return lambda x, t: naive_logprobs_and_entropy(x, t, temperature=temperature)
    if name == "naive-lp":

        def naive_lp(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, None]:
            logp = torch.log_softmax(x.float() / temperature, dim=-1)
            return logp.gather(-1, t.unsqueeze(-1)).squeeze(-1), None

        return naive_lp
    if name.endswith("-torch"):  # the chunked head forced onto its torch path (no Triton kernels)
        return make_variant(name[: -len("-torch")], temperature, chunk, use_triton=False)
    if name.startswith("chunked"):
        from mcore_zoo.distributed import vocab_parallel

        kw = dict(temperature=temperature, chunk_tokens=chunk, compute_entropy=name == "chunked",
                  inplace_backward=name.endswith("inplace"))  # fmt: skip

        def chunked(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
            vocab_parallel.USE_TRITON = use_triton  # None: Triton on CUDA; read again in backward
            return token_logprobs_and_entropy(x, t, **kw)

        return chunked
    if name == "megatron-ce":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if temperature != 1.0:
            return lambda x, t: (-vocab_parallel_cross_entropy(x / temperature, t), None)
        return lambda x, t: (-vocab_parallel_cross_entropy(x, t), None)
    raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def make_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    """logits [T, V] (std 3) of ``--dtype``, targets, upstream gradients of log-prob and entropy."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)  # generated where they live
    base = torch.randn(args.tokens, args.vocab, generator=gen, device=device).mul_(3).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen, device=device)
    g = torch.randn(args.tokens, generator=gen, device=device)
    h = torch.randn(args.tokens, generator=gen, device=device)
    return base, targets, g, h


Inputs = tuple[torch.Tensor, ...]


def setup_variant(name: str, args: argparse.Namespace, inputs: Inputs) -> Callable[..., dict[str, Any]]:
    """A function running one forward + backward of ``name`` on a fresh leaf copy of the logits."""
    fn = make_variant(name, args.temperature, args.chunk_tokens)
    base, targets, g, h = inputs

    def once(mem: Any, keep: bool = False) -> dict[str, Any]:
        x = base.clone().requires_grad_()  # megatron-ce modifies fp32 logits in place
        gc.collect()
        start = mem.reset_peak()
        mem.sync()
        t0 = time.perf_counter()
        lp, ent = fn(x, targets)
        mem.sync()
        saved = mem.current() - start - lp.numel() * lp.element_size() - (ent.numel() * 4 if ent is not None else 0)
        t1 = time.perf_counter()
        loss = (lp * g).sum() + ((ent * h).sum() if ent is not None else 0.0)
        loss.backward()
        mem.sync()
        t2 = time.perf_counter()
        out = {"time_s": t2 - t0, "fwd_s": t1 - t0, "saved": saved, "peak": mem.peak() - start}
        if keep:
            out["logprob"] = lp.detach().float().cpu()
        del x, lp, ent, loss
        return out

    return once


def measure_memory(name: str, args: argparse.Namespace, mem: Any, inputs: Inputs) -> dict[str, Any]:
    once = setup_variant(name, args, inputs)
    once(mem)  # warm-up (kernels, lazy imports)
    m = once(mem, keep=True)
    return {
        "variant": name,
        "saved_mb": m["saved"] / MB,
        "peak_mb": m["peak"] / MB,
        "saved_b_per_token": m["saved"] / args.tokens,
        "peak_b_per_token": m["peak"] / args.tokens,
        "_logprob": m["logprob"],
    }


def measure_times(names: list[str], args: argparse.Namespace, mem: Any, inputs: Inputs) -> dict[str, dict[str, float]]:
    """Median times; the variants take turns in each round, so that drifts hit all alike."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    fns = {n: setup_variant(n, args, inputs) for n in names}
    for fn in fns.values():
        fn(mem)
    for _ in range(args.repeat):
        for n, fn in fns.items():
            runs[n].append(fn(mem))
    return {
        n: {
            "ms": 1e3 * statistics.median(r["time_s"] for r in rs),
            "min_ms": 1e3 * min(r["time_s"] for r in rs),
            "fwd_ms": 1e3 * statistics.median(r["fwd_s"] for r in rs),
        }
        for n, rs in runs.items()
    }


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000, help="V / tp: this rank's vocabulary slice")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-tokens", type=int, default=None, help="default: the head's own (256 MiB fp32 buffers)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads (default: torch's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device")
        device = torch.device("cuda", torch.cuda.current_device())
        mem: Any = CudaMemory(device)
    else:
        device = torch.device("cpu")
        mem = CpuMemory()
    names = [n for n in args.variants.split(",") if n]
    if "megatron-ce" in names:
        from mcore_zoo.parallel import ensure_model_parallel

        ensure_model_parallel()  # a one-rank process group and Megatron's groups (tp = 1)

    from mcore_zoo.distributed.vocab_parallel import default_chunk_tokens

    chunk = args.chunk_tokens or default_chunk_tokens(args.vocab)
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"{torch.get_num_threads()} threads), tokens {args.tokens}, vocab {args.vocab}, {args.dtype}, "
        f"temperature {args.temperature}, chunk {chunk} tokens, torch {torch.__version__}"
    )
    inputs = make_inputs(args, device)
    mem.exact()  # first every variant's memory (CPU: exact accounting), then every variant's time
    results = [measure_memory(n, args, mem, inputs) for n in names]
    mem.fast()
    times = measure_times(names, args, mem, inputs)
    for r in results:
        r.update(times[r["variant"]])
    ref = next((r["_logprob"] for r in results if r["variant"] in ("naive", "naive-lp")), None)
    baseline = next((r for r in results if r["variant"] == "megatron-ce"), None)
    itemsize = inputs[0].element_size()
    print(
        "\n| variant | fwd+bwd ms | min ms | fwd ms | saved MB | saved B/token | peak MB | peak B/token"
        " | time / megatron-ce | max abs dlogp vs naive |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        lp = r.pop("_logprob")
        r["max_abs_dlogprob_vs_naive"] = (lp - ref).abs().max().item() if ref is not None else None
        ratio = f"{r['ms'] / baseline['ms']:.2f}x" if baseline else "-"
        dl = f"{r['max_abs_dlogprob_vs_naive']:.2e}" if ref is not None else "-"
        print(
            f"| {r['variant']} | {r['ms']:.1f} | {r['min_ms']:.1f} | {r['fwd_ms']:.1f} | {r['saved_mb']:.0f} "
            f"| {r['saved_b_per_token']:.0f} "
            f"| {r['peak_mb']:.0f} | {r['peak_b_per_token']:.0f} | {ratio} | {dl} |"
        )
    print(
        f"\ninputs: logits {args.tokens * args.vocab * itemsize / MB:.0f} MB ({args.vocab * itemsize} B/token);"
        f" one [T, V] fp32 = {args.tokens * args.vocab * 4 / MB:.0f} MB"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
