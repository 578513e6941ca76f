"""``mcore-zoo`` command line.

    mcore-zoo plugins [--json]                 plugins, their distributions, load failures
    mcore-zoo list [--json | --markdown]       architectures and who provides them
    mcore-zoo show ARCH | --config PATH        HF field classification, TransformerConfig, weight map
    mcore-zoo convert --hf DIR --out DIR       HF -> Megatron-Core distributed checkpoint
    mcore-zoo convert --mcore DIR --out DIR    and back to HF
    mcore-zoo parity-report --arch ARCH        mcore vs transformers (and vLLM), per token and layer
    mcore-zoo new-plugin NAME --arch HFArch    a plugin package with conformance tests

Exit codes: 0 success, 1 a check failed (parity, conflicts with --strict), 2 usage or load error.
``plugins`` and ``list`` import neither Megatron-Core nor Transformer Engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

from .config.reader import parse_ignore_fields
from .errors import ZooError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _registry() -> Any:
    from .registry import get_registry

    return get_registry()


# ---------------------------------------------------------------------------- plugins / list
def cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry()
    records = sorted(reg.plugins.values(), key=lambda r: (not r.builtin, r.name))
    conflicts = reg.conflicts()
    unused = reg.unclaimed_extensions()
    if args.json:
        print(json.dumps({
            "plugins": [
                {"name": r.name, "module": r.module, "distribution": r.distribution, "version": r.version,
                 "builtin": r.builtin, "status": r.status, "error": r.error, "architectures": r.architectures,
                 "extensions": r.extensions}
                for r in records
            ],
            "conflicts": {a: [c.origin for c in cs] for a, cs in conflicts.items()},
            "unused_extensions": unused,
        }, indent=2))  # fmt: skip
    else:
        rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "ARCHITECTURES", "EXTENDS")]
        for r in records:
            rows.append((r.name, r.distribution, r.version, r.status, ", ".join(r.architectures) or "-",
                         ", ".join(r.extensions) or "-"))  # fmt: skip
        _table(rows)
        for arch, origins in unused.items():
            print(f"\nUNUSED extension(s) of {arch} (no installed plugin provides it): " + "; ".join(origins))
        for r in records:
            if r.status == "failed":
                print(f"\nFAILED {r.origin}:\n  " + (r.error or "").replace("\n", "\n  "))
        for arch, claims in conflicts.items():
            print(f"\nCONFLICT {arch}: claimed by " + "; ".join(c.origin for c in claims))
    bad = bool(conflicts) or any(r.status == "failed" for r in records)
    return EXIT_FAIL if (args.strict and bad) else EXIT_OK


def architecture_rows(reg: Any) -> list[dict[str, Any]]:
    rows = []
    conflicts = reg.conflicts()
    for name in reg.architectures():
        if name in conflicts:
            rows.append({"architecture": name, "conflict": [c.origin for c in conflicts[name]]})
            continue
        a = reg.get(name)
        rows.append({
            "architecture": name,
            "model_type": a.entry.model_type,
            "plugin": a.plugin,
            "distribution": a.distribution,
            "version": a.version,
            "backends": list(a.entry.backends),
            "description": a.entry.description,
            "overrides": list(a.overridden),
        })  # fmt: skip
    return rows


def markdown_architectures(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# Architectures",
        "",
        "Generated from the plugin registry by `mcore-zoo list --markdown`, built-in plugins only:",
        "`MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD=1 mcore-zoo list --markdown > docs/architectures.md`",
        "(a test fails when this file is stale).",
        "",
        "| architecture | model_type | backends | plugin | distribution | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "conflict" in r:
            lines.append(f"| `{r['architecture']}` | | | CONFLICT | {'; '.join(r['conflict'])} | |")
            continue
        lines.append(
            f"| `{r['architecture']}` | `{r['model_type']}` | {', '.join(r['backends'])} | {r['plugin']} "
            f"| {r['distribution']} | {r['description']} |"
        )
    lines += [
        "",
        "More architectures come from plugin packages: `pip install` one and it appears in `mcore-zoo list`.",
        "[adding-a-model.md](adding-a-model.md) shows how to write one; [examples/phi3](../examples/phi3)",
        "is a complete out-of-tree plugin (Phi-3).",
    ]
    return "\n".join(lines) + "\n"


def cmd_list(args: argparse.Namespace) -> int:
    reg = _registry()
    rows = architecture_rows(reg)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        sys.stdout.write(markdown_architectures(rows))
    else:
        table = [("ARCHITECTURE", "PLUGIN", "DISTRIBUTION", "BACKENDS", "DESCRIPTION")]
        for r in rows:
            if "conflict" in r:
                table.append((r["architecture"], "CONFLICT", "; ".join(r["conflict"]), "", ""))
            else:
                table.append((r["architecture"], r["plugin"], f"{r['distribution']} {r['version']}",
                              ",".join(r["backends"]), r["description"]))  # fmt: skip
        _table(table)
        failures = reg.failures()
        if failures:
            print(f"\n{len(failures)} plugin(s) failed to load (see `mcore-zoo plugins`).")
    return EXIT_FAIL if (args.strict and reg.conflicts()) else EXIT_OK


# ---------------------------------------------------------------------------- show
def cmd_show(args: argparse.Namespace) -> int:
    from .build import prepare
    from .placement import Parallelism
    from .config.transformer import gpt_model_kwargs, transformer_config_kwargs
    from .numerics.profiles import get_profile

    reg = _registry()
    if args.config:
        source: Any = args.config
        architecture = reg.lookup(args.config)
    elif args.arch:
        architecture = reg.get(args.arch)
        source = architecture.example_config()
    else:
        raise ZooError("show needs ARCH or --config PATH")
    parallel = Parallelism(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                           sequence_parallel=args.sequence_parallel)  # fmt: skip
    from .cpu_shim import activate

    activate()
    plan = prepare(
        source, architecture=architecture, backend=args.backend, numerics=get_profile(args.numerics), parallel=parallel,
        ignore_fields=parse_ignore_fields(args.ignore_field),
    )
    arch = plan.arch_config
    wmap = architecture.weight_map(arch)
    tc = {k: getattr(plan.transformer_config, k) for k in transformer_config_kwargs(arch, plan.options)}
    gm = gpt_model_kwargs(arch)
    rules = [
        {"mcore": r.mcore, "hf": [s.hf for s in r.sources], "tp_axis": [s.tp_axis for s in r.sources],
         "select": [list(s.select) if s.select else None for s in r.sources],
         "transform": str(r.transform), "export": r.export, "note": r.note}
        for r in wmap.rules
    ]  # fmt: skip
    if args.json:
        print(json.dumps({
            "architecture": arch.architecture,
            "provided_by": architecture.origin,
            "contributions": architecture.provenance(),
            "fields": arch.fields.as_dict()["fields"],
            "transformer_config": {k: _jsonable(v) for k, v in tc.items()},
            "gpt_model": {k: _jsonable(v) for k, v in gm.items()},
            "rope": arch.rope.as_dict(),
            "moe": _jsonable(dataclasses.asdict(arch.moe)) if arch.moe is not None else None,
            "mla": _jsonable(dataclasses.asdict(arch.mla)) if arch.mla is not None else None,
            "checkpoint_quantization": _jsonable(dict(arch.checkpoint_quantization)) if arch.checkpoint_quantization else None,
            "weight_rules": rules,
            "ignored_hf_tensors": [{"pattern": p, "reason": r} for p, r in wmap.ignored],
            "copied_hf_tensors": [{"copy": c, "of": src} for c, src in wmap.copies],
        }, indent=2))  # fmt: skip
        return EXIT_OK
    print(f"{arch.architecture}  ({architecture.origin})\n")
    print("HF config fields:")
    print(arch.fields.format_table())
    print("\nTransformerConfig (fields set by the zoo):")
    for k, v in tc.items():
        print(f"  {k} = {_jsonable(v)!r}")
    print("\nGPTModel:")
    for k, v in gm.items():
        print(f"  {k} = {v!r}")
    print("\nWeight map (mcore <- HF):")
    for r in rules:
        axis = ",".join("-" if a is None else str(a) for a in r["tp_axis"])
        sources = [hf if sel is None else f"{hf}[{sel[1]}:{sel[2]}" + (f" of dim {sel[0]}]" if sel[0] else "]")
                   for hf, sel in zip(r["hf"], r["select"])]  # fmt: skip
        print(f"  {r['mcore']}  <-  {', '.join(sources)}  [{r['transform']}; tp_axis {axis}]")
    for pattern, reason in wmap.ignored:
        print(f"  (ignored) {pattern}: {reason}")
    for copy, source in wmap.copies:
        print(f"  (copy) {copy}: of {source}, checked equal on load, written on export")
    return EXIT_OK


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON takes it: containers as lists / objects, a float that is not finite
    as its name (``"-inf"``; ``json.dumps`` would write ``-Infinity``, which JSON has no word for),
    anything else as its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return str(value)


# ---------------------------------------------------------------------------- convert
def cmd_convert(args: argparse.Namespace) -> int:
    from .dist_checkpoint import hf_to_mcore, mcore_to_hf

    if bool(args.hf) == bool(args.mcore):
        raise ZooError("convert needs exactly one of --hf DIR (to mcore) or --mcore DIR (to HF)")
    from .weights.io import parse_size

    try:
        parse_size(args.max_shard_size)
    except ZooError as exc:
        raise ZooError(f"--max-shard-size {args.max_shard_size!r}: {exc}") from None
    if args.hf:
        out = hf_to_mcore(args.hf, args.out, params_dtype=args.dtype, backend=args.backend, overwrite=args.overwrite,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                          ignore_fields=parse_ignore_fields(args.ignore_field))  # fmt: skip
        print(f"wrote Megatron-Core distributed checkpoint {out}")
    else:
        if args.ignore_field:
            raise ZooError("--ignore-field applies to --hf (to mcore); the way back reads the fields the"
                           " conversion ignored from the checkpoint's mcore_zoo.json")  # fmt: skip
        files = mcore_to_hf(args.mcore, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                            trust_pickle=args.trust_pickle)  # fmt: skip
        print(f"wrote HF checkpoint {args.out} ({len(files)} weight file(s))")
    return EXIT_OK


# ---------------------------------------------------------------------------- plumbing
def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def _layout(text: str, allowed: tuple[str, ...]) -> dict[str, int]:
    """``"pp=16,ep=16"`` -> ``{"pp": 16, "ep": 16}`` (keys of ``allowed`` only)."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in allowed or not value.isdigit() or int(value) < 1:
            raise ValueError(f"layout item {item!r}: expected one of {', '.join(k + '=N' for k in allowed)}")
        out[key] = int(value)
    return out


