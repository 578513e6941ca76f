"""``hf-exact`` MoE on mixed THD packs against transformers on each sequence alone (the
``moe-exact-packs`` phase of ``run_all.sh``).

For each model (a published config, 2 layers, random weights with sharp attention, experts cut to
fit one GPU) and each of transformers' experts implementations (``grouped_mm``, ``eager``: the
numerics knob ``moe_experts``), the reference runs every sequence alone; the zoo's ``local``
``hf-exact`` model runs each pack (lengths 512, 300, 100, 37, and sixteen sequences of 64) in one
THD forward ("packed") and every sequence in a forward of its own ("alone"). Each is compared with
the reference bit for bit: bitwise or not, max |dlogit| (the logits site) and max |dlogp|, and the
first divergent site (``embedding``, ``layer.<i>``, ``final_norm``, ``logits``) when not.

Writes ``OUT/moe_exact_packs.json`` and ``OUT/moe_exact_packs.md``; exits 1 when any row is not
bitwise (the rows are all written first), 0 otherwise. Run from the repository root
(``PYTHONPATH=src``), with cuBLAS split-K off as ``run_all.sh`` sets it::

    python bench/gpu/moe_exact_packs.py --out OUT

The CPU dry run of the same path, at the ``tiny`` scale and short packs (what
``tests/distributed/test_gpu_script_on_cpu.py`` runs)::

    python bench/gpu/moe_exact_packs.py --device cpu --tiny --models qwen3-30b-a3b \\
        --packs mixed=13,7,3,2 many=2x6 --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs"

#: model -> (published config, fields set for the run: 2 layers, at least one of them MoE, the
#: experts that fit one GPU next to transformers' copy; fields set as well at ``--tiny``: fewer
#: experts, for a quick CPU run)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen3-30b-a3b": ("qwen3-30b-a3b.json", {"num_hidden_layers": 2}, {"num_experts": 16}),
    "mixtral-8x7b": ("mixtral-8x7b-v0.1.json", {"num_hidden_layers": 2}, {}),
    "deepseek-v3": ("deepseek-v3.json", {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 64},
                    {"n_routed_experts": 16}),
    # the wider widths: Qwen3-235B-A22B (all 128 experts), Mixtral-8x22B, Kimi-K2 (64 of its 384 routed experts)
    "qwen3-235b-a22b": ("qwen3-235b-a22b.json", {"num_hidden_layers": 2}, {"num_experts": 16}),
    # Mixtral-8x22B's widths (hidden 6144, 48 / 8 heads of 128, experts of 16384, vocabulary 32768) on the
    # published Mixtral config of this directory
    "mixtral-8x22b": ("mixtral-8x7b-v0.1.json", {"num_hidden_layers": 2, "hidden_size": 6144, "intermediate_size": 16384,
                                                 "num_attention_heads": 48, "vocab_size": 32768,
                                                 "max_position_embeddings": 65536},
                      {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "vocab_size": 512}),
    "kimi-k2": ("kimi-k2-instruct.json", {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 64},
                {"n_routed_experts": 16}),
}
#: the models run when ``--models`` is not given (the wider widths on request)
DEFAULT_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
PACKS = {"mixed": (512, 300, 100, 37), "16x64": (64,) * 16}
EXPERTS = ("grouped_mm", "eager")


def parse_pack(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME=L1,L2,...`` (``NxL``: N sequences of L tokens) -> ``(NAME, lengths)``."""
    name, _, spec = text.partition("=")
    lengths: list[int] = []
    for part in spec.split(","):
        count, _, length = part.rpartition("x")
        lengths += [int(length)] * (int(count) if count else 1)
    if not name or not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"--packs {text!r}: NAME=L1,L2,... with every length >= 2")
    return name, tuple(lengths)


