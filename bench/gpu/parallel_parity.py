"""Parallel-layout parity: TP / PP / CP (and more on 4 GPUs) against the same model on one GPU.

Run from the repository root, with ``PYTHONPATH=src``::

    torchrun --nproc_per_node 2 bench/gpu/parallel_parity.py --out out/parallel-2gpu
    torchrun --nproc_per_node 4 bench/gpu/parallel_parity.py --out out/parallel-4gpu

Every rank first runs the whole model alone (the one-GPU reference; each rank is its own
data-parallel replica), then each layout in turn: build (``te`` backend, bf16, default numerics),
load the HF checkpoint with ``mcore_zoo.load_hf_weights`` (sharded reads), run the packed THD
forward (``mcore_zoo.packed_forward``; pipeline / context parallel go through
``mcore_zoo.distributed.forward``) and compare logits and next-token log-probabilities with the
reference. The model is a random Llama (hidden 1024, 8 layers, GQA 16/4, sharp attention) written
by rank 0 with ``mcore_zoo.parity.reference.write_reference_checkpoint``. Failures are recorded per
layout (a failure on some ranks only can stall the job until the 10-minute process-group timeout).

Per layout, besides the numbers: the export (``mcore_zoo.iter_hf_weights`` gathered to rank 0)
against the checkpoint, bitwise; and what every rank read - bytes read (and, with data-parallel
replicas, received by broadcast), and for an MoE model the routed-expert tensors it read: their
share of all expert bytes (1 / (EP x expert-TP x PP) when a rank reads only its own experts) and
any expert outside its own EP range.
Writes ``parallel_parity.json`` and ``parallel_parity.md`` to ``--out``; exits 1 if any layout
failed.

On a machine without GPUs, ``--device cpu`` runs the same logic on gloo with the ``portable``
backend in fp32 (``--tiny`` shrinks the model): this is how the script is tested.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

LAYOUTS = {
    # name: (tp, pp, vpp, cp, sequence_parallel, ep)
    "tp2": (2, 1, None, 1, False, 1),
    "tp2-sp": (2, 1, None, 1, True, 1),
    "pp2": (1, 2, None, 1, False, 1),
    "cp2": (1, 1, None, 2, False, 1),
    "tp4": (4, 1, None, 1, False, 1),
    "tp2-pp2": (2, 2, None, 1, False, 1),
    "tp2-cp2": (2, 1, None, 2, True, 1),
    "pp2-vpp2": (1, 2, 2, 1, False, 1),
    "pp2-cp2": (1, 2, None, 2, False, 1),
    # expert parallelism (MoE models: --arch of an MoE family, or --config of one)
    "ep2": (1, 1, None, 1, False, 2),
    "ep4": (1, 1, None, 1, False, 4),
    "tp2-sp-ep2": (2, 1, None, 1, True, 2),
    "pp2-ep2": (1, 2, None, 1, False, 2),
}
DEFAULT_LAYOUTS = {
    2: ["tp2", "tp2-sp", "pp2", "cp2"],
    4: ["tp2", "tp2-sp", "pp2", "cp2", "tp4", "tp2-pp2", "tp2-cp2", "pp2-vpp2", "pp2-cp2"],
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for parallel_parity.json / .md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="default: te on cuda, portable on cpu")
    p.add_argument("--numerics", default=None, help="default: 'default' on cuda, 'hf-exact' on cpu")
    p.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE",
                   help="override one knob of the numerics profile (e.g. attention=eager); repeatable")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--arch", default="LlamaForCausalLM")
    p.add_argument("--layouts", default=None, help="comma-separated subset of: " + ", ".join(LAYOUTS))
    p.add_argument("--lengths", default="100,512,37,300", help="packed sequence lengths")
    p.add_argument("--tiny", action="store_true", help="hidden 64, 4 layers, vocab 256 (CPU test runs)")
    p.add_argument("--config", default=None, help="a published config.json: its full width, --layers layers")
    p.add_argument("--layers", type=int, default=2, help="with --config: decoder layers kept (default 2)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: override a config field (value parsed as JSON), e.g. n_routed_experts=64")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    import mcore_zoo
    from mcore_zoo.parity.inputs import RANDOM_WEIGHTS_CANNOT_CARRY, parse_set

    if args.config:
        config = json.loads(Path(args.config).read_text())
        config.update(num_hidden_layers=args.layers)
        if "first_k_dense_replace" in config:  # keep at least one MoE layer
            config["first_k_dense_replace"] = min(config["first_k_dense_replace"], args.layers - 1)
        # random weights: no FP8 blocks, no MTP layer (fields only the configs that have them set)
        config.update({k: v for k, v in RANDOM_WEIGHTS_CANNOT_CARRY.items() if config.get(k)})
        config.update(parse_set(args.set))
        args.arch = config["architectures"][0]
        return config
    config = mcore_zoo.lookup(args.arch).example_config()
    if args.tiny:
        config.update(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, head_dim=8)  # fmt: skip
    else:
        config.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, head_dim=64, max_position_embeddings=4096)  # fmt: skip
    return config


def init(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))


def write_checkpoint(args: argparse.Namespace, dtype: torch.dtype) -> str:
    """Rank 0 writes the random reference checkpoint into a temporary directory; all ranks get it."""
    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    path = [None]
    if dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="mcore-zoo-parallel-parity-")
        write_reference_checkpoint(mcore_zoo.lookup(args.arch), model_config(args), path[0], seed=args.seed, dtype=dtype)
    dist.broadcast_object_list(path, src=0)
    dist.barrier()
    return path[0]


#: a routed expert's tensor in an HF checkpoint (Qwen-MoE and DeepSeek ``mlp.experts.E.``, Mixtral
#: ``block_sparse_moe.experts.E.``); group 1 is the expert index
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.")


def counting_checkpoint(path: str) -> Any:
    """The checkpoint at ``path`` as an ``HFCheckpoint`` that records, per tensor name, the bytes
    each read returned (``.read_bytes``); ``load_hf_weights`` takes it in place of the path."""
    from mcore_zoo.weights.io import HFCheckpoint

    class CountingCheckpoint(HFCheckpoint):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.read_bytes: dict[str, int] = {}

        def read(self, name: str, **kw: Any) -> torch.Tensor:
            tensor = super().read(name, **kw)
            self.read_bytes[name] = self.read_bytes.get(name, 0) + tensor.numel() * tensor.element_size()
            return tensor

        def read_into(self, name: str, out: torch.Tensor, **kw: Any) -> int:
            n = super().read_into(name, out, **kw)
            self.read_bytes[name] = self.read_bytes.get(name, 0) + n
            return n

    return CountingCheckpoint(path)


def expert_reads(read_bytes: dict[str, int], ckpt: Any, num_experts: int) -> dict[str, Any]:
    """This rank's routed-expert reads: bytes, their share of all expert bytes in the checkpoint,
    and the expert indices read outside this rank's own EP range (experts ``[r * n / ep, (r + 1) * n
    / ep)`` on EP rank ``r``, Megatron-Core's assignment). Empty for a model without experts."""
    from megatron.core import parallel_state as ps

    total = sum(_nbytes(ckpt, name) for name in ckpt.keys() if EXPERT_TENSOR.search(name))
    if not total or not num_experts:
        return {}
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    own = range(ep_rank * num_experts // ep, (ep_rank + 1) * num_experts // ep)
    read = {name: n for name, n in read_bytes.items() if EXPERT_TENSOR.search(name)}
    experts = {int(EXPERT_TENSOR.search(name).group(1)) for name in read}  # type: ignore[union-attr]
    return {
        "ep_rank": ep_rank,
        "expert_bytes_read": sum(read.values()),
        "expert_share": sum(read.values()) / total,
        "experts_read": len(experts),
        "foreign_experts": sorted(e for e in experts if e not in own),
    }


def _nbytes(ckpt: Any, name: str) -> int:
    return math.prod(ckpt.shape(name)) * ckpt.dtype(name).itemsize


def export_check(model: Any, ckpt: Any) -> dict[str, Any]:
    """Every rank takes part; rank 0 compares the export gathered to it with the checkpoint, tensor
    by tensor, bitwise (dtype and bytes). Returns ``{"export_bitwise": bool, "export_mismatches":
    [...]}`` on rank 0 (names missing on either side, then differing tensors, "equal values" where
    only the dtype differs; at most 8), ``{}`` elsewhere."""
    import mcore_zoo

    rank0 = dist.get_rank() == 0
    seen: set[str] = set()
    differ: list[str] = []
    for name, tensor in mcore_zoo.iter_hf_weights(model, ranks=[0]):
        if not rank0:
            continue
        seen.add(name)
        if name not in ckpt:
            continue
        source = ckpt.read(name)
        got = tensor.cpu()
        if got.dtype == source.dtype and got.shape == source.shape and torch.equal(got, source):
            continue
        same_values = got.shape == source.shape and torch.equal(got.to(source.dtype), source)
        differ.append(f"{name} ({got.dtype} {tuple(got.shape)} vs {source.dtype} {tuple(source.shape)}"
                      + (", equal values" if same_values else "") + ")")  # fmt: skip
    if not rank0:
        return {}
    names = ckpt.keys()
    missing = [f"{n} (not exported)" for n in sorted(names - seen)] + [f"{n} (not in the checkpoint)" for n in sorted(seen - names)]
    mismatches = missing + differ
    return {"export_bitwise": not mismatches, "export_mismatches": mismatches[:8], "export_mismatch_count": len(mismatches)}


def run_layout(args: argparse.Namespace, ckpt: str, parallel: Any, dtype: torch.dtype, seqs: list[torch.Tensor],
               *, checks: bool = False) -> dict[str, Any]:  # fmt: skip
    """Build, load and run one layout on every rank; returns logits/logprobs (CPU, fp32), timings and
    this rank's reads. ``checks``: also the export against the checkpoint (:func:`export_check`)
    and the expert reads (:func:`expert_reads`)."""
    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel(parallel)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    source = counting_checkpoint(ckpt)
    try:
        t0 = time.perf_counter()
        model = mcore_zoo.build_model(ckpt, backend=args.backend, numerics=args.numerics, params_dtype=dtype, parallel=parallel)
        report = mcore_zoo.load_hf_weights(model, source)
        sync()
        t1 = time.perf_counter()
        for chunk in model if isinstance(model, list) else [model]:
            chunk.eval()
        with torch.no_grad():
            out = mcore_zoo.packed_forward(model, [s.to(args.device) for s in seqs])
        sync()
        t2 = time.perf_counter()
        result = {
            "logits": [l.float().cpu() for l in out.logits],
            "logprobs": [l.float().cpu() for l in out.logprobs],
            "load_s": t1 - t0,
            "forward_s": t2 - t1,
            "reads": {"bytes_read": report.bytes_read, "bytes_received": report.bytes_received},
        }
        if checks:
            result["reads"].update(expert_reads(source.read_bytes, source, _num_experts(args)))
            del out
            result.update(export_check(model, source))
        return result
    finally:
        source.close()


def _num_experts(args: argparse.Namespace) -> int:
    m = model_config(args)
    return int(m.get("num_experts") or m.get("num_local_experts") or m.get("n_routed_experts") or 0)


def compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    dlogit = max((a - b).abs().max().item() for a, b in zip(got["logits"], ref["logits"]))
    dlp = torch.cat([(a - b).abs() for a, b in zip(got["logprobs"], ref["logprobs"])])
    top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(got["logits"], ref["logits"])]).float().mean().item()
    scale = max(b.abs().max().item() for b in ref["logits"])
    return {"max_abs_dlogit": dlogit, "max_abs_logit": scale, "mean_abs_dlogp": dlp.mean().item(),
            "max_abs_dlogp": dlp.max().item(), "top1_agreement": top1}  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.backend = args.backend or ("te" if args.device == "cuda" else "portable")
    args.numerics = args.numerics or ("default" if args.device == "cuda" else "hf-exact")
    if args.knob:
        from mcore_zoo.numerics.profiles import get_profile
        from mcore_zoo.parity.inputs import parse_set

        args.numerics = get_profile(args.numerics).with_knobs(**parse_set(args.knob))
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}[
        args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    ]
    init(args)
    from megatron.core import parallel_state as ps

    import mcore_zoo
    from mcore_zoo.placement import Parallelism

    world, rank = dist.get_world_size(), dist.get_rank()
    names = args.layouts.split(",") if args.layouts else DEFAULT_LAYOUTS.get(world, DEFAULT_LAYOUTS[2])
    config = model_config(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    seqs = [torch.randint(0, config["vocab_size"], (int(n),), generator=gen) for n in args.lengths.split(",")]
    ckpt = write_checkpoint(args, dtype)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "world_size": world,
        "backend": args.backend,
        "numerics": getattr(args.numerics, "name", args.numerics),
        "dtype": str(dtype).replace("torch.", ""),
        "model": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")},
        "architecture": args.arch,
        "lengths": [int(s.numel()) for s in seqs],
        "versions": {"torch": torch.__version__, "megatron-core": _version("megatron-core"), "transformer-engine": _version("transformer-engine"), "mcore-zoo": mcore_zoo.__version__},
        "layouts": {},
    }
    reference = None
    try:
        reference = run_layout(args, ckpt, Parallelism(), dtype, seqs)
        results["reference"] = {"load_s": reference["load_s"], "forward_s": reference["forward_s"]}
    except Exception as exc:  # nothing to compare with: record and stop
        results["reference"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        ps.destroy_model_parallel()
        _release_memory(args)
    for name in names if reference is not None else []:
        tp, pp, vpp, cp, sp, ep = LAYOUTS[name]
        entry: dict[str, Any] = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "sequence_parallel": sp, "ep": ep}
        if world % (tp * pp * cp):
            entry["error"] = f"world size {world} does not fit"
        else:
            try:
                got = run_layout(args, ckpt, Parallelism(tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp, ep=ep), dtype, seqs,
                                 checks=True)  # fmt: skip
                entry.update(compare(got, reference), load_s=got["load_s"], forward_s=got["forward_s"], reads=got["reads"])
                entry.update({k: v for k, v in got.items() if k.startswith("export_")})
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()
            finally:
                if ps.model_parallel_is_initialized():
                    ps.destroy_model_parallel()
                _release_memory(args)
        gathered = [None] * world
        dist.all_gather_object(gathered, entry)
        results["layouts"][name] = _merge(gathered)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "parallel_parity.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "parallel_parity.md").write_text(markdown(results))
        print(markdown(results))
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    failed = reference is None or any("error" in e for e in results["layouts"].values())
    return 1 if failed else 0