def cmd_refit_time(args: argparse.Namespace) -> int:
    import json

    from .rollout.scale import refit_time_at_scale

    with open(args.config) as f:
        config = json.load(f)
    trainer = _layout(args.trainer, ("tp", "pp", "ep"))
    engine = _layout(args.engine, ("tp", "dp"))
    estimate = refit_time_at_scale(config, trainer_tp=trainer.get("tp", 1), trainer_pp=trainer.get("pp", 1),
                                   trainer_ep=trainer.get("ep", 1), engine_tp=engine.get("tp", 1),
                                   engine_dp=engine.get("dp", 1), link_gbps=args.link_gbps)  # fmt: skip
    if args.json:
        import dataclasses

        print(json.dumps({**dataclasses.asdict(estimate), "seconds": estimate.seconds}, indent=1))
    else:
        print(estimate.describe())
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(prog="mcore-zoo", description="HF architectures on Megatron-Core, with parity proofs.")
    parser.add_argument("--version", action="version", version=f"mcore-zoo {__version__}")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or {ENV_DEBUG}=1)")
    parser.add_argument("-q", "--quiet", dest="global_quiet", action="store_true",
                        help="no progress output; only errors")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list plugins, their distributions and load failures")
    p.add_argument("--json", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 on load failures or conflicts")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("list", help="list architectures")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true")
    g.add_argument("--markdown", action="store_true", help="docs/architectures.md table")
    p.add_argument("--strict", action="store_true", help="exit 1 on conflicts")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="config field classification, TransformerConfig and weight map")
    p.add_argument("arch", nargs="?", help="architecture name (uses its embedded example config)")
    p.add_argument("--config", help="HF config.json or checkpoint directory")
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", default="local", choices=("te", "local", "portable"))
    p.add_argument("--numerics", default="default")
    p.add_argument("--ignore-field", action="append", default=[], metavar="NAME=REASON",
                   help="ignore an HF config field on purpose (e.g. num_nextn_predict_layers=REASON: drop MTP layers)")
    _parallel_args(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("refit-time", help="model of a disaggregated refit's time at scale, from a config.json")
    p.add_argument("--config", required=True, help="HF config.json of the model")
    p.add_argument("--trainer", default="", metavar="pp=16,ep=16[,tp=1]", help="the trainer's layout")
    p.add_argument("--engine", default="", metavar="tp=32[,dp=8]", help="the engine's layout")
    p.add_argument("--link-gbps", type=float, default=45.0, help="GB/s of one GPU's link (default 45)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_refit_time)

    p = sub.add_parser("convert", help="HF <-> Megatron-Core distributed checkpoint")
    p.add_argument("--hf", help="HF checkpoint directory (convert to mcore)")
    p.add_argument("--mcore", help="distributed checkpoint written by mcore-zoo (convert to HF)")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--backend", default="local", choices=("te", "local", "portable"))
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--ignore-field", action="append", default=[], metavar="NAME=REASON",
                   help="--hf: ignore an HF config field on purpose (recorded in the output's mcore_zoo.json)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="--hf: pad the vocabulary to a multiple of N, as a Megatron trainer configured so expects")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-pickle", action="store_true",
                   help="--mcore: unpickle the checkpoint's .metadata without the allow-list (only for a checkpoint you trust)")
    p.set_defaults(func=cmd_convert)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")


def _register_parity_report(sub: Any) -> None:
    from .parity.cli import register

    register(sub)


def _register_new_plugin(sub: Any) -> None:
    from .scaffold import register

    register(sub)


#: Commands contributed by other modules (parity-report, new-plugin): ``register(subparsers)``.
_EXTRA_COMMANDS: list[Callable[[Any], None]] = [_register_parity_report, _register_new_plugin]


#: Set (to anything but 0) to get the traceback of an error, like ``--debug``.
ENV_DEBUG = "MCORE_ZOO_DEBUG"


def describe_error(exc: BaseException) -> str:
    """One message for an error reaching the command line: the zoo's own message, an OS error's
    file and reason, or the exception type and text of anything else."""
    from .errors import OutputExistsError

    if isinstance(exc, OutputExistsError):
        exc.hint = "--overwrite"
        return str(exc)
    if isinstance(exc, ZooError):
        return str(exc)
    if isinstance(exc, OSError):
        if not exc.strerror:  # raised with a message of its own (FileNotFoundError("no HF config at ..."))
            return " ".join(str(exc).split())
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text} (unexpected; run with --debug or {ENV_DEBUG}=1 for the traceback)"


