"""``mcore-zoo parity-report``: mcore vs transformers (and vLLM), per token and per layer.

    mcore-zoo parity-report --arch LlamaForCausalLM                  # embedded tiny model, CPU
    mcore-zoo parity-report --arch all --out docs/parity/cpu          # every architecture
    mcore-zoo parity-report --model /ckpt/Qwen2.5-7B --backend te --out reports/
    mcore-zoo parity-report --config cfg.json --random-weights --scale small --device cuda --backend te

Exit codes: 0 every gating comparison passed, 1 a parity failure, 2 usage or load error.
This module imports nothing heavy at import time (``mcore-zoo plugins`` stays cheap).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
ENV_VLLM_PYTHON = "MCORE_ZOO_VLLM_PYTHON"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "parity-report",
        help="numerical parity of the mcore model vs transformers (and vLLM), per token and per layer",
        description="Numerical parity of the Megatron-Core model against transformers (and vLLM), per token"
        " and per layer. Reports in JSON, Markdown and HTML (docs/parity/README.md).\n\n"
        + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Default (no --out): the Markdown report is printed. Exit codes: 0 pass, 1 parity failure,"
            " 2 usage or load error.\nTolerances per dtype and the report schema: docs/parity/README.md."
        ),
    )
    g = p.add_argument_group("model (exactly one of --arch / --config / --model)")
    g.add_argument("--arch", action="append", metavar="NAME",
                   help="architecture: its embedded tiny example (random weights); 'all' for every registered"
                        " architecture; repeatable. With --scale: its published config, scaled")  # fmt: skip
    g.add_argument("--config", metavar="PATH", help="HF config.json (or directory) with --random-weights")
    g.add_argument("--model", metavar="DIR", help="HF checkpoint directory (real weights; its tokenizer if present)")
    g.add_argument("--random-weights", action="store_true", help="seeded random weights with sharp attention")
    g.add_argument("--scale", choices=("tiny", "small"),
                   help="shrink the config: tiny = 2 layers, hidden <= 512, vocab <= 512; small = 8 layers,"
                        " hidden <= 1024 (GQA ratio, head_dim, RoPE, biases, norms, tying kept)")  # fmt: skip
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an HF config field of a random-weight model (JSON value; text_config.FIELD /"
                        " vision_config.FIELD: a vision-language config's nested field); repeatable")  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="weights and token ids (default 0)")
    g.add_argument("--trust-remote-code", action="store_true")
    g = p.add_argument_group("inputs")
    g.add_argument("--lengths", default=None, metavar="N,N,...",
                   help="sequence lengths (default 61,17,40,8; each >= 2)")
    g.add_argument("--image-size", type=int, default=None, metavar="N",
                   help="vision-language models: each image a grid of N x N merged features (N * spatial_merge_size"
                        " patches a side; default: 2 x 2 and 2 x 4, alternating)")
    g.add_argument("--images", type=int, default=1, metavar="K",
                   help="vision-language models: images per sequence, where it is long enough (default 1; 0: text"
                        " only, the language model alone, on any backend and format)")
    g.add_argument("--tokens", choices=("auto", "tokenizer", "random"), default="auto",
                   help="token ids: the checkpoint's tokenizer on a built-in text (auto: when present) or random")
    g = p.add_argument_group("engines")
    g.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--backend", default="auto", choices=("auto", "te", "local", "portable"),
                   help="mcore backend (auto: te on cuda with Transformer Engine, else portable)")
    g.add_argument("--numerics", help="numerics profile (default: 'default'; 'hf-exact' with --bitwise)")
    g.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE",
                   help="override one knob of the profile (e.g. attention=eager, norm=hf); repeatable")
    g.add_argument("--ignore-field", action="append", default=[], metavar="NAME=REASON",
                   help="build the mcore model with this HF config field ignored on purpose (reason required)")
    g.add_argument("--seq-format", default="auto", choices=("auto", "thd", "bshd"),
                   help="mcore sequence format (auto: thd unless the backend cannot)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size of the mcore run (spawned ranks)")
    g.add_argument("--reference", default="eager", choices=("eager", "sdpa"), help="HF attention of the reference")
    g.add_argument("--no-baseline", action="store_true", help="skip HF's other attention implementation (info row)")
    g.add_argument("--no-layers", action="store_true", help="skip per-layer hidden-state capture")
    g.add_argument("--vllm-python", metavar="PYTHON", default=None,
                   help=f"python of a vLLM environment: adds vLLM runs on the mcore model's HF export"
                        f" (default: ${ENV_VLLM_PYTHON} with --vllm)")  # fmt: skip
    g.add_argument("--vllm", action="store_true", help=f"add vLLM using ${ENV_VLLM_PYTHON}")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE", help="extra vllm.LLM() argument")
    g = p.add_argument_group("criteria")
    g.add_argument("--bitwise", action="store_true", help="pass only if logits are identical")
    g.add_argument("--tol", action="append", default=[], metavar="NAME=VALUE",
                   help="override a tolerance (mean_abs_dlogp, p99_abs_dlogp, max_abs_dlogp, kl_mean, top1_min,"
                        " hidden_rel; 'none' to stop gating it)")  # fmt: skip
    g.add_argument("--invariance", action="store_true",
                   help="also compare the mcore model with itself: THD vs BSHD, batch 1 vs N")
    g.add_argument("--invariance-tp", type=int, metavar="K", help="the invariance matrix with TP K vs TP 1 (spawns K ranks)")
    g.add_argument("--ablation", action="store_true",
                   help="also run the model with each numerics knob flipped alone (default <-> hf-exact)"
                        " and report what each costs (not gating)")  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help="write <name>.json, .md and .html there")
    g.add_argument("--name", help="file stem (default: the architecture)")
    g.add_argument("--format", default="json,md,html", help="formats to write (default json,md,html)")
    g.add_argument("--worst", type=int, default=10, help="worst tokens listed per comparison")
    g.add_argument("--work-dir", help="keep intermediate files (reference checkpoint, export, vLLM logs) here")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    g.add_argument("--verbose", "-v", action="store_true", help="tracebacks on errors")
    p.set_defaults(func=cmd_parity_report)


def _pairs(items: list[str], flag: str) -> dict[str, Any]:
    from .inputs import parse_set

    try:
        return parse_set(items)
    except Exception as exc:
        raise _Usage(f"{flag}: {exc}") from None


def _ignore_fields(items: list[str]) -> dict[str, str]:
    from ..config.reader import parse_ignore_fields
    from ..errors import ZooError

    try:
        return parse_ignore_fields(items)
    except ZooError as exc:
        raise _Usage(str(exc)) from None


class _Usage(Exception):
    pass


def _options(args: argparse.Namespace, arch: Optional[str]) -> Any:
    from .harness import DEFAULT_LENGTHS, ParityOptions

    lengths = DEFAULT_LENGTHS
    if args.lengths:
        try:
            lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
        except ValueError:
            raise _Usage(f"--lengths {args.lengths!r}: expected comma-separated integers") from None
    tolerances = {}
    for key, value in _pairs(args.tol, "--tol").items():
        tolerances[key] = None if value in (None, "none") else float(value)
    vllm_python = args.vllm_python or (os.environ.get(ENV_VLLM_PYTHON) if args.vllm else None)
    if args.vllm and not vllm_python:
        raise _Usage(f"--vllm: set {ENV_VLLM_PYTHON}=/path/to/vllm-env/bin/python or pass --vllm-python")
    return ParityOptions(
        arch=arch, model=args.model, config=args.config, random_weights=args.random_weights, scale=args.scale,
        settings=_pairs(args.set, "--set"), seed=args.seed, lengths=lengths, tokens=args.tokens, dtype=args.dtype,
        device=args.device, backend=args.backend, numerics=args.numerics, knobs=_pairs(args.knob, "--knob"),
        ignore_fields=_ignore_fields(args.ignore_field), seq_format=args.seq_format, tp=args.tp, reference=args.reference, baseline=not args.no_baseline,
        layers=not args.no_layers, bitwise=args.bitwise, tolerances=tolerances, invariance=args.invariance,
        invariance_tp=args.invariance_tp, ablation=args.ablation, vllm_python=vllm_python, vllm_kwargs=_pairs(args.vllm_arg, "--vllm-arg"),
        worst=args.worst, work_dir=args.work_dir, trust_remote_code=args.trust_remote_code,
        image_size=args.image_size, images=args.images,
        command=getattr(args, "command_line", None),
    )  # fmt: skip


def _architectures(args: argparse.Namespace) -> list[Optional[str]]:
    if not args.arch:
        return [None]
    names: list[str] = []
    for name in args.arch:
        if name == "all":
            from ..registry import get_registry

            names += [a for a in get_registry().architectures() if a not in names]
        elif name not in names:
            names.append(name)
    return list(names)


def cmd_parity_report(args: argparse.Namespace) -> int:
    from .runners import quiet_libraries

    quiet_libraries()
    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    if set(formats) - {"json", "md", "html"}:
        print(f"mcore-zoo parity-report: error: --format {args.format!r}: use json, md, html", file=sys.stderr)
        return EXIT_USAGE
    archs = _architectures(args)
    if len(archs) > 1 and not args.out:
        print("mcore-zoo parity-report: error: several architectures need --out DIR", file=sys.stderr)
        return EXIT_USAGE
    if len(archs) > 1 and args.name:
        print("mcore-zoo parity-report: error: --name names one report; drop it with several architectures", file=sys.stderr)
        return EXIT_USAGE
    codes = []
    summary = []
    for arch in archs:
        code, report, error = _one(args, arch, formats)
        _free_memory()
        codes.append(code)
        summary.append((arch or "?", code, report, error))
    if len(archs) > 1:
        _print_summary(summary, Path(args.out))
    if EXIT_USAGE in codes:
        return EXIT_USAGE
    return EXIT_FAIL if EXIT_FAIL in codes else EXIT_OK


def _one(args: argparse.Namespace, arch: Optional[str], formats: list[str]) -> tuple[int, Optional[dict[str, Any]], Optional[str]]:
    """Run one report; returns (exit code, report or None, error message or None)."""
    from ..errors import ZooError
    from .harness import Progress, run_parity
    from .report import to_markdown, write_reports

    progress = Progress(enabled=not args.quiet)
    try:
        opts = _options(args, arch)
        report = run_parity(opts, progress)
    except (_Usage, ZooError, FileNotFoundError, FileExistsError, ValueError, ImportError, OSError) as exc:
        _error(args, arch, exc)
        return EXIT_USAGE, None, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a crash in an engine is not a parity verdict
        _error(args, arch, exc, always_trace=True)
        return EXIT_USAGE, None, f"{type(exc).__name__}: {exc}"
    if args.out:
        stem = args.name or report["model"]["architecture"]
        try:
            paths = write_reports(report, Path(args.out), stem, formats)
        except OSError as exc:
            _error(args, arch, exc)
            return EXIT_USAGE, None, f"{type(exc).__name__}: {exc}"
        progress.note("wrote " + ", ".join(str(p) for p in paths))
    else:
        sys.stdout.write(to_markdown(report))
    verdict = report["verdict"].upper()
    failing = [c for c in report["comparisons"] if c["gating"] and not c["passed"]]
    line = f"{report['model']['architecture']}: {verdict}"
    for c in failing:
        where = f" (first divergent site: {c['first_divergent_site']})" if c["first_divergent_site"] else ""
        line += f"\n  {c['name']}: {'; '.join(c['failures'])}{where}"
    print(line, file=sys.stderr if not args.out else sys.stdout)
    return (EXIT_OK if report["verdict"] == "pass" else EXIT_FAIL), report, None


def _free_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _error(args: argparse.Namespace, arch: Optional[str], exc: BaseException, always_trace: bool = False) -> None:
    what = f" ({arch})" if arch else ""
    print(f"mcore-zoo parity-report{what}: error: {exc}", file=sys.stderr)
    if args.verbose or always_trace:
        traceback.print_exc()


def _print_summary(summary: list[tuple[str, int, Optional[dict[str, Any]], Optional[str]]], out: Path) -> None:
    """One line per architecture on stdout and ``summary.md`` next to the reports."""
    from .report import fmt, pct

    lines = ["| architecture | result | mcore vs HF: mean abs dlogp | max abs dlogp | top-1 | bitwise | report |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for arch, code, report, error in summary:
        if report is None:
            message = (error or "").splitlines()[0][:300].replace("|", "\\|") if error else ""
            lines.append(f"| `{arch}` | ERROR (exit {code}): {message} | | | | | |")
            continue
        c = next(c for c in report["comparisons"] if c["role"] == "parity")
        m = c["metrics"]
        stem = report["model"]["architecture"]
        link = f"{stem}.md" if (out / f"{stem}.md").exists() else f"{stem}.json"
        lines.append(f"| `{arch}` | {report['verdict'].upper()} | {fmt(m['mean_abs_dlogp'])} | {fmt(m['max_abs_dlogp'])}"
                     f" | {pct(m['top1_agreement'])} | {fmt(m['bitwise_equal'])} | [{link}]({link}) |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
