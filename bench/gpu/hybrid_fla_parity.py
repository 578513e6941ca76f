"""``mcore-zoo parity-report`` of a gated DeltaNet model with the zoo on flash-linear-attention's kernels
and transformers on its torch fallbacks, in one process.

transformers switches its own gated DeltaNet math to fla when ``fla`` is importable: its modeling
modules (``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``) pick ``chunk_gated_delta_rule`` (and, in
older releases, fla's gated norm and ``causal_conv1d``'s kernels) when they are imported. The
reference this script compares against is HF eager on the torch path, so those modules are imported
first with ``fla`` and ``causal_conv1d`` hidden (``sys.modules[name] = None``: an import of them
fails, ``importlib.util.find_spec`` answers ``None``), then the packages are visible again for the
zoo, whose layers load fla lazily (``linear_attention_kernel``). What each side ran is recorded:
``hf_kernels`` (per modeling module, the implementation behind each gated DeltaNet entry point) and
``zoo_kernels`` (the fla version the zoo loads, or why it cannot) are added to every report this run
writes under ``--out`` (JSON key and a Markdown section) and to ``OUT/hybrid_fla_kernels.json``. The
run fails (exit 3) if transformers resolved any entry point to fla or causal-conv1d.

``--admit BACKEND`` admits a backend a plugin does not declare for this process only, as
``frontier_parity.py`` does (the plugins declare ``te`` for these models since 2026-11-27).

    PYTHONPATH=src:$FLA_DIR python bench/gpu/hybrid_fla_parity.py -- \\
        --config tests/fixtures/configs/qwen3-next-80b-a3b.json --random-weights --set num_hidden_layers=4 \\
        --backend te --knob linear_attention_kernel=fla --dtype bfloat16 --device cuda --out OUT

On the CPU (no fla, torch kernels) the same command with ``--backend local --device cpu --scale tiny``
and without the knob checks the arguments, the hiding and the records. ``--kernels-only`` records
and checks the kernels and runs no report.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

HIDDEN = ("fla", "causal_conv1d")
MODELING = ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe")
#: transformers' gated DeltaNet entry points (this release's names and older ones)
ENTRY_POINTS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "chunk_gated_delta_rule",
                "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update", "FusedRMSNormGated",
                "is_fast_path_available")  # fmt: skip
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")  # fmt: skip


@contextlib.contextmanager
def hidden_packages(names: tuple = HIDDEN) -> Iterator[None]:
    """``names`` (and their submodules) unimportable inside the block; importable again after it."""
    saved = {m: sys.modules[m] for m in list(sys.modules) if m.split(".")[0] in names}
    for m in saved:
        del sys.modules[m]
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in names:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
        sys.modules.update(saved)


def implementation(obj: Any) -> str:
    """Where ``obj`` (a function transformers may have wrapped) comes from: ``module.name``."""
    if obj is None or isinstance(obj, bool):
        return repr(obj)
    closure = inspect.getclosurevars(obj).nonlocals if inspect.isfunction(obj) else {}
    target = closure.get("implementation", obj)  # use_kernel_func_from_hub_with_fallback's choice
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def hf_kernels(hide: bool = True) -> dict[str, dict[str, str]]:
    """Import transformers' gated DeltaNet modeling modules with fla hidden (``hide=False``: as
    installed); per module, what each entry point resolved to."""
    record = {}
    with hidden_packages() if hide else contextlib.nullcontext():
        for name in MODELING:
            try:
                module = importlib.import_module(f"transformers.models.{name}")
            except ImportError as exc:
                record[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            record[name] = {e: implementation(getattr(module, e)) for e in ENTRY_POINTS if hasattr(module, e)}
    return record


def fla_entries(record: dict[str, dict[str, str]]) -> list[str]:
    """Entry points of ``record`` that resolved to fla or causal-conv1d (or said the fast path is on)."""
    return [f"{m}.{e} = {v}" for m, entries in record.items() for e, v in entries.items()
            if v.split(".")[0] in HIDDEN or (e == "is_fast_path_available" and v == "True")]  # fmt: skip


def zoo_kernels() -> dict[str, str]:
    """The fla kernels the zoo's gated DeltaNet layer would load here, or why it cannot."""
    from mcore_zoo.errors import ZooError
    from mcore_zoo.families.gated_deltanet.kernels import load_fla

    try:
        kernels = load_fla()
    except ZooError as exc:
        return {"fla": "unavailable", "reason": str(exc)}
    return {"fla": kernels.version, "chunk_gated_delta_rule": implementation(kernels.chunk_gated_delta_rule),
            "causal_conv1d": implementation(kernels.causal_conv1d)}  # fmt: skip


def annotate_reports(out: Path, since: float, kernels: dict[str, Any]) -> list[Path]:
    """Add ``kernels`` to every parity report written under ``out`` since ``since``."""
    done = []
    for path in sorted(out.glob("*.json")):
        if path.stat().st_mtime < since:
            continue
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or "comparisons" not in report:
            continue
        report.update(kernels)
        path.write_text(json.dumps(report, indent=2) + "\n")
        md = path.with_suffix(".md")
        if md.exists():
            lines = ["", "## Gated DeltaNet kernels", "",
                     "HF (eager and sdpa) imported with flash-linear-attention hidden (`bench/gpu/hybrid_fla_parity.py`):", ""]  # fmt: skip
            for module, entries in kernels["hf_kernels"].items():
                lines += [f"- `{module}`: " + ", ".join(f"`{e}` -> `{v}`" for e, v in entries.items())]
            lines += ["", "The zoo: " + ", ".join(f"{k} `{v}`" for k, v in kernels["zoo_kernels"].items()), ""]
            md.write_text(md.read_text() + "\n".join(lines))
        done.append(path)
    return done


def main(argv: list[str]) -> int:
    ours, report = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--admit", action="append", default=[], metavar="BACKEND", help="backend to admit (repeatable)")
    p.add_argument("--kernels-only", metavar="JSON", help="record and check the kernels into JSON; run no report")
    args = p.parse_args(ours)
    kernels = {"hf_kernels": hf_kernels()}
    kernels["zoo_kernels"] = zoo_kernels()
    print(json.dumps(kernels, indent=1), flush=True)
    leaked = fla_entries(kernels["hf_kernels"])
    if args.kernels_only:
        Path(args.kernels_only).write_text(json.dumps(dict(kernels, hf_on_fla=leaked), indent=2) + "\n")
    if leaked:
        print("hybrid_fla_parity: transformers resolved to fla / causal-conv1d: " + "; ".join(leaked), file=sys.stderr)
        return 3
    if args.kernels_only:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from frontier_parity import admitting_plugin

    from mcore_zoo.cli import main as zoo_main
    from mcore_zoo.registry import get_registry

    if args.admit:
        record = get_registry().register(admitting_plugin(list(ARCHITECTURES), args.admit), "admit-backends",
                                         distribution="bench/gpu/hybrid_fla_parity.py")  # fmt: skip
        if record.status != "loaded":
            print(f"hybrid_fla_parity: the admitting plugin did not load: {record.status} {record.error}", file=sys.stderr)
            return 2
    out = Path(report[report.index("--out") + 1]) if "--out" in report else None
    start = time.time() - 1
    status = zoo_main(["parity-report", *report])
    if out is not None and out.is_dir():
        (out / "hybrid_fla_kernels.json").write_text(json.dumps(kernels, indent=2) + "\n")
        for path in annotate_reports(out, start, kernels):
            print(f"hybrid_fla_parity: kernels recorded in {path}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