class _OwnRecords:
    """Only mcore-zoo's records reach the terminal (libraries log tracebacks of errors the zoo
    reports itself); ``--debug`` lets everything through."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def filter(self, record: Any) -> bool:
        return self.debug or record.name == "mcore_zoo" or record.name.startswith("mcore_zoo.")


def _stderr_handler_class() -> type:
    import logging

    class StderrHandler(logging.StreamHandler):
        """Writes to whatever ``sys.stderr`` is when a record is emitted."""

        @property  # type: ignore[override]
        def stream(self) -> Any:
            return sys.stderr

        @stream.setter
        def stream(self, value: Any) -> None:
            pass

    return StderrHandler


def _StderrHandler() -> Any:  # noqa: N802 - a factory; logging is imported lazily
    return _stderr_handler_class()()


#: Library loggers with their own handlers whose warnings say nothing about the user's input: a
#: CUDA build of torch run on a CPU machine notes at import that it found no CUDA runtime.
LIBRARY_LOGGERS = ("torch.utils.cpp_extension",)


def _configure_logging(debug: bool, quiet: bool) -> None:
    import logging

    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.ERROR)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_mcore_zoo", False):
            root.removeHandler(handler)
    handler = _StderrHandler()
    handler._mcore_zoo = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("mcore-zoo: %(levelname)s: %(message)s"))
    handler.addFilter(_OwnRecords(debug))
    handler.setLevel(logging.DEBUG if debug else logging.ERROR if quiet else logging.WARNING)
    root.addHandler(handler)
    logging.getLogger("mcore_zoo").setLevel(logging.DEBUG if debug else logging.INFO)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = "mcore-zoo " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    debug = args.debug or os.environ.get(ENV_DEBUG, "0") not in ("", "0")
    args.quiet = args.global_quiet or getattr(args, "quiet", False)  # parity-report has its own --quiet too
    _configure_logging(debug, args.quiet)
    from .progress import set_quiet

    set_quiet(args.quiet)
    try:
        with warnings.catch_warnings():
            if not debug:
                quiet_library_warnings()
            return _run(args, debug)
    finally:
        set_quiet(False)  # in-process callers (tests, scripts) get their default back


#: Warnings of the libraries the CLI drives that say nothing about the user's input: Megatron-Core's
#: and Transformer Engine's import-time notes (TE / Apex not installed, deprecated scopes), and
#: torch's single-process note of ``torch.distributed.checkpoint``. ``--debug`` shows them.
LIBRARY_WARNING_MODULES = r"(megatron|transformer_engine|apex)(\.|$)"
LIBRARY_WARNING_MESSAGES = (r"torch\.distributed is disabled, unavailable or uninitialized",)


def quiet_library_warnings() -> None:
    """Ignore :data:`LIBRARY_WARNING_MODULES` / :data:`LIBRARY_WARNING_MESSAGES` (in the current
    ``warnings.catch_warnings`` scope). The zoo's own warnings stay."""
    warnings.filterwarnings("ignore", module=LIBRARY_WARNING_MODULES)
    for message in LIBRARY_WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=message)


def _run(args: argparse.Namespace, debug: bool) -> int:
    try:
        return int(args.func(args) or EXIT_OK)
    except KeyboardInterrupt:
        print(f"mcore-zoo {args.command}: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # some libraries raise BaseException subclasses (torch's CheckpointException)
        if debug:
            raise
        print(f"mcore-zoo {args.command}: error: {describe_error(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
