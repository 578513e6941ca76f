"""GPU numerics of the built-in dense families: every backend and numerics profile against HF.

For each built-in architecture (mid-size random model with sharp attention, bf16 weights saved with
``save_pretrained`` and loaded by both sides from the same files):

* HF eager and HF sdpa references (``from_pretrained(dtype=bfloat16)``);
* mcore variants - ``te`` default (the fast path), ``local`` default, ``local`` / ``portable``
  ``hf-exact`` (eager) and ``hf-exact-sdpa`` - in BSHD ``[B, S]``, THD with equal lengths (same
  GEMM row count as HF's batch) and THD with mixed lengths (vs HF on each sequence alone);
* an ablation: ``hf-exact`` on ``local`` with one knob flipped at a time;
* forward timings.

Metrics per comparison: bitwise flag, max |dlogit|, mean / max |dlogp| of the next token, mean
full-vocabulary KL(ref || ours), top-1 agreement. Run from the repository root::

    PYTHONPATH=src python bench/gpu/dense_numerics.py --out OUT            # GPU, bf16
    PYTHONPATH=src python bench/gpu/dense_numerics.py --out OUT --device cpu --tiny   # logic check

Set ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (both sides are in this process) and ``--tag nosplitk`` for
the run without cuBLAS split-K. Writes ``OUT/dense_numerics[-TAG].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
PER_ARCH = {
    "LlamaForCausalLM": dict(head_dim=64, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "MistralForCausalLM": dict(head_dim=64, sliding_window=256),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(head_dim=128),
}  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def metrics(ours: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor) -> dict[str, Any]:
    """Logits ``[n, V]`` of the same positions; ``tokens`` ``[n]`` (next-token targets from row 0)."""
    ours, ref = ours.float(), ref.float()
    lp_o = torch.log_softmax(ours, -1)
    lp_r = torch.log_softmax(ref, -1)
    tgt = tokens[1:].to(ours.device)
    d = (lp_o[:-1].gather(-1, tgt[:, None]) - lp_r[:-1].gather(-1, tgt[:, None])).abs().squeeze(-1)
    kl = (lp_r.exp() * (lp_r - lp_o)).sum(-1)
    return {
        "bitwise": bool(torch.equal(ours, ref)),
        "max_dlogit": float((ours - ref).abs().max()),
        "mean_dlogp": float(d.mean()) if d.numel() else 0.0,
        "max_dlogp": float(d.max()) if d.numel() else 0.0,
        "mean_kl": float(kl.mean()),
        "top1": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
        "tokens": int(ours.shape[0]),
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(p["tokens"] for p in parts)
    return {
        "bitwise": all(p["bitwise"] for p in parts),
        "max_dlogit": max(p["max_dlogit"] for p in parts),
        "mean_dlogp": sum(p["mean_dlogp"] * p["tokens"] for p in parts) / total,
        "max_dlogp": max(p["max_dlogp"] for p in parts),
        "mean_kl": sum(p["mean_kl"] * p["tokens"] for p in parts) / total,
        "top1": sum(p["top1"] * p["tokens"] for p in parts) / total,
        "tokens": total,
    }


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 5) -> float:
    with torch.no_grad():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1000


def run_arch(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, workdir: str) -> dict[str, Any]:
    import mcore_zoo
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.parity.reference import load_reference, write_reference_checkpoint

    arch = mcore_zoo.lookup(name)
    config = arch.example_config()
    config.update(TINY if args.tiny else MID)
    config.update({k: v for k, v in PER_ARCH[name].items() if not (args.tiny and k == "head_dim")})
    if args.tiny and name == "MistralForCausalLM":
        config["sliding_window"] = 24
    ckpt = os.path.join(workdir, name)
    write_reference_checkpoint(arch, config, ckpt, seed=0, dtype=dtype)
    B, S = (4, 512) if not args.tiny else (4, 48)
    mixed = [512, 100, 37, 300] if not args.tiny else [48, 10, 5, 30]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (B, S), generator=gen)
    mixed_seqs = [torch.randint(0, config["vocab_size"], (n,), generator=gen) for n in mixed]
    result: dict[str, Any] = {"config": {k: v for k, v in config.items() if k != "architectures"}, "variants": {}, "errors": {}}

    refs: dict[str, dict[str, Any]] = {}
    for attn in ("eager", "sdpa"):
        hf = load_reference(arch, ckpt, dtype=dtype, attn_implementation=attn, device=device)
        with torch.no_grad():
            refs[attn] = {
                "bshd": hf(ids.to(device)).logits,
                "mixed": [hf(s[None].to(device)).logits[0] for s in mixed_seqs],
            }
            if attn == "eager":
                result["hf_eager_ms"] = timed(lambda: hf(ids.to(device)), device)
            else:
                result["hf_sdpa_ms"] = timed(lambda: hf(ids.to(device)), device)
        del hf
    result["hf_sdpa_vs_eager"] = {
        "bshd": merge([metrics(refs["sdpa"]["bshd"][b], refs["eager"]["bshd"][b], ids[b]) for b in range(B)]),
        "mixed": merge([metrics(o, r, s) for o, r, s in zip(refs["sdpa"]["mixed"], refs["eager"]["mixed"], mixed_seqs)]),
    }

    base = get_profile("hf-exact")
    variants: list[tuple[str, str, Any, str]] = [
        ("te/default", "te", "default", "eager"),
        ("local/default", "local", "default", "eager"),
        ("local/hf-exact", "local", "hf-exact", "eager"),
        ("portable/hf-exact", "portable", "hf-exact", "eager"),
        ("portable/hf-exact-sdpa", "portable", "hf-exact-sdpa", "sdpa"),
        ("te/hf-exact", "te", "hf-exact", "eager"),
    ]
    ablation = [
        ("norm=mcore", dict(norm="mcore")),
        ("rope_freqs=mcore", dict(rope_freqs="mcore")),
        ("attention=backend", dict(attention="backend")),
        ("bias_activation_fusion", dict(bias_activation_fusion=True)),
        ("masked_softmax_fusion+attention=backend", dict(masked_softmax_fusion=True, attention="backend")),
    ]
    for knob, change in ablation:
        variants.append((f"ablation:local/hf-exact/{knob}", "local", base.with_knobs(**change), "eager"))
    if args.only:
        variants = [v for v in variants if any(o in v[0] for o in args.only)]
    for vname, backend, numerics, ref_attn in variants:
        try:
            model = mcore_zoo.build_model(ckpt, backend=backend, numerics=numerics, params_dtype=dtype, load=ckpt, device=device).eval()
            entry: dict[str, Any] = {"reference": f"hf-{ref_attn}"}
            ref = refs[ref_attn]
            positions = torch.arange(S, device=device).expand(B, -1)
            with torch.no_grad():
                bshd = model(ids.to(device), positions, None)
                entry["bshd"] = merge([metrics(bshd[b], ref["bshd"][b], ids[b]) for b in range(B)])
                entry["bshd_ms"] = timed(lambda: model(ids.to(device), positions, None), device)
                thd_ok = not (backend == "local" and getattr(mcore_zoo.get_profile(numerics), "attention", "backend") == "backend")
                if thd_ok:
                    eq = mcore_zoo.packed_forward(model, list(ids), seq_format="thd").logits
                    entry["thd_equal_lengths"] = merge([metrics(eq[b], ref["bshd"][b], ids[b]) for b in range(B)])
                    entry["thd_vs_own_bshd"] = merge([metrics(eq[b], bshd[b], ids[b]) for b in range(B)])
                    mx = mcore_zoo.packed_forward(model, mixed_seqs, seq_format="thd").logits
                    entry["thd_mixed_lengths"] = merge([metrics(o, r, s) for o, r, s in zip(mx, ref["mixed"], mixed_seqs)])
                    entry["thd_ms"] = timed(lambda: mcore_zoo.packed_forward(model, list(ids), seq_format="thd", return_logprobs=False), device)
            result["variants"][vname] = entry
            del model
        except Exception as exc:  # record and go on
            result["errors"][vname] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for mod in ("transformers", "megatron.core", "transformer_engine"):
        try:
            module = __import__(mod, fromlist=["__version__"])
            env[mod] = getattr(module, "__version__", "?")
        except Exception:
            env[mod] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return env


def fmt(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    if m["bitwise"]:
        return "**bitwise**"
    return f"{m['mean_dlogp']:.2e} / {m['max_dlogp']:.2e} / {m['top1'] * 100:.1f}%"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Dense families on {report['environment'].get('gpu', report['environment']['device'])}", ""]
    env = report["environment"]
    lines.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    lines += ["", "Cells: **bitwise**, else mean |dlogp| / max |dlogp| / top-1 agreement vs the reference.", ""]
    for arch, res in report["architectures"].items():
        lines.append(f"## {arch}")
        if "error" in res:
            lines += ["", f"failed: `{res['error'].splitlines()[0]}`", ""]
            continue
        hs = res["hf_sdpa_vs_eager"]
        lines += ["", f"HF sdpa vs HF eager: BSHD {fmt(hs['bshd'])}; mixed {fmt(hs['mixed'])}", ""]
        lines.append("| variant | ref | BSHD | THD equal lengths | THD mixed lengths | THD vs own BSHD | BSHD ms | THD ms |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for vname, v in res["variants"].items():
            lines.append(
                f"| {vname} | {v['reference']} | {fmt(v.get('bshd'))} | {fmt(v.get('thd_equal_lengths'))} | "
                f"{fmt(v.get('thd_mixed_lengths'))} | {fmt(v.get('thd_vs_own_bshd'))} | "
                f"{v.get('bshd_ms', 0):.1f} | {v.get('thd_ms', 0):.1f} |"
            )
        lines.append(f"\nHF eager {res.get('hf_eager_ms', 0):.1f} ms, HF sdpa {res.get('hf_sdpa_ms', 0):.1f} ms (BSHD forward)\n")
        for vname, err in res["errors"].items():
            lines.append(f"- {vname} failed: `{err.splitlines()[0]}`")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models (logic check)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--arch", nargs="*", default=ARCHS)
    parser.add_argument("--only", nargs="*", default=None, help="variant name substrings to run")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.makedirs(args.out, exist_ok=True)
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel()
    report: dict[str, Any] = {"environment": environment(device), "dtype": str(dtype), "architectures": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.arch:
            t0 = time.time()
            try:
                report["architectures"][name] = run_arch(name, args, device, dtype, workdir)
            except Exception as exc:
                report["architectures"][name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            print(f"{name}: {time.time() - t0:.1f} s", flush=True)
    suffix = f"-{args.tag}" if args.tag else ""
    with open(os.path.join(args.out, f"dense_numerics{suffix}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"dense_numerics{suffix}.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