def _release_memory(args: argparse.Namespace) -> None:
    """Free the previous layout's model before the next one is built."""
    import gc

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry per layout: rank 0's numbers, the worst over ranks, every rank's error."""
    merged = dict(per_rank[0])
    merged.pop("reads", None)
    if all("reads" in e for e in per_rank):
        merged["reads_per_rank"] = [e["reads"] for e in per_rank]
    for key in ("max_abs_dlogit", "max_abs_dlogp", "mean_abs_dlogp"):
        values = [e[key] for e in per_rank if key in e]
        if values:
            merged[key] = max(values)
    errors = {str(r): e["error"] for r, e in enumerate(per_rank) if "error" in e}
    if errors:
        merged["error"] = errors
    return merged


def _version(dist_name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def markdown(results: dict[str, Any]) -> str:
    m = results["model"]
    lines = [
        f"# Parallel layouts vs one device ({results['world_size']} x {results['device']})",
        "",
        f"{results['architecture']} random weights: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers,"
        f" {m['num_attention_heads']}/{m['num_key_value_heads']} heads, vocab {m['vocab_size']};"
        f" backend `{results['backend']}`, numerics `{results['numerics']}`, {results['dtype']};"
        f" packed sequences of {results['lengths']} tokens. Versions: "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v),
        "",
    ]
    if "error" in results.get("reference", {}):
        return "\n".join(lines + [f"Reference run failed: `{results['reference']['error']}`", ""])
    scales = [e["max_abs_logit"] for e in results["layouts"].values() if "max_abs_logit" in e]
    if scales:
        lines += [f"Largest reference |logit|: {scales[0]:.3g}.", ""]
    lines += [
        "| layout | max abs dlogit | mean abs dlogp | max abs dlogp | top-1 agreement | load s | forward s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| 1 device (reference) | - | - | - | - | {results['reference']['load_s']:.2f} | {results['reference']['forward_s']:.3f} |",
    ]
    for name, e in results["layouts"].items():
        if "error" in e:
            first = next(iter(e["error"].values())) if isinstance(e["error"], dict) else e["error"]
            lines.append(f"| {name} | failed: `{str(first)[:120]}` | | | | | |")
            continue
        lines.append(
            f"| {name} | {e['max_abs_dlogit']:.3g} | {e['mean_abs_dlogp']:.3g} | {e['max_abs_dlogp']:.3g}"
            f" | {100 * e['top1_agreement']:.2f}% | {e['load_s']:.2f} | {e['forward_s']:.3f} |"
        )
    return "\n".join(lines + reads_table(results)) + "\n"


def reads_table(results: dict[str, Any]) -> list[str]:
    """The export check and every rank's reads, one row per layout that ran."""
    ran = {n: e for n, e in results["layouts"].items() if "reads_per_rank" in e}
    if not ran:
        return []
    moe = any("expert_share" in r for e in ran.values() for r in e["reads_per_rank"])
    lines = ["", "Export gathered to rank 0 vs the checkpoint (bitwise), and each rank's reads"
             + (" (routed experts: share of all expert bytes, experts outside the rank's EP range)" if moe else "")
             + ":", "",
             "| layout | export | GB read per rank | GB received per rank |" + (" expert share per rank | foreign experts |" if moe else ""),
             "| --- | --- | --- | --- |" + (" --- | --- |" if moe else "")]  # fmt: skip
    for name, e in ran.items():
        reads = e["reads_per_rank"]
        export = "bitwise" if e.get("export_bitwise") else f"{e.get('export_mismatch_count', '?')} differ: `{'; '.join(e.get('export_mismatches', []))[:160]}`"
        per_rank = lambda key, fmt: " / ".join(format(r.get(key, 0) / (1e9 if "bytes" in key else 1), fmt) for r in reads)  # noqa: E731
        row = f"| {name} | {export} | {per_rank('bytes_read', '.3g')} | {per_rank('bytes_received', '.3g')} |"
        if moe:
            foreign = sum(len(r.get("foreign_experts", [])) for r in reads)
            row += f" {per_rank('expert_share', '.3f')} | {foreign or 'none'} |"
        lines.append(row)
    return lines


if __name__ == "__main__":
    sys.exit(main())
