"""transformers against itself on a gated DeltaNet model: its torch fallbacks vs flash-linear-attention.

A parity report's baseline for the zoo's distance to HF eager is transformers' own sdpa-vs-eager
distance. On a hybrid model (Qwen3-Next, Qwen3.5) that baseline moves only the full-attention
layers: both of transformers' runs compute the gated DeltaNet layers on the same torch fallbacks.
The zoo's ``te`` build runs those layers on fla's kernels, so the spread that belongs next to it is
transformers' own on the same two kernel sets. This script measures, on one HF checkpoint (e.g. a
parity report's ``--work-dir``'s ``reference/``) and the same token sequences, each sequence alone:

* ``hf-eager`` (torch fallbacks: ``fla`` and ``causal_conv1d`` hidden while transformers' modeling
  modules are imported) - the reference;
* ``hf-sdpa`` on the same fallbacks (the parity report's usual baseline);
* ``hf-eager-fla``: transformers' eager attention with its gated DeltaNet on fla (fla visible).

Each run is a child process (transformers picks fla when its modeling module is imported), with the
same checkpoint, dtype and tokens. Writes ``OUT`` (JSON) and a Markdown table beside it.

    PYTHONPATH=$FLA_SITE:src python bench/gpu/hf_kernel_spread.py --model WORK/reference --out OUT.json \\
        [--lengths 512,512,300,100] [--dtype bfloat16]

On the CPU (no fla) ``--device cpu --no-fla`` runs the two fallback runs only (the dry run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNS = {"hf-eager": ("eager", False), "hf-sdpa": ("sdpa", False), "hf-eager-fla": ("eager", True)}


def child(model: str, run: str, lengths: list[int], dtype: str, device: str, seed: int, out: str) -> None:
    """One run (a :data:`RUNS` key): its per-sequence logits saved to ``out`` (safetensors), and what
    transformers resolved its gated DeltaNet entry points to."""
    import contextlib

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(HERE))
    from hybrid_fla_parity import hf_kernels, hidden_packages

    attn, with_fla = RUNS[run]
    config = json.loads((Path(model) / "config.json").read_text())
    record = hf_kernels(hide=not with_fla)  # transformers' modules imported first, fla hidden or not
    with contextlib.nullcontext() if with_fla else hidden_packages():
        import mcore_zoo
        from mcore_zoo.parity.runners import run_hf

        architecture = mcore_zoo.get_registry().get(config["architectures"][0])
        vocab = _vocab_size(config)
        gen = torch.Generator().manual_seed(seed)
        sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        result = run_hf(architecture, model, sequences, dtype=getattr(torch, dtype), attn_implementation=attn,
                        device=device, capture=False)  # fmt: skip
    save_file({f"logits.{i}": t.float().contiguous() for i, t in enumerate(result.predictions.logits)}
              | {f"tokens.{i}": s for i, s in enumerate(sequences)}, out)  # fmt: skip
    Path(out + ".json").write_text(json.dumps({"kernels": record, "info": result.info}))


def _vocab_size(config: dict[str, Any]) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def compare(work: Path, runs: list[str], lengths: list[int]) -> dict[str, Any]:
    from safetensors.torch import load_file

    from mcore_zoo.numerics.metrics import Predictions, logprob_metrics

    loaded = {r: load_file(str(work / f"{r}.safetensors")) for r in runs}
    preds = {r: Predictions(tokens=[d[f"tokens.{i}"] for i in range(len(lengths))],
                            logits=[d[f"logits.{i}"] for i in range(len(lengths))]) for r, d in loaded.items()}  # fmt: skip
    out = {}
    for r in runs[1:]:
        m = logprob_metrics(preds[runs[0]], preds[r])
        out[f"{r} vs {runs[0]}"] = {k: m[k] for k in ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "kl_mean",
                                                      "top1_agreement", "token_mult_prob_error", "bitwise_equal")}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint directory")
    ap.add_argument("--out", required=True, type=Path, help="JSON path (Markdown beside it)")
    ap.add_argument("--lengths", default="512,512,300,100")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fla", dest="fla", action="store_false", help="the fallback runs only (CPU dry run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        child(args.model, args.child, lengths, args.dtype, args.device, args.seed, args.child_out)
        return 0
    runs = [r for r in RUNS if args.fla or not RUNS[r][1]]
    report: dict[str, Any] = {"model": args.model, "lengths": lengths, "dtype": args.dtype, "device": args.device, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in runs:
            cmd = [sys.executable, __file__, "--model", args.model, "--out", str(args.out), "--lengths", args.lengths,
                   "--dtype", args.dtype, "--device", args.device, "--seed", str(args.seed), "--child", r,
                   "--child-out", str(work / f"{r}.safetensors")]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                report["runs"][r] = {"error": proc.stderr[-3000:]}
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            report["runs"][r] = json.loads((work / f"{r}.safetensors.json").read_text())
        done = [r for r in runs if "error" not in report["runs"][r]]
        if done and done[0] == "hf-eager" and len(done) > 1:
            report["spread"] = compare(work, done, lengths)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# transformers' own kernel spread: {args.model}", "", f"{args.dtype} on {args.device}, sequences {lengths} each alone.", "",
             "| run vs hf-eager (torch fallbacks) | mean \\|dlogp\\| | p99 | max | top-1 | token_mult_prob_error |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, m in report.get("spread", {}).items():
        lines.append(f"| {name} | {m['mean_abs_dlogp']:.4g} | {m['p99_abs_dlogp']:.4g} | {m['max_abs_dlogp']:.4g} |"
                     f" {m['top1_agreement']:.4f} | {m['token_mult_prob_error']:.5f} |")  # fmt: skip
    for r, info in report["runs"].items():
        if "error" in info:
            lines.append(f"\n{r}: failed - `{info['error'].strip().splitlines()[-1][:200]}`")
        else:
            kern = {m: e.get("torch_chunk_gated_delta_rule", e.get("chunk_gated_delta_rule", e.get("error", "?")))
                    for m, e in info["kernels"].items()}  # fmt: skip
            lines.append(f"\n{r}: chunk_gated_delta_rule -> " + ", ".join(f"`{m}`: `{v}`" for m, v in kern.items()))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if "spread" in report else 1


if __name__ == "__main__":
    sys.exit(main())
