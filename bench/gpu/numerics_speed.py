"""What exactness costs in speed (GPU, bf16).

1. GEMM level: ``torch.matmul`` at LLM shapes, for several row counts ``M``, with cuBLAS defaults
   and with split-K disabled (``CUBLAS_WORKSPACE_CONFIG=:0:0``; measured in a child process since
   cuBLAS reads the variable once).
2. Model level: a Llama-8B-shaped stack (hidden 4096, FFN 14336, 32/8 heads, head_dim 128; a few
   layers) or, with ``--shape qwen3-30b-a3b``, Qwen3-30B-A3B's published widths (hidden 2048,
   32/4 heads of 128, 128 experts of 768, top-8; a few layers) - forward and forward+backward time
   and peak memory for the fast path (``te`` default) and the exact profiles, next to transformers
   eager / sdpa (its default experts implementation).

    PYTHONPATH=src python bench/gpu/numerics_speed.py --out OUT [--layers 4] [--shape qwen3-30b-a3b]

Writes ``OUT/numerics_speed.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (4096, 128256)]
ROWS = [37, 100, 512, 2048, 8192]


def gemm_times(repeat: int = 30) -> dict[str, float]:
    out = {}
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                x @ w.t()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                x @ w.t()
            end.record()
            torch.cuda.synchronize()
            out[f"{k}x{n}@M{m}"] = start.elapsed_time(end) / repeat
    return out


def gemm_child() -> None:
    print(json.dumps(gemm_times()))


def llama_config(layers: int) -> dict[str, Any]:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)  # fmt: skip


def qwen3_moe_config(layers: int) -> dict[str, Any]:
    """Qwen3-30B-A3B's published ``config.json`` fields, ``num_hidden_layers`` cut to ``layers``."""
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False,
                router_aux_loss_coef=0.001, output_router_logits=False)  # fmt: skip


#: ``--shape``: the model-level stack's config builder (layers -> HF config dict)
MODEL_SHAPES = {"llama-8b": llama_config, "qwen3-30b-a3b": qwen3_moe_config}


def time_step(fn: Any, backward: bool, repeat: int = 5) -> tuple[float, float]:
    def step() -> None:
        out = fn()
        if backward:
            out.float().mean().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeat):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1000, torch.cuda.max_memory_allocated() / 2**30


DEFAULT_VARIANTS = [
    "te/default=te:default",
    "te/training=te:training",
    "te/hf-exact=te:hf-exact",
    "local/hf-exact=local:hf-exact",
    "portable/hf-exact-sdpa=portable:hf-exact-sdpa",
    "portable/default (varlen)=portable:default",
]


def parse_variant(text: str) -> tuple[str, str, Any]:
    """``NAME=BACKEND:PROFILE[,KNOB=VALUE...]`` -> (name, backend, profile object)."""
    import mcore_zoo
    from mcore_zoo.parity.inputs import parse_set

    name, _, spec = text.partition("=")
    backend, _, rest = spec.partition(":")
    profile, *knobs = rest.split(",")
    built = mcore_zoo.get_profile(profile)
    if knobs:
        built = built.with_knobs(**parse_set(knobs))
    return name, backend, built