def row_of(comparison: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of one candidate-vs-reference comparison."""
    logits = next((row for row in comparison["layers"] if row["site"] == "logits"), None)
    metrics = comparison["metrics"]
    return {"bitwise": bool(metrics["bitwise_equal"]), "max_abs_dlogit": logits["max_abs"] if logits else None,
            "max_abs_dlogp": metrics["max_abs_dlogp"], "first_divergent_site": comparison["first_divergent_site"]}  # fmt: skip


def run_model(name: str, args: argparse.Namespace, packs: dict[str, tuple[int, ...]], work: Path) -> list[dict[str, Any]]:
    """Every (experts, pack, form) row of one model."""
    from mcore_zoo.numerics.metrics import default_tolerance
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.parity.harness import compare
    from mcore_zoo.parity.inputs import make_sequences, prepare_model
    from mcore_zoo.parity.runners import McoreSpec, run_hf, run_mcore

    config, settings, tiny = MODELS[name]
    settings = {**settings, **tiny} if args.tiny else settings
    dtype = torch.bfloat16
    source = prepare_model(config=str(CONFIGS / config), random_weights=True, scale="tiny" if args.tiny else None,
                           settings=settings, dtype=dtype, work_dir=work / name, seed=args.seed)  # fmt: skip
    vocab = int(source.config["vocab_size"])
    lengths = [n for pack in packs.values() for n in pack]
    sequences, _ = make_sequences(lengths, vocab, mode="random", seed=args.seed)
    tol = default_tolerance("bfloat16")
    rows = []
    for experts in args.experts:
        started = time.perf_counter()
        ref = run_hf(source.architecture, source.checkpoint, sequences, dtype=dtype, device=args.device,
                     experts_implementation=experts)  # fmt: skip
        release()
        profile = get_profile("hf-exact").with_knobs(moe_experts=experts)
        spec = McoreSpec(str(source.checkpoint), args.backend, profile, dtype, "thd", 1, args.device)
        alone = run_mcore(dataclasses.replace(spec, per_sequence=True), sequences)
        release()
        start = 0
        for pack_name, pack in packs.items():
            part = slice(start, start + len(pack))
            start += len(pack)
            packed = run_mcore(spec, sequences[part])
            release()
            for form, result in (("packed", packed), ("alone", alone)):
                cand = _slice(result, part) if form == "alone" else result
                comparison = compare(_slice(ref, part), cand, role="parity", gating=True, criterion="bitwise", tol=tol,
                                     worst=3, device=args.device if args.device == "cuda" else None)  # fmt: skip
                rows.append({"model": name, "experts": experts, "pack": pack_name, "lengths": list(pack), "form": form,
                             **row_of(comparison)})  # fmt: skip
        print(f"{name} {experts}: {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return rows


def release() -> None:
    """Free the model a runner built (a built model holds reference cycles: its handle rides on its
    chunks) before the next one is built: three full-width models at once would not fit."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _slice(result: Any, part: slice) -> Any:
    """A runner's result restricted to the sequences ``part``."""
    from mcore_zoo.numerics.metrics import Predictions
    from mcore_zoo.parity.runners import RunResult

    p = result.predictions
    predictions = Predictions(tokens=p.tokens[part], logits=p.logits[part] if p.logits is not None else None)
    hidden = {site: values[part] for site, values in result.hidden.items()}
    return RunResult(result.label, predictions, hidden, result.info)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# hf-exact MoE on THD packs vs transformers on each sequence alone ({report['device_name']})", "",
             f"bf16, 2 layers, random weights with sharp attention, backend `{report.get('backend', 'local')}`;"
             f" {report['versions']}.", "",
             "| model | experts | pack | form | bitwise | max abs dlogit | max abs dlogp | first divergent site |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in report["rows"]:
        dlogit = "-" if r["max_abs_dlogit"] is None else f"{r['max_abs_dlogit']:.3g}"
        lines.append(f"| {r['model']} | {r['experts']} | {r['pack']} | {r['form']} | {'yes' if r['bitwise'] else 'no'}"
                     f" | {dlogit} | {r['max_abs_dlogp']:.3g} | {r['first_divergent_site'] or '-'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny scale of the configs (the CPU dry run)")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(MODELS))
    parser.add_argument("--experts", nargs="+", default=list(EXPERTS), choices=list(EXPERTS))
    parser.add_argument("--packs", nargs="+", type=parse_pack, default=None, help="NAME=L1,L2 or NAME=NxL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="local", choices=("local", "te"), help="the zoo model's backend")
    args = parser.parse_args(argv)
    packs = dict(args.packs) if args.packs else dict(PACKS)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.parity.environment import environment

    ensure_model_parallel()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows += run_model(name, args, packs, args.out / "work")
    env = environment(args.device)
    report = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "environment": env, "versions": ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
              "tiny": args.tiny, "backend": args.backend, "rows": rows,
              "all_bitwise": all(r["bitwise"] for r in rows)}  # fmt: skip
    (args.out / "moe_exact_packs.json").write_text(json.dumps(report, indent=2))
    (args.out / "moe_exact_packs.md").write_text(markdown(report))
    return 0 if report["all_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
