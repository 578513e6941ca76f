"""Loading an 8B-shaped HF checkpoint onto the GPU, against the read + host-to-device copy floor.

    python bench/gpu/load_gpu.py --out OUT [--ckpt DIR] [--rounds 3] [--no-tp2]
    python bench/gpu/load_gpu.py --out OUT --shape qwen3-30b-a3b [--layers 4]   # MoE at EP1 and EP2
    python bench/gpu/load_gpu.py --out OUT --device cpu --tiny      # the CPU dry run (tiny shapes)

``--shape qwen3-30b-a3b``: Qwen3-30B-A3B's published widths (128 experts of 768, hidden 2048,
vocabulary 151936) with ``--layers`` layers (default 4), loaded at EP1 (one GPU) and EP2 (two): an
EP2 rank's bytes are the shared tensors (embedding, head, attention, norms, routers) and its half
of the experts, and the load reads the shared ones on every rank (``replicas="read"``), as the
floor does.

The checkpoint (``--ckpt``, default ``$TMPDIR/mcore-zoo-load-gpu/llama-3.1-8b``) has
Llama-3.1-8B's shape: hidden 4096, 32 layers, ffn 14336, vocab 128256, untied, bf16, about 16 GB in
4 safetensors shards of random values (generated on the GPU, written once, reused when present;
``--tiny``: a few MB). Its files are read once first (warm page cache). Then ``--rounds`` rounds,
each measurement in a fresh process, alternating the order between rounds:

* **floor** (TP1: one process; TP2: two, ``torch.distributed.run``): the bytes the rank needs (TP2:
  its tensor-parallel slices, along the axes the weight map splits on) read with ``os.preadv`` on
  as many threads as the staging ring reads with (``mcore_zoo.weights.staging.READ_THREADS``;
  ``--threads`` sets another count) into a ring of 8 pinned 64 MiB buffers, each buffer read in
  pieces of 8 MiB spread over the threads, and copied to the device with ``non_blocking`` copies
  on a side stream into one device buffer: ``read_s`` (the reads alone), ``copy_s`` (the
  host-to-device copies alone, from pinned memory) and ``floor_s`` (both, overlapped: each buffer
  is copied as soon as all its pieces are read, and read into again once its copy is done). The
  floor of a load is ``floor_s``. (Before 2026-11-27's sixth run each buffer was read by one thread
  and the threads were ``torch.get_num_threads()``: a floor that a load reading with 8 threads beat
  by 1.2x on the 8B-shaped checkpoint.)
* **zoo**: ``mcore_zoo.model_provider(ckpt, perform_initialization=False)`` builds the model on the
  device (``build_s``), then ``mcore_zoo.load_hf_weights(model, ckpt)`` (``load_s``: the pinned
  staging ring of :mod:`mcore_zoo.weights.staging`). Peak host RSS above the RSS just before the
  load (``VmHWM`` reset through ``/proc/self/clear_refs``) against the staging ring (the rank's
  share on the host is 0: the weights go to the device). In the first round each load is checked
  bitwise against a second load of the same checkpoint through the mapping path (the device path
  before the staging ring). Each load also records the CPU time of its main thread
  (``load_main_thread_cpu_s``: near ``load_s``, the load waits on its own Python, not on the reads
  or copies) and of the process; ``--profile``: the first round's loads run once more under
  cProfile, after the timed one, and the statistics go into the raw results (``profile``);
  ``--breakdown``: they run once more with timers around the load's steps on the main thread
  (:func:`timed_load`: wall time inside the weight map, the staging ring's calls, waits on reads and
  on CUDA events, and outside all of them), into ``breakdown``; ``--breakdown first`` times the
  timed load itself instead, with the steps only a process's first load takes (binding the rules,
  the checks, the ring's pinned buffers).

TP2 ranks time between barriers; the job time is the slower rank's. Per round, the ratio is the
floor's time / the load's time (1.0: the load runs at the floor); medians and min - max over the
rounds. GB/s: the bytes the rank read / its time. Results: ``OUT/load_gpu.json`` and
``OUT/load_gpu.md``; every process's log under ``OUT/logs/``. A failing process is recorded and
the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: load_export's peak-RSS helpers

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048}  # fmt: skip
SHARDS = 4
#: ``--shape``: (HF config builder (layers -> dict), default layers, two layouts as (name, world, "tp" / "ep"))
SHAPES = {"llama-8b": (None, 32, (("tp1", 1, "tp"), ("tp2", 2, "tp"))),
          "qwen3-30b-a3b": ("qwen3_moe_config", 4, (("ep1", 1, "ep"), ("ep2", 2, "ep")))}  # fmt: skip
TINY_MOE = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
            "num_hidden_layers": 2}  # fmt: skip
FLOOR_BUFFER = 64 << 20
FLOOR_BUFFERS = 8
FLOOR_PIECE = 8 << 20  # a buffer's reads are cut into pieces of this many bytes, read by any thread


# ---------------------------------------------------------------------------- the checkpoint
def config(tiny: bool, shape: str = "llama-8b", layers: Optional[int] = None) -> dict[str, Any]:
    builder, default_layers, _ = SHAPES[shape]
    if builder is None:
        cfg = {**LLAMA31_8B, **(TINY if tiny else {})}
    else:
        sys.path.insert(0, str(HERE))
        import numerics_speed

        cfg = {**getattr(numerics_speed, builder)(layers or default_layers), **(TINY_MOE if tiny else {})}
        cfg["torch_dtype"] = "bfloat16"
    if layers and not tiny:
        cfg["num_hidden_layers"] = layers
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    moe = "num_experts" in cfg
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
        if not moe:
            f = cfg["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})  # fmt: skip
            continue
        f = cfg["moe_intermediate_size"]
        shapes.update({p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,),
                       p + "mlp.gate.weight": (cfg["num_experts"], h)})  # fmt: skip
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (f, h), x + "up_proj.weight": (f, h), x + "down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def _complete(ckpt: Path, cfg: dict[str, Any]) -> bool:
    index = ckpt / "model.safetensors.index.json"
    if not index.is_file() or not (ckpt / "config.json").is_file():
        return False
    if json.loads((ckpt / "config.json").read_text()) != cfg:
        return False
    files = set(json.loads(index.read_text())["weight_map"].values())
    return all((ckpt / f).is_file() for f in files)


def write_checkpoint(ckpt: Path, cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """Random bf16 values (drawn on ``device``) in :data:`SHARDS` safetensors shards + index +
    config, written into a sibling directory renamed into place; kept when already complete."""
    import torch

    from mcore_zoo.weights.io import write_safetensors

    if _complete(ckpt, cfg):
        return {"written": False}
    t0 = time.perf_counter()
    shapes = tensor_shapes(cfg)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        if groups[-1] and used >= total / SHARDS * len(groups):
            groups.append([])
        groups[-1].append(name)
        used += math.prod(shape) * 2
    tmp = ckpt.with_name(ckpt.name + f".partial-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            value = torch.randn(shapes[name], generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            tensors[name] = value.to(torch.bfloat16).cpu()
            weight_map[name] = fname
        write_safetensors(tmp / fname, tensors, {"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    os.rename(tmp, ckpt)
    return {"written": True, "seconds": time.perf_counter() - t0, "bytes": total}


def warm(ckpt: Path) -> float:
    """Read every file once (the page cache holds them afterwards); returns the seconds."""
    t0 = time.perf_counter()
    for file in sorted(ckpt.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- one rank
def _rank() -> tuple[int, int, int]:
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rss() -> dict[str, Any]:
    from load_export import peak, reset_peak

    try:
        return {"before": reset_peak(), "peak": peak, "reset": True}
    except OSError:  # no /proc/self/clear_refs: the process's peak so far stands
        return {"before": peak(), "peak": peak, "reset": False}


def _expert_owner(name: str, experts: int, size: int) -> Optional[int]:
    """The EP rank holding the routed expert tensor ``name`` (``None``: not an expert's)."""
    parts = name.split(".")
    if "experts" not in parts:
        return None
    return int(parts[parts.index("experts") + 1]) // (experts // size)


def rank_runs(ckpt: str, rank: int, size: int, parallel: str = "tp") -> list[tuple[str, int, int]]:
    """``(file, byte offset, bytes)`` of every contiguous run of the checkpoint this rank loads.
    TP: its chunk of each tensor along the axis the weight map splits it on (a column chunk of
    narrow rows counts as its whole rows, one range, as the load's staging ring reads it:
    ``mcore_zoo.weights.staging.ROWS_BELOW`` / ``ROWS_SPAN``). EP: every tensor but the routed
    experts of other ranks, whole."""
    import mcore_zoo
    from mcore_zoo.weights import pread, staging
    from mcore_zoo.weights.io import HFCheckpoint
    from mcore_zoo.weights.rules import TPSlice

    arch = mcore_zoo.lookup(ckpt)
    axes = {n: a for b in arch.weight_map(arch.config_from_hf(ckpt)).expand_full() for n, a in zip(b.hf, b.tp_axes)}
    experts = json.loads((Path(ckpt) / "config.json").read_text()).get("num_experts", 0)
    runs = []
    with HFCheckpoint(ckpt) as c:
        for name in sorted(c.keys(), key=lambda n: (c.entry(n).file, c.entry(n).offset)):
            entry = c.entry(name)
            if parallel == "ep":
                if _expert_owner(name, experts, size) in (None, rank):
                    runs.append((entry.file, entry.offset, math.prod(entry.shape) * 2))
                continue
            axis = axes[name] if size > 1 else None
            box = TPSlice(axis, rank, size).box(entry.shape, name)
            shape = [hi - lo for lo, hi in box]
            strides = [math.prod(entry.shape[d + 1 :]) for d in range(len(entry.shape))]
            first = entry.offset + 2 * sum(lo * st for (lo, _), st in zip(box, strides))
            run, outer, outer_strides = pread._runs(shape, strides)
            starts = pread._starts(outer, outer_strides, first, 2)
            spacing = staging._row_spacing(run, starts, 2)
            if spacing is not None and spacing <= staging.BUFFER_BYTES:  # whole rows, as the ring reads them
                runs.append((entry.file, starts[0], (len(starts) - 1) * spacing + run * 2))
            else:
                runs += [(entry.file, start, run * 2) for start in starts]
    return runs


def _batches(runs: list[tuple[str, int, int]], limit: int) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """The runs as batches of at most ``limit`` bytes of one file each: ``(file, [(file offset,
    position in the rank's bytes, bytes)])`` (``pread._split`` cuts them)."""
    from mcore_zoo.weights import pread

    batches, position = [], 0
    for file in dict.fromkeys(f for f, _, _ in runs):
        segments = []
        for _, offset, n in (r for r in runs if r[0] == file):
            segments.append((offset, position, n))
            position += n
        total = sum(n for _, _, n in segments)
        batches += [(file, group) for group in pread._split(segments, -(-total // limit)) if group]
    return batches


def phase_floor(args: argparse.Namespace) -> dict[str, Any]:
    """Read this rank's bytes into pinned buffers and copy them to the device (module docstring)."""
    import torch

    from mcore_zoo.parallel import ensure_process_group
    from mcore_zoo.weights import staging

    rank, world, local = _rank()
    ensure_process_group("gloo")
    args.threads = args.threads or staging.READ_THREADS
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    runs = rank_runs(args.ckpt, rank, world, args.parallel)
    total = sum(n for _, _, n in runs)
    batches = _batches(runs, FLOOR_BUFFER)
    fds = {f: os.open(os.path.join(args.ckpt, f), os.O_RDONLY) for f in {r[0] for r in runs}}
    ring = [torch.empty(FLOOR_BUFFER, dtype=torch.uint8, pin_memory=cuda) for _ in range(FLOOR_BUFFERS)]
    views = [memoryview(buffer.numpy()) for buffer in ring]
    device_buffer = torch.empty(total, dtype=torch.uint8, device=args.device)
    stream = torch.cuda.Stream() if cuda else None
    pool = ThreadPoolExecutor(args.threads)

    def pieces(batch: tuple[str, list[tuple[int, int, int]]]) -> list[tuple[int, int, int, int]]:
        """The batch's reads as ``(fd, file offset, position in its buffer, bytes)`` of at most FLOOR_PIECE."""
        file, segments = batch
        out, at = [], 0
        for offset, _, n in segments:
            for done in range(0, n, FLOOR_PIECE):
                out.append((fds[file], offset + done, at + done, min(FLOOR_PIECE, n - done)))
            at += n
        return out

    plan = [pieces(batch) for batch in batches]

    def read_piece(view: memoryview, fd: int, offset: int, at: int, n: int, wait: Any = None) -> None:
        if wait is not None:  # the copy out of this buffer is done
            wait.synchronize()
        done = 0
        while done < n:
            got = os.preadv(fd, [view[at + done : at + n]], offset + done)
            if got <= 0:
                raise OSError("unexpected end of file")
            done += got

    def read(k: int, wait: Any = None) -> list[Any]:
        """Start the reads of batch ``k`` into its buffer; their futures."""
        view = views[k % FLOOR_BUFFERS]
        return [pool.submit(read_piece, view, *piece, wait) for piece in plan[k]]

    def copy(k: int, size: int, position: int) -> None:
        source = ring[k % FLOOR_BUFFERS][:size]
        if stream is None:
            device_buffer[position : position + size].copy_(source)
            return
        with torch.cuda.stream(stream):
            device_buffer[position : position + size].copy_(source, non_blocking=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sizes = [sum(n for _, _, n in segments) for _, segments in batches]
    positions = [segments[0][1] for _, segments in batches]
    result: dict[str, Any] = {"rank": rank, "bytes": total, "batches": len(batches), "threads": args.threads}
    # the reads alone (into the ring, overwritten)
    _barrier()
    t0 = time.perf_counter()
    for futures in [read(k) for k in range(len(batches))]:
        for future in futures:
            future.result()
    _barrier()
    result["read_s"] = time.perf_counter() - t0
    # the copies alone (the same bytes, from the ring)
    sync()
    _barrier()
    t0 = time.perf_counter()
    for k in range(len(batches)):
        copy(k, sizes[k], positions[k])
    sync()
    _barrier()
    result["copy_s"] = time.perf_counter() - t0
    # both, overlapped: a buffer is read again once the copy out of it is done
    events: list[Any] = [None] * FLOOR_BUFFERS
    _barrier()
    t0 = time.perf_counter()
    futures = {k: read(k) for k in range(min(FLOOR_BUFFERS, len(batches)))}
    for k in range(len(batches)):
        for future in futures.pop(k):
            future.result()
        copy(k, sizes[k], positions[k])
        if cuda:
            events[k % FLOOR_BUFFERS] = stream.record_event()
        nxt = k + FLOOR_BUFFERS
        if nxt < len(batches):
            futures[nxt] = read(nxt, events[k % FLOOR_BUFFERS])
    sync()
    _barrier()
    result["floor_s"] = time.perf_counter() - t0
    pool.shutdown()
    for fd in fds.values():
        os.close(fd)
    return result


def phase_zoo(args: argparse.Namespace) -> dict[str, Any]:
    """Build on the device without init, then ``load_hf_weights`` (module docstring)."""
    import torch

    import mcore_zoo
    import mcore_zoo.distributed  # imported by the first load otherwise
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.weights import staging
    from mcore_zoo.weights.io import HFCheckpoint

    if args.ring:  # the staging ring's shape for this load: BUFFERSxMIB[/IN_FLIGHT][:rREAD][:tTHREADS][:bSHARE][:sUS][:x|:c][:v][:o]
        spec, *options = args.ring[0].lower().split(":")
        if spec != "default":
            shape, _, in_flight = spec.partition("/")
            count, mib = (int(v) for v in shape.split("x"))
            staging.BUFFERS, staging.BUFFER_BYTES = count, mib << 20
            staging.IN_FLIGHT_BUFFERS = int(in_flight) if in_flight else staging.IN_FLIGHT_BUFFERS
        for option in options:
            if option.startswith("r"):  # the ring's read threads
                staging.READ_THREADS = int(option[1:])
            elif option.startswith("t"):  # torch's thread count in the loading process
                torch.set_num_threads(int(option[1:]))
            elif option.startswith("b"):  # a batch of reads holds at most 1 / SHARE of a buffer
                staging.BATCH_SHARE = int(option[1:])
            elif option == "x":  # regions copied by their bytes with cudaMemcpyAsync (the default since 2026-11-27)
                staging.RAW_COPIES = True
            elif option == "c":  # every region copied through torch (Tensor.copy_; the default before)
                staging.RAW_COPIES = False
            elif option.startswith("s"):  # the interpreter's switch interval in us during the load process
                sys.setswitchinterval(int(option[1:]) * 1e-6)  # (default 5000: a read thread waits up to 5 ms for the lock)
            elif option == "o":  # the other source tree's load (LOAD_GPU_BASE_SRC, set by the orchestrator)
                pass
            elif option == "v":  # read views made in the loading loop, between reads (the load before 2026-11-28)
                import mcore_zoo.distributed.load as job_load
                from mcore_zoo.weights import load as weights_load

                job_load.rule_views = lambda *args: weights_load._MAKE_VIEWS  # read_rule_into then makes them
            else:
                raise SystemExit(f"unknown ring option {option!r} in {args.ring[0]!r}")

    rank, world, local = _rank()
    if args.device == "cuda":
        torch.cuda.set_device(local)
    ensure_model_parallel(Parallelism(tp=world) if args.parallel == "tp" else Parallelism(ep=world))
    backend = args.backend or ("te" if args.device == "cuda" else "local")
    _barrier()
    t0 = time.perf_counter()
    try:
        provider = mcore_zoo.model_provider(args.ckpt, backend=backend, params_dtype=torch.bfloat16,
                                            perform_initialization=False)  # fmt: skip
        model = provider(pre_process=True, post_process=True)
    except Exception as exc:  # Transformer Engine missing or refusing: the local backend
        if backend == "local":
            raise
        print(f"backend {backend} failed ({type(exc).__name__}: {exc}); building with local", flush=True)
        backend = "local"
        provider = mcore_zoo.model_provider(args.ckpt, backend=backend, params_dtype=torch.bfloat16,
                                            perform_initialization=False)  # fmt: skip
        model = provider(pre_process=True, post_process=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    _barrier()
    build_s = time.perf_counter() - t0
    params = list(model.parameters())
    devices = sorted({str(p.device) for p in params})
    shard = sum(p.numel() * p.element_size() for p in params)
    ring_bytes = staging.BUFFERS * staging.BUFFER_BYTES
    _barrier()
    rss = _rss()
    from first_load import Collections  # bench/: the cyclic collector's runs inside the load

    with Collections() as collections:
        t0, main_cpu0, cpu0 = time.perf_counter(), time.thread_time(), time.process_time()
        replicas = "read" if args.parallel == "ep" else "broadcast"  # EP: every rank reads its share, as the floor
        if args.breakdown == "first":  # the timed load itself under the timers (load_s includes them)
            reports: list[Any] = []
            first_breakdown = timed_load(lambda: reports.append(mcore_zoo.load_hf_weights(model, args.ckpt, replicas=replicas)),
                                         first=True)  # fmt: skip
            report = reports[0]
        else:
            report = mcore_zoo.load_hf_weights(model, args.ckpt, replicas=replicas)
        main_cpu_s, cpu_s = time.thread_time() - main_cpu0, time.process_time() - cpu0  # before the barrier's wait
    _barrier()
    load_s = time.perf_counter() - t0
    load_gc = collections.summary()
    above = rss["peak"]() - rss["before"]
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned = {}
    if args.device == "cuda" and host_stats is not None:  # torch's pinned-memory cache (the ring)
        try:
            pinned = {k: v for k, v in host_stats().items() if "bytes" in k and isinstance(v, int)}
        except RuntimeError as exc:
            pinned = {"error": str(exc)}
    result = {
        "rank": rank, "backend": backend, "devices": devices, "build_s": build_s, "load_s": load_s,
        "bytes": report.bytes_read, "parameters_bytes": shard, "peak_rss_above_start": above,
        "rss_peak_reset": rss["reset"], "rss_before": rss["before"], "staging_ring_bytes": ring_bytes,
        "staging_buffer_bytes": staging.BUFFER_BYTES, "torch_threads": torch.get_num_threads(), "replicas": replicas,
        "pinned_host_memory": pinned, "load_main_thread_cpu_s": main_cpu_s, "load_process_cpu_s": cpu_s,
        "load_gc": load_gc, "mcore_zoo_source": str(Path(mcore_zoo.__file__).resolve().parent),
    }  # fmt: skip
    if args.profile:  # one more load under cProfile (after the timed one): where the host time goes
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        mcore_zoo.load_hf_weights(model, args.ckpt, replicas=replicas)
        profiler.disable()
        result["profiled_load_s"] = time.perf_counter() - t0
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)
        result["profile"] = text.getvalue()
    if args.breakdown == "first":
        result["breakdown"] = dict(first_breakdown, of="the timed load (the process's first)")
    elif args.breakdown:
        result["breakdown"] = dict(timed_load(lambda: mcore_zoo.load_hf_weights(model, args.ckpt, replicas=replicas)),
                                   of="a second load, after the timed one")  # fmt: skip
    if args.verify:  # bitwise against the mapping path (the staging ring refusing every destination)
        loaded = [p.detach().clone() for p in params]
        mapping = staging.MappingPath()
        t0 = time.perf_counter()
        with HFCheckpoint(args.ckpt, staging=mapping) as ckpt:
            mcore_zoo.load_hf_weights(model, ckpt, replicas=replicas)
        _barrier()
        result["mapping_path_load_s"] = time.perf_counter() - t0
        same = all(torch.equal(a.view(torch.uint8), p.detach().view(torch.uint8)) for a, p in zip(loaded, params))
        result["bitwise_equal_to_mapping_path"] = same
        del loaded
    return result


#: ``(module, owner, attribute, label)``: what :func:`timed_load` times on the main thread
TIMED = (
    ("mcore_zoo.weights.io", "HFCheckpoint", "read_into", "checkpoint.read_into"),
    ("mcore_zoo.weights.staging", "StagingRing", "layout", "ring.layout"),
    ("mcore_zoo.weights.staging", "StagingRing", "read", "ring.read"),
    ("mcore_zoo.weights.staging", "StagingRing", "_take", "ring.take"),
    ("mcore_zoo.weights.staging", "StagingRing", "_queue", "ring.queue"),
    ("mcore_zoo.weights.staging", "StagingRing", "_submit", "ring.submit"),
    ("mcore_zoo.weights.staging", "StagingRing", "_copy_oldest", "ring.copy_oldest"),
    ("mcore_zoo.weights.staging", "StagingRing", "_copy", "ring.copy (dispatch)"),
    ("mcore_zoo.weights.staging", "StagingRing", "wait", "ring.wait"),
    ("mcore_zoo.weights.staging", "StagingRing", "finish", "ring.finish"),
    ("mcore_zoo.weights.pread", "ReadPool", "submit", "pool.submit"),
    ("concurrent.futures", "Future", "exception", "wait: read futures"),
    ("torch.cuda", "Event", "synchronize", "wait: CUDA events"),
    ("torch.cuda", "Stream", "synchronize", "wait: side stream"),
)
#: ``--breakdown first`` also times the steps a load takes once (owner ``None``: a function of the
#: module, as the loading module calls it)
TIMED_FIRST = (
    ("mcore_zoo.distributed.load", None, "open_hf_checkpoint", "open checkpoint (headers)"),
    ("mcore_zoo.handle", "ModelHandle", "rule_steps", "bind rules (rule_steps)"),
    ("mcore_zoo.distributed.load", None, "plan_load", "plan_load (checks)"),
    ("mcore_zoo.distributed.load", None, "rule_views", "rule_views"),
    ("mcore_zoo.weights.staging", "StagingRing", "_start", "ring.start (stream, first buffer)"),
    ("mcore_zoo.weights.staging", "StagingRing", "_allocate", "ring.allocate (pinned buffer)"),
)


def timed_load(load: Any, first: bool = False) -> dict[str, Any]:
    """Run ``load()`` with wall-clock timers around :data:`TIMED` (and :data:`TIMED_FIRST` when
    ``first``: the process's first load, which binds the rules and allocates the ring) (main thread only; other
    threads' calls run untimed): per label its calls, inclusive and exclusive seconds (exclusive:
    less the timed calls inside it); ``outside`` is the load's time in none of them (the weight
    map's own Python: rules, views, checks). The wrappers cost about a microsecond per call."""
    import importlib
    import threading

    main = threading.get_ident()
    stats: dict[str, list[float]] = {}
    stack: list[float] = []
    saved = []

    def wrap(owner: Any, attribute: str, label: str) -> None:
        original = getattr(owner, attribute)
        saved.append((owner, attribute, original))
        entry = stats.setdefault(label, [0, 0.0, 0.0])

        def timed(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != main:
                return original(*a, **k)
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = stack.pop()
                entry[0] += 1
                entry[1] += dt
                entry[2] += dt - inner
                if stack:
                    stack[-1] += dt

        setattr(owner, attribute, timed)

    for module, owner, attribute, label in TIMED + (TIMED_FIRST if first else ()):
        target = importlib.import_module(module)
        wrap(target if owner is None else getattr(target, owner), attribute, label)
    try:
        stack.append(0.0)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        load()
        total, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        timed_s = stack.pop()
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)
    calls = {label: {"calls": int(n), "inclusive_s": inc, "exclusive_s": exc} for label, (n, inc, exc) in stats.items() if n}
    return {"load_s": total, "main_thread_cpu_s": cpu, "outside_s": total - timed_s, "timed": calls}


# ---------------------------------------------------------------------------- the rounds
def _launch(args: argparse.Namespace, phase: str, world: int, tag: str, parallel: str = "tp",
            ring: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    """Run ``phase`` in fresh process(es); its per-rank results, or the failure."""
    out = Path(args.out)
    result_file = out / "raw" / f"{tag}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    worker = [str(HERE / "load_gpu.py"), "--phase", phase, "--ckpt", args.ckpt, "--device", args.device,
              "--result", str(result_file), "--parallel", parallel]  # fmt: skip
    if args.threads:
        worker += ["--threads", str(args.threads)]
    if args.backend:
        worker += ["--backend", args.backend]
    # the first ring's loads, and those that set the copies' kind (":x" raw, ":c" through torch) or where
    # the read views are made (":v"), which no earlier ring's check may cover
    # (":o", the other source tree's load, too)
    options = ring.lower().split(":")[1:] if ring is not None else []
    copies = bool({"x", "c", "v", "o"} & set(options))
    if args.verify_now and (ring == getattr(args, "rings", [None])[0] or copies):
        worker += ["--verify-this"]
    if ring:
        worker += ["--ring", ring]
    if args.profile_now and phase == "zoo":  # the first round only
        worker += ["--profile"]
    if args.breakdown_now and phase == "zoo":
        worker += ["--breakdown", args.breakdown]
    env = dict(os.environ)
    if "o" in options:  # the load of another source tree (its src/ first on the path), measured in the same run
        base = os.environ.get("LOAD_GPU_BASE_SRC")
        if not base:
            raise SystemExit(f"ring {ring!r}: ':o' needs LOAD_GPU_BASE_SRC (the other tree's src directory)")
        env["PYTHONPATH"] = os.pathsep.join([base, *filter(None, [env.get("PYTHONPATH")])])  # no empty entry (the cwd)
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // world)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *worker]
    else:
        cmd = [sys.executable, *worker]
    t0 = time.perf_counter()
    with open(out / "logs" / f"{tag}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout,
                                check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    ranks = []
    if result_file.is_file():
        ranks = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
    ok = rc == 0 and len(ranks) == world
    print(f"{tag}: rc {rc}, {wall:.1f} s wall, {len(ranks)}/{world} rank results", flush=True)
    return {"phase": phase, "world": world, "ok": ok, "rc": rc, "process_wall_s": wall,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}  # fmt: skip


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _zoo_tag(name: str, ring: Optional[str], rings: list[Optional[str]]) -> str:
    """A zoo measurement's key: ``zoo-LAYOUT``, with ``@RING`` when several rings are measured."""
    return f"zoo-{name}" if len(rings) == 1 else f"zoo-{name}@{ring or 'default'}"


def summarise(rounds: list[dict[str, Any]], layouts: list[tuple[str, int, str]],
              rings: Optional[list[Optional[str]]] = None) -> dict[str, Any]:  # fmt: skip
    """Per layout (and per ring when several: ``LAYOUT ring RING``) medians and spreads over the
    rounds; the floor of a layout is shared by its rings."""
    rings = rings or [None]
    summary: dict[str, Any] = {}
    for (name, world, _), ring in [(layout, ring) for layout in layouts for ring in rings]:
        floor_t, read_t, copy_t, load_t, build_t, ratio, gbps, floor_gbps, rss = [], [], [], [], [], [], [], [], []
        verified, main_cpu = [], []
        zoo_tag = _zoo_tag(name, ring, rings)
        for r in rounds:
            floor, zoo = r.get(f"floor-{name}"), r.get(zoo_tag)
            if floor and floor["ok"]:
                floor_t.append(max(x["floor_s"] for x in floor["ranks"]))
                read_t.append(max(x["read_s"] for x in floor["ranks"]))
                copy_t.append(max(x["copy_s"] for x in floor["ranks"]))
                floor_gbps.append(sum(x["bytes"] for x in floor["ranks"]) / floor_t[-1] / 1e9)
            if zoo and zoo["ok"]:
                load_t.append(max(x["load_s"] for x in zoo["ranks"]))
                build_t.append(max(x["build_s"] for x in zoo["ranks"]))
                gbps.append(sum(x["bytes"] for x in zoo["ranks"]) / load_t[-1] / 1e9)
                rss += [x["peak_rss_above_start"] for x in zoo["ranks"]]
                main_cpu.append(max(x.get("load_main_thread_cpu_s", math.nan) for x in zoo["ranks"]))
                verified += [x["bitwise_equal_to_mapping_path"] for x in zoo["ranks"] if "bitwise_equal_to_mapping_path" in x]
            if floor and floor["ok"] and zoo and zoo["ok"]:
                ratio.append(floor_t[-1] / load_t[-1])
        zoo_ranks = next((r[zoo_tag]["ranks"] for r in rounds if r.get(zoo_tag, {}).get("ok")), [])
        floor_ranks = next((r[f"floor-{name}"]["ranks"] for r in rounds if r.get(f"floor-{name}", {}).get("ok")), [])
        summary[name if len(rings) == 1 else f"{name} ring {ring or 'default'}"] = {
            "world": world, "ring": ring or "default", "floor_s": _spread(floor_t), "read_s": _spread(read_t), "copy_s": _spread(copy_t),
            "load_s": _spread(load_t), "build_s": _spread(build_t), "load_main_thread_cpu_s": _spread(main_cpu),
            "floor_over_load": _spread(ratio),
            "load_gbps": _spread(gbps), "floor_gbps": _spread(floor_gbps),
            "peak_rss_above_start_mb": _spread([x / 1e6 for x in rss]),
            "bytes_per_rank": [x["bytes"] for x in zoo_ranks], "floor_bytes_per_rank": [x["bytes"] for x in floor_ranks],
            "parameters_bytes_per_rank": [x["parameters_bytes"] for x in zoo_ranks],
            "staging_ring_mb": zoo_ranks[0]["staging_ring_bytes"] / 1e6 if zoo_ranks else None,
            "staging_buffer_mb": zoo_ranks[0]["staging_buffer_bytes"] / 1e6 if zoo_ranks else None,
            "backend": zoo_ranks[0]["backend"] if zoo_ranks else None,
            "bitwise_equal_to_mapping_path": all(verified) if verified else None,
        }  # fmt: skip
    return summary


def _fmt(spread: dict[str, Any], unit: str = "", digits: int = 2) -> str:
    if spread["median"] is None:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(spread['median'])}{unit} ({f.format(spread['min'])} - {f.format(spread['max'])})"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Loading onto the GPU ({m['date']})", "",
        f"{m['gpu']} x {m['gpus']}, {m['cpu']} ({m['logical_cpus']} logical CPUs), {m['memory_gib']} GiB; "
        f"torch {m['torch']}, megatron-core {m['megatron_core']}. Checkpoint: {result['checkpoint']['bytes'] / 1e9:.2f} GB "
        f"({result['checkpoint']['shape']}), {result['rounds']} alternated rounds, each measurement a fresh process.", "",
        "Median (min - max) over the rounds. Ratio: floor time / load time per round (1.00: the load runs at the floor).", "",
        "| layout | backend | floor: read + copy s | read alone s | copy alone s | load s | build s | load GB/s | floor GB/s | floor / load | peak host RSS above start MB (per rank) | one staging buffer MB | staging ring MB | bitwise = mapping path |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for name, s in result["summary"].items():
        lines.append(
            f"| {name} | {s['backend']} | {_fmt(s['floor_s'])} | {_fmt(s['read_s'])} | {_fmt(s['copy_s'])} | "
            f"{_fmt(s['load_s'])} | {_fmt(s['build_s'])} | {_fmt(s['load_gbps'], digits=1)} | {_fmt(s['floor_gbps'], digits=1)} | "
            f"**{_fmt(s['floor_over_load'])}** | {_fmt(s['peak_rss_above_start_mb'], digits=0)} | "
            f"{s['staging_buffer_mb'] or 0:.0f} | {s['staging_ring_mb'] or 0:.0f} | {s['bitwise_equal_to_mapping_path']} |"
        )  # fmt: skip
    lines += ["", "Bytes per rank (load / floor): " + "; ".join(
        f"{n}: {[round(b / 1e9, 3) for b in s['bytes_per_rank']]} / {[round(b / 1e9, 3) for b in s['floor_bytes_per_rank']]} GB"
        for n, s in result["summary"].items())]  # fmt: skip
    for tag, r in result["raw"][0].items():  # --breakdown: the first round's extra timed loads
        for rank in r["ranks"]:
            b = rank.get("breakdown")
            if not b:
                continue
            parts = sorted(b["timed"].items(), key=lambda kv: -kv[1]["exclusive_s"])
            lines += ["", f"Main thread of {tag}, rank {rank['rank']} ({b.get('of', 'a second load')}: {b['load_s']:.3f} s, main-thread CPU "
                      f"{b['main_thread_cpu_s']:.3f} s): outside the timed calls {b['outside_s']:.3f} s; exclusive s (calls): "
                      + ", ".join(f"{label} {v['exclusive_s']:.3f} ({v['calls']})" for label, v in parts)]  # fmt: skip
    failed = [f"{tag} (rc {r['rc']})" for rnd in result["raw"] for tag, r in rnd.items() if not r["ok"]]
    if failed:
        lines += ["", "Failed: " + ", ".join(failed) + " (logs under logs/)."]
    return "\n".join(lines) + "\n"


def machine(device: str) -> dict[str, Any]:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0.0)
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001
        mcore = "?"
    cuda = device == "cuda" and torch.cuda.is_available()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "logical_cpus": os.cpu_count(),
            "memory_gib": round(mem, 1), "kernel": platform.release(), "torch": torch.__version__,
            "megatron_core": mcore, "gpu": torch.cuda.get_device_name(0) if cuda else "none",
            "gpus": torch.cuda.device_count() if cuda else 0}  # fmt: skip


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cfg = config(args.tiny, args.shape, args.layers)
    ckpt = Path(args.ckpt)
    t0 = time.perf_counter()
    write = [sys.executable, str(HERE / "load_gpu.py"), "--phase", "write", "--ckpt", str(ckpt), "--device", args.device,
             "--shape", args.shape] + (["--layers", str(args.layers)] if args.layers else [])  # fmt: skip
    with open(out / "logs" / "write.log", "w") as log:
        written = subprocess.run(write + (["--tiny"] if args.tiny else []), stdout=log, stderr=subprocess.STDOUT,
                                 check=False).returncode  # fmt: skip
    if written != 0 or not _complete(ckpt, cfg):
        print(f"writing the checkpoint failed (rc {written}); see {out / 'logs' / 'write.log'}", flush=True)
        return 1
    write_s = time.perf_counter() - t0
    warm_s = warm(ckpt)
    nbytes = sum(math.prod(s) * 2 for s in tensor_shapes(cfg).values())
    print(f"checkpoint {ckpt}: {nbytes / 1e9:.2f} GB (write step {write_s:.1f} s, warm read {warm_s:.1f} s)", flush=True)
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    one, two = SHAPES[args.shape][2]
    layouts = [one] + ([two] if args.tp2 and gpus >= 2 else [])
    rings: list[Optional[str]] = [None if ring == "default" else ring for ring in args.ring or ["default"]]
    args.rings = rings
    steps = [step for name, world, parallel in layouts
             for step in [(f"floor-{name}", "floor", world, parallel, None)]
             + [(_zoo_tag(name, ring, rings), "zoo", world, parallel, ring) for ring in rings]]  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        args.verify_now = args.verify and r == 0
        args.profile_now = args.profile and r == 0
        args.breakdown_now = args.breakdown and r == 0
        order = steps if r % 2 == 0 else steps[::-1]
        rounds.append({key: _launch(args, kind, world, f"r{r}-{key.replace('@', '-ring-').replace('/', '-').replace(':', '-')}", parallel, ring)
                       for key, kind, world, parallel, ring in order})  # fmt: skip
    result = {
        "machine": machine(args.device), "rounds": args.rounds,
        "checkpoint": {"path": str(ckpt), "bytes": nbytes, "shards": SHARDS, "tiny": args.tiny,
                       "shape": {"llama-8b": "Llama-3.1-8B", "qwen3-30b-a3b": f"Qwen3-30B-A3B, {cfg['num_hidden_layers']} layers"}[args.shape]
                                + (" (tiny)" if args.tiny else ""), "write_step_s": write_s, "warm_read_s": warm_s},
        "summary": summarise(rounds, layouts, rings), "raw": rounds, "rings": [ring or "default" for ring in rings],
    }  # fmt: skip
    (out / "load_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "load_gpu.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    return 0 if all(r["ok"] for rnd in rounds for r in rnd.values()) else 1


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="results directory (orchestrator)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (written when missing)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a few-MB Llama-shaped checkpoint (the CPU dry run)")
    p.add_argument("--no-tp2", dest="tp2", action="store_false", help="the one-GPU layout only (TP1 / EP1)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="the checkpoint's widths (module docstring)")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the shape's: 32 / 4)")
    p.add_argument("--parallel", choices=("tp", "ep"), default="tp", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help="model backend (default: te on cuda, falling back to local)")
    p.add_argument("--threads", type=int, default=None,
                   help="floor read threads per rank (default: mcore_zoo.weights.staging.READ_THREADS, as the ring's)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the first round's bitwise check")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per measurement process")
    p.add_argument("--ring", action="append", default=None,
                   help="the load's staging ring as BUFFERSxMIB[/IN_FLIGHT][:rREAD][:tTHREADS][:bSHARE][:sUS][:x|:c][:v][:o] (default:"
                        " mcore_zoo.weights.staging's; IN_FLIGHT: buffers of reads in flight besides the newest"
                        " region's; rREAD: the ring's read threads; tTHREADS: torch's thread count in the loading"
                        " process (before 2026-11-27's sixth run also the ring's read threads); bSHARE: a batch of reads holds at most"
                        " 1 / SHARE of a buffer; x: staging.RAW_COPIES on, regions copied by their bytes - the default since"
                        " 2026-11-27; c: RAW_COPIES off, every region copied through torch; v: read views made in"
                        " the loading loop between reads, as before 2026-11-28; sUS: sys.setswitchinterval(US"
                        " microseconds) in the loading process; o: the load of the source tree whose src directory"
                        " LOAD_GPU_BASE_SRC names, e.g. an earlier commit's, for a same-run comparison); repeatable: each"
                        " ring's load is measured in every round against"
                        " the same floor ('default': the package's, also with options: 'default:t16')")
    p.add_argument("--profile", action="store_true",
                   help="the first round's zoo processes load once more under cProfile (after the timed load); the"
                        " statistics go into the raw results ('profile')")
    p.add_argument("--breakdown", nargs="?", const="again", choices=("again", "first"), default=None,
                   help="timers around the load's steps on the main thread (timed_load), in the first round's zoo"
                        " processes, into the raw results ('breakdown'): 'again' (the default) times one more load"
                        " after the timed one; 'first' times the timed load itself, with the steps only a first load"
                        " takes (binding the rules, the checks, the ring's pinned buffers): its load_s then includes"
                        " the timers, about a microsecond per call")
    p.add_argument("--phase", choices=("write", "floor", "zoo"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--verify-this", dest="verify_rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ckpt is None:
        base = Path(os.environ.get("TMPDIR", "/tmp")) / "mcore-zoo-load-gpu"
        name = {"llama-8b": "llama-3.1-8b", "qwen3-30b-a3b": f"qwen3-30b-a3b-{args.layers or 4}l"}[args.shape]
        args.ckpt = str(base / (name + ("-tiny" if args.tiny else "")))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.phase is None:
        if not args.out:
            raise SystemExit("--out is required")
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device (the CPU dry run: --device cpu --tiny)")
        return orchestrate(args)
    if args.phase == "write":
        print(json.dumps(write_checkpoint(Path(args.ckpt), config(args.tiny, args.shape, args.layers), args.device)), flush=True)
        return 0
    args.verify = args.verify_rank
    result = (phase_floor if args.phase == "floor" else phase_zoo)(args)
    print(json.dumps(result), flush=True)
    with open(args.result, "a") as f:  # one line per rank (appends of one short line do not interleave)
        f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