def model_times(layers: int, batch: int, seq: int, variant_specs: list[str], shape: str = "llama-8b",
                profile_dir: str | None = None, transformers_rows: bool = True) -> dict[str, Any]:  # fmt: skip
    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel()
    config = MODEL_SHAPES[shape](layers)
    ids = torch.randint(0, min(config["vocab_size"], 32000), (batch, seq), device="cuda")
    positions = torch.arange(seq, device="cuda").expand(batch, -1)
    results: dict[str, Any] = {}
    variants = [parse_variant(v) for v in variant_specs]
    for name, backend, profile in variants:
        gc.collect()  # the previous variant's model and graphs: freed before this one is measured
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() / 2**30
        try:
            model = mcore_zoo.build_model(config, backend=backend, numerics=profile, params_dtype=torch.bfloat16)
            entry = {"held_before_gib": held}  # allocated before the build: peaks include it
            fwd = lambda: model(ids, positions, None)  # noqa: E731
            with torch.no_grad():
                entry["bshd_forward_ms"], entry["bshd_forward_gib"] = time_step(fwd, False)
            entry["bshd_train_ms"], entry["bshd_train_gib"] = time_step(fwd, True)
            if not (backend == "local" and profile.attention == "backend"):
                batch_packed = mcore_zoo.pack_sequences(list(ids))
                psp = batch_packed.packed_seq_params()
                thd = lambda: model(batch_packed.input_ids, batch_packed.position_ids, None, packed_seq_params=psp)  # noqa: E731
                with torch.no_grad():
                    entry["thd_forward_ms"], entry["thd_forward_gib"] = time_step(thd, False)
                entry["thd_train_ms"], entry["thd_train_gib"] = time_step(thd, True)
                if profile_dir:  # one THD forward + backward under torch's profiler, its op table beside
                    from gated_deltanet_speed import profile_form

                    os.makedirs(profile_dir, exist_ok=True)
                    table = Path(profile_dir) / (name.replace("/", "_").replace(" ", "_") + ".txt")
                    entry["thd_train_profile"] = profile_form(lambda: thd().float().mean().backward(), "cuda", table)
            results[name] = entry
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        model = fwd = thd = None  # noqa: F841 - the closures hold the model
    from transformers import AutoConfig, AutoModelForCausalLM

    for attn in ("eager", "sdpa") if transformers_rows else ():
        gc.collect()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() / 2**30
        try:
            hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
            hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=torch.bfloat16).cuda()
            entry = {"held_before_gib": held}
            fwd = lambda: hf(ids).logits  # noqa: E731
            with torch.no_grad():
                entry["bshd_forward_ms"], entry["bshd_forward_gib"] = time_step(fwd, False)
            entry["bshd_train_ms"], entry["bshd_train_gib"] = time_step(fwd, True)
            results[f"transformers/{attn}"] = entry
        except Exception as exc:
            results[f"transformers/{attn}"] = {"error": f"{type(exc).__name__}: {exc}"}
        hf = fwd = None  # noqa: F841
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Numerics speed on {report['gpu']}", "", report["versions"], ""]
    lines += ["## GEMM: split-K disabled (`CUBLAS_WORKSPACE_CONFIG=:0:0`) vs default", ""]
    lines += ["| K x N | " + " | ".join(f"M={m}" for m in ROWS) + " |", "| --- |" + " --- |" * len(ROWS)]
    default, nosplit = report["gemm"].get("default", {}), report["gemm"].get("no_split_k", {})
    for k, n in SHAPES if default else []:
        cells = []
        for m in ROWS:
            key = f"{k}x{n}@M{m}"
            cells.append(f"{nosplit[key] / default[key]:.2f}x ({default[key] * 1000:.0f} us)")
        lines.append(f"| {k} x {n} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: time without split-K / default time (default time in microseconds).", ""]
    m = report["model"]
    lines += [f"## Model: {m.get('shape', 'llama-8b')}-shaped, {m['layers']} layers, batch {m['batch']} x {m['seq']} tokens, bf16", ""]
    lines += ["| variant | BSHD fwd ms | BSHD fwd+bwd ms | THD fwd ms | THD fwd+bwd ms | peak GiB (fwd+bwd) | held before GiB |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in m["results"].items():
        if "error" in e:
            lines.append(f"| {name} | error: `{e['error'][:80]}` | | | | | |")
            continue
        thd = [f"{e[k]:.1f}" if k in e else "-" for k in ("thd_forward_ms", "thd_train_ms")]
        lines.append(
            f"| {name} | {e['bshd_forward_ms']:.1f} | {e['bshd_train_ms']:.1f} | {thd[0]} | {thd[1]} | {e['bshd_train_gib']:.1f} |"
            f" {e.get('held_before_gib', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="llama-8b", help="the model-level stack's widths")
    parser.add_argument("--gemm-child", action="store_true")
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=BACKEND:PROFILE[,KNOB=VALUE...]",
                        help="model variants to time (repeatable; default: " + "; ".join(DEFAULT_VARIANTS) + ")")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM split-K table")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' own eager / sdpa rows")
    parser.add_argument("--profile", action="store_true",
                        help="also one THD forward + backward per variant under torch's profiler: op tables in OUT/profile/")
    args = parser.parse_args(argv)
    if args.gemm_child:
        gemm_child()
        return 0
    os.makedirs(args.out, exist_ok=True)
    gemm = {}
    for tag, extra in [] if args.no_gemm else (("default", {}), ("no_split_k", {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"})):
        env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
        env.update(extra)
        proc = subprocess.run([sys.executable, __file__, "--gemm-child"], env=env, capture_output=True, text=True, check=True)
        gemm[tag] = json.loads(proc.stdout.strip().splitlines()[-1])
    import megatron.core

    report = {
        "gpu": torch.cuda.get_device_name(),
        "versions": f"torch {torch.__version__}, megatron-core {megatron.core.__version__}",
        "gemm": gemm,
        "model": {"shape": args.shape, "layers": args.layers, "batch": args.batch, "seq": args.seq,
                  "results": model_times(args.layers, args.batch, args.seq, args.variant or DEFAULT_VARIANTS, args.shape,
                                         os.path.join(args.out, "profile") if args.profile else None,
                                         transformers_rows=not args.no_transformers)},  # fmt: skip
    }
    with open(os.path.join(args.out, "numerics_speed.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(args.out, "numerics_speed.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
