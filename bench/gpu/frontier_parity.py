"""``mcore-zoo parity-report`` with backends an architecture has not declared yet.

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``), GLM-5 (``GlmMoeDsaForCausalLM``) and gpt-oss
(``GptOssForCausalLM``) first declared ``local`` and ``portable`` only: their ``te`` layer specs
(Transformer Engine linears and norms around the zoo's own core attention: DeepSeek sparse attention,
attention sinks) were declared once this script's run showed them working
(``docs/parity/gpu-frontier/``); with ``te`` declared, ``--admit te`` adds nothing for them and the
script still serves a backend an architecture has not declared yet. This script registers, in
its own process only, an entry for each named architecture that takes over the built-in one with the
extra backends (``ModelEntry(override=True)``, everything else unchanged), then runs
``parity-report`` with the remaining arguments. Nothing is installed or written outside ``--out``.

Run from the repository root (``PYTHONPATH=src``)::

    python bench/gpu/frontier_parity.py --admit te --arch-entry GptOssForCausalLM -- \\
        --config tests/fixtures/configs/gpt-oss-20b.json --random-weights --set num_hidden_layers=2 \\
        --backend te --dtype bfloat16 --device cuda --out OUT

Without CUDA / Transformer Engine the same command with ``--backend local --device cpu --scale tiny``
checks the arguments and the report path. ``--summarize DIR`` writes ``DIR/summary.md`` and
``DIR/summary.json``: one row per report found under ``DIR`` (its parity row next to transformers'
own sdpa-vs-eager row), and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

FRONTIER = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM")


def admitting_plugin(architectures: list[str], backends: list[str]) -> Any:
    """A plugin object whose entries are the built-in ones of ``architectures`` with ``backends``
    added, each taking the architecture over (``override=True``)."""
    from mcore_zoo.plugin_api import hookimpl
    from mcore_zoo.registry import get_registry

    registry = get_registry()
    entries = []
    for name in architectures:
        entry = registry.get(name).entry
        extra = tuple(b for b in backends if b not in entry.backends)
        entries.append(dataclasses.replace(entry, backends=entry.backends + extra, override=True))

    class Admit:
        @hookimpl
        def mcore_zoo_architectures(self):  # type: ignore[no-untyped-def]
            return entries

    return Admit()


def summary_rows(root: Path) -> list[dict[str, Any]]:
    """One row per parity report (``*.json`` with ``comparisons``) under ``root``: the gating row's
    metrics, the baseline row's mean |dlogp| (``None`` where transformers has no sdpa) and their ratio."""
    rows = []
    for path in sorted(root.rglob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(report, dict) or "comparisons" not in report:
            continue
        parity = next((c for c in report["comparisons"] if c["gating"]), None)
        baseline = next((c for c in report["comparisons"] if c["role"] == "baseline"), None)
        if parity is None:
            continue
        m = parity["metrics"]
        base = baseline["metrics"]["mean_abs_dlogp"] if baseline else None
        rows.append(dict(report=str(path.relative_to(root).with_suffix(".md")), architecture=report["model"]["architecture"],
                         comparison=parity["name"], verdict=report["verdict"], mean_abs_dlogp=m["mean_abs_dlogp"],
                         max_abs_dlogp=m["max_abs_dlogp"], kl_mean=m["kl_mean"], top1=m["top1_agreement"],
                         exp_abs_dlogp=m["token_mult_prob_error"], baseline_mean_abs_dlogp=base,
                         ratio=m["mean_abs_dlogp"] / base if base else None,
                         first_divergent_site=parity["first_divergent_site"]))  # fmt: skip
    return rows


def write_summary(root: Path) -> Path:
    """``root/summary.md`` and ``root/summary.json`` from :func:`summary_rows`."""
    rows = summary_rows(root)
    (root / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| architecture | comparison | verdict | mean \\|dlogp\\| | max \\|dlogp\\| | KL | top-1 | exp\\|dlogp\\|"
             " | HF sdpa vs eager mean \\|dlogp\\| | ratio | report |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in rows:
        base = "-" if r["baseline_mean_abs_dlogp"] is None else f"{r['baseline_mean_abs_dlogp']:.4f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['architecture']} | `{r['comparison']}` | {r['verdict']} | {r['mean_abs_dlogp']:.4f}"
                     f" | {r['max_abs_dlogp']:.3f} | {r['kl_mean']:.1e} | {100 * r['top1']:.1f}% | {r['exp_abs_dlogp']:.4f}"
                     f" | {base} | {ratio} | [md]({r['report']}) |")  # fmt: skip
    path = root / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> int:
    if "--" in argv:
        ours, report = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    else:
        ours, report = argv, []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--admit", action="append", default=[], metavar="BACKEND", help="backend to admit (repeatable)")
    p.add_argument("--arch-entry", action="append", default=[], metavar="NAME",
                   help=f"architecture whose entry admits them (repeatable; default: {', '.join(FRONTIER)})")  # fmt: skip
    p.add_argument("--summarize", metavar="DIR", help="write DIR/summary.md from the reports under DIR; run nothing")
    args = p.parse_args(ours)
    if args.summarize:
        print(write_summary(Path(args.summarize)))
        return 0
    from mcore_zoo.cli import main as zoo_main
    from mcore_zoo.registry import get_registry

    if args.admit:
        record = get_registry().register(admitting_plugin(args.arch_entry or list(FRONTIER), args.admit),
                                         "admit-backends", distribution="bench/gpu/frontier_parity.py")  # fmt: skip
        if record.status != "loaded":
            print(f"frontier_parity: the admitting plugin did not load: {record.status} {record.error}", file=sys.stderr)
            return 2
    return zoo_main(["parity-report", *report])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
