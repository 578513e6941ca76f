"""The parity run: resolve options, run the engines, compare, build the report dict.

:func:`run_parity` is what ``mcore-zoo parity-report`` calls; it is usable from Python as well::

    from mcore_zoo.parity.harness import ParityOptions, run_parity
    report = run_parity(ParityOptions(arch="Qwen3ForCausalLM", bitwise=True))
    report["verdict"]   # "pass" | "fail"

Comparisons (each a row of the report):

=============  =====================================  ========  ====================================
role           candidate vs reference                 gating    criterion
=============  =====================================  ========  ====================================
parity         mcore (``--backend``) vs HF             yes       bitwise with ``--bitwise``, else
                                                                 the dtype's tolerances
baseline       HF sdpa vs HF eager (or the reverse)    no        shows HF's own kernel noise
invariance     batch 1 vs N (mcore, same format)       yes       as parity
invariance     BSHD vs THD (mcore)                     yes       tolerance (padding changes the
                                                                 reduction length of attention GEMMs)
invariance     TP k vs TP 1 (mcore)                    yes       tolerance (row-parallel layers sum
                                                                 partial products in another order)
rollout        vLLM vs HF                              yes       tolerance (other kernels)
rollout        vLLM vs mcore                           no        the trainer / rollout mismatch
ablation       mcore, one numerics knob flipped, vs    no        what that knob costs (``--ablation``)
               HF
=============  =====================================  ========  ====================================
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..errors import ZooError
from ..numerics.metrics import (
    DTYPES,
    Tolerance,
    check_tolerance,
    default_tolerance,
    first_divergent_site,
    layer_metrics,
    logprob_metrics,
)
from .reference import supports_attention
from .runners import McoreSpec, RunResult, run_hf, run_mcore, run_vllm

SCHEMA_VERSION = 1
DEFAULT_LENGTHS = (61, 17, 40, 8)


@dataclass
class ParityOptions:
    """Everything a parity run takes (the CLI flags, one to one; see ``mcore-zoo parity-report -h``)."""

    arch: Optional[str] = None
    model: Optional[str] = None
    config: Optional[str] = None
    random_weights: bool = False
    scale: Optional[str] = None
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    tokens: str = "auto"
    dtype: Optional[str] = None
    device: Optional[str] = None
    backend: str = "auto"
    numerics: Optional[str] = None
    knobs: dict[str, Any] = field(default_factory=dict)
    ignore_fields: dict[str, str] = field(default_factory=dict)
    seq_format: str = "auto"
    tp: int = 1
    reference: str = "eager"
    baseline: bool = True
    layers: bool = True
    bitwise: bool = False
    tolerances: dict[str, Optional[float]] = field(default_factory=dict)
    invariance: bool = False
    invariance_tp: Optional[int] = None
    ablation: bool = False
    vllm_python: Optional[str] = None
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    worst: int = 10
    work_dir: Optional[str] = None
    trust_remote_code: bool = False
    image_size: Optional[int] = None
    images: int = 1
    command: Optional[str] = None


class Progress:
    """Stage lines on stderr (``[parity 3.2s] building ...``); silent when disabled."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}

    def stage(self, name: str) -> "_Stage":
        return _Stage(self, name)

    def note(self, text: str) -> None:
        if self.enabled:
            print(f"[parity {time.perf_counter() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)


class _Stage:
    def __init__(self, progress: Progress, name: str) -> None:
        self.progress, self.name = progress, name

    def __enter__(self) -> "_Stage":
        self.start = time.perf_counter()
        self.progress.note(f"{self.name} ...")
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        seconds = time.perf_counter() - self.start
        self.progress.timings[self.name] = round(seconds, 3)
        if exc_type is None:
            self.progress.note(f"{self.name}: done in {seconds:.1f}s")


# ---------------------------------------------------------------------------- resolution
def _have_te() -> bool:
    from ..specs.gpt import have_transformer_engine

    return have_transformer_engine()


def resolve(opts: ParityOptions) -> dict[str, Any]:
    """Fill the ``auto`` / unset options: device, dtype, backend, numerics profile, sequence format."""
    from ..numerics.profiles import get_profile

    cuda = torch.cuda.is_available()
    device = opts.device or ("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise ZooError("--device cuda: no CUDA device is visible")
    if device not in ("cpu", "cuda"):
        raise ZooError(f"--device {device!r}: use cpu or cuda")
    dtype_name = opts.dtype or ("bfloat16" if device == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ZooError(f"--dtype {dtype_name!r}: use one of {sorted(DTYPES)}")
    backend = opts.backend
    if backend == "auto":
        backend = "te" if device == "cuda" and _have_te() else "portable"
    if backend not in ("te", "local", "portable"):
        raise ZooError(f"--backend {backend!r}: use te, local, portable or auto")
    if backend == "te" and device != "cuda":
        raise ZooError("--backend te needs --device cuda (Transformer Engine runs on GPUs only)")
    if opts.reference not in ("eager", "sdpa"):
        raise ZooError(f"--reference {opts.reference!r}: use eager or sdpa")
    profile_name = opts.numerics
    if profile_name is None:
        profile_name = ("hf-exact" if opts.reference == "eager" else "hf-exact-sdpa") if opts.bitwise else "default"
    profile = get_profile(profile_name)
    if opts.knobs:
        profile = profile.with_knobs(**opts.knobs)
    profile = profile.for_device(device == "cuda")
    seq_format = opts.seq_format
    if seq_format == "auto":
        seq_format = "bshd" if backend == "local" and profile.attention == "backend" else "thd"
    if seq_format not in ("thd", "bshd"):
        raise ZooError(f"--seq-format {seq_format!r}: use thd, bshd or auto")
    if seq_format == "thd" and backend == "local" and profile.attention == "backend":
        raise ZooError("--backend local with Megatron-Core's own attention cannot run THD: use --seq-format bshd,"
                       " --backend portable, or a numerics profile with a zoo attention kernel (hf-exact)")  # fmt: skip
    if opts.tp < 1 or (opts.invariance_tp is not None and opts.invariance_tp < 2):
        raise ZooError("--tp must be >= 1 and --invariance-tp >= 2")
    tol = default_tolerance(dtype_name).with_overrides(**opts.tolerances)
    return {"device": device, "dtype_name": dtype_name, "dtype": DTYPES[dtype_name], "backend": backend,
            "profile": profile, "seq_format": seq_format, "tolerance": tol}  # fmt: skip


# ---------------------------------------------------------------------------- comparisons
def compare(
    ref: RunResult,
    cand: RunResult,
    *,
    role: str,
    gating: bool,
    criterion: str,
    tol: Tolerance,
    worst: int,
    device: Optional[str] = None,
) -> dict[str, Any]:
    """One comparison row of the report (metrics, per-site table, verdict of this row)."""
    metrics = logprob_metrics(ref.predictions, cand.predictions, worst=worst,
                              device=torch.device(device) if device else None)  # fmt: skip
    layers = []
    if ref.hidden and cand.hidden:
        layers = layer_metrics(ref.hidden, cand.hidden, bitwise=criterion == "bitwise", hidden_rel=tol.hidden_rel)
        if ref.predictions.logits is not None and cand.predictions.logits is not None:
            from ..numerics.metrics import site_metrics

            row = site_metrics(ref.predictions.logits, cand.predictions.logits)
            row["flagged"] = (not row["bitwise_equal"]) if criterion == "bitwise" else row["rel_mean_abs"] > tol.hidden_rel
            layers.append({"site": "logits", **row})
    if criterion == "bitwise":
        failures = [] if metrics["bitwise_equal"] else ["not bitwise equal"]
    else:
        failures = check_tolerance(metrics, tol)
    worst_tokens = metrics.pop("worst_tokens")
    histogram = metrics.pop("histogram")
    return {
        "name": f"{cand.label} vs {ref.label}",
        "role": role,
        "reference": ref.label,
        "candidate": cand.label,
        "gating": gating,
        "criterion": criterion,
        "passed": not failures,
        "failures": failures,
        "metrics": metrics,
        "first_divergent_site": first_divergent_site(layers) if layers else None,
        "layers": layers,
        "worst_tokens": worst_tokens,
        "histogram": histogram,
    }


# ---------------------------------------------------------------------------- the run
def run_parity(opts: ParityOptions, progress: Optional[Progress] = None) -> dict[str, Any]:
    """Run every engine the options ask for and return the report dict (schema in docs/parity)."""
    progress = progress or Progress(enabled=False)
    started = datetime.datetime.now(datetime.timezone.utc)
    import megatron.core  # noqa: F401 - before transformers touches CUDA: Transformer Engine (which
    # megatron.core imports) must load its cuDNN first where a second, system cuDNN also exists
    r = resolve(opts)
    tmp = None
    if opts.work_dir:
        work = Path(opts.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="mcore-zoo-parity-")
        work = Path(tmp.name)
    try:
        return _run(opts, r, work, progress, started)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(opts: ParityOptions, r: dict[str, Any], work: Path, progress: Progress, started: Any) -> dict[str, Any]:
    from .inputs import add_images, language_model_fields, make_sequences, prepare_model

    device, dtype, tol = r["device"], r["dtype"], r["tolerance"]
    with progress.stage("model"):
        source = prepare_model(arch=opts.arch, model=opts.model, config=opts.config,
                               random_weights=opts.random_weights or bool(opts.arch), scale=opts.scale,
                               settings=opts.settings, dtype=dtype, work_dir=work, seed=opts.seed)  # fmt: skip
        progress.note(f"model: {source.architecture.name} from {source.origin}")
    vocab = int(language_model_fields(source.config)["vocab_size"])
    sequences, token_info = make_sequences(list(opts.lengths), vocab, tokenizer=source.tokenizer, mode=opts.tokens,
                                           seed=opts.seed, trust_remote_code=opts.trust_remote_code)  # fmt: skip
    decoder = token_info.pop("_decode", None)
    vision_inputs = None
    tower = source.architecture.config_from_hf(source.config, ignore_fields=opts.ignore_fields or None).vision
    if tower is not None and opts.images == 0:  # text only: the language model alone, as transformers runs text
        token_info["vision"] = {"images": 0, "text_only": True}
    elif tower is not None:  # a vision-language model whose tower the zoo builds: images in each sequence
        if opts.vllm_python:
            raise ZooError(f"{source.architecture.name}: vLLM runs of vision-language models with images are not built"
                           " yet (--images 0 runs the text alone)")  # fmt: skip
        sequences, vision_inputs, token_info["vision"] = add_images(sequences, tower, seed=opts.seed, side=opts.image_size,
                                                                    images=opts.images)  # fmt: skip
    criterion = "bitwise" if opts.bitwise else "tolerance"
    runs: dict[str, RunResult] = {}
    comparisons: list[dict[str, Any]] = []
    cmp_device = device if device == "cuda" else None

    def add(ref: RunResult, cand: RunResult, role: str, gating: bool, crit: str) -> None:
        comparisons.append(compare(ref, cand, role=role, gating=gating, criterion=crit, tol=tol, worst=opts.worst,
                                   device=cmp_device))  # fmt: skip

    # MoE: the reference's experts kernel is the one the mcore model's combine follows
    experts = r["profile"].moe_experts if r["profile"].router == "hf" and _is_moe(source, opts.ignore_fields) else None
    with progress.stage(f"transformers ({opts.reference})"):
        ref = run_hf(source.architecture, source.checkpoint, sequences, dtype=dtype,
                     attn_implementation=opts.reference, device=device, capture=opts.layers,
                     experts_implementation=experts, vision_inputs=vision_inputs)  # fmt: skip
        runs[ref.label] = ref
    other = "sdpa" if opts.reference == "eager" else "eager"
    if opts.baseline and supports_attention(source.architecture, other):
        # first: its gap may relax the tolerances of every other comparison
        with progress.stage(f"transformers ({other}) baseline"):
            base = run_hf(source.architecture, source.checkpoint, sequences, dtype=dtype,
                          attn_implementation=other, device=device, capture=opts.layers,
                          experts_implementation=experts, vision_inputs=vision_inputs)  # fmt: skip
            runs[base.label] = base
        add(ref, base, "baseline", False, "tolerance")
        tol = tol.relaxed_by(comparisons[-1]["metrics"]).with_overrides(**opts.tolerances)  # --tol: as given
    spec = McoreSpec(str(source.checkpoint), r["backend"], r["profile"], dtype, r["seq_format"], opts.tp, device,
                     ignore_fields=tuple(sorted(opts.ignore_fields.items())))  # fmt: skip
    export_dir = work / "export" if opts.vllm_python else None
    with progress.stage(f"megatron-core ({spec.label}, numerics {r['profile'].name})"):
        main = run_mcore(spec, sequences, capture=opts.layers, export_dir=export_dir, vision_inputs=vision_inputs)
        runs[main.label] = main
    comparisons.insert(0, compare(ref, main, role="parity", gating=True, criterion=criterion, tol=tol,
                                  worst=opts.worst, device=cmp_device))  # fmt: skip
    export = (check_export(source.checkpoint, export_dir, dtype, not_exported=main.info.get("not_exported", ()))
              if export_dir is not None else None)  # fmt: skip
    if opts.invariance or opts.invariance_tp:
        # a right-padded batch changes the reduction lengths of the attention GEMMs: never bitwise
        variants = [(replace(spec, seq_format="bshd" if spec.seq_format == "thd" else "thd"), "tolerance")]
        if spec.backend == "local" and r["profile"].attention == "backend":
            variants = []  # local's own attention has no THD: nothing to compare the format with
        if vision_inputs is not None:
            variants = []  # images run in THD packs only: no other format to compare with
        variants.append((replace(spec, per_sequence=True), criterion))
        if opts.invariance_tp:
            tp_other = opts.invariance_tp if spec.tp == 1 else 1
            variants.append((replace(spec, tp=tp_other), "tolerance"))
        for variant, crit in variants:
            with progress.stage(f"megatron-core invariance ({variant.label})"):
                result = run_mcore(variant, sequences, capture=opts.layers, vision_inputs=vision_inputs)
                runs[result.label] = result
            add(main, result, "invariance", True, crit)
    if opts.ablation:
        for knob, value, profile in ablation_profiles(r["profile"], spec.backend, source.architecture, source.config, device,
                                                     opts.ignore_fields):  # fmt: skip
            variant = replace(spec, numerics=profile, tag=f"{knob}={value}")
            if spec.backend == "local" and profile.attention == "backend":
                # mcore's own attention runs BSHD only: one sequence per forward, so no padding
                variant = replace(variant, seq_format="bshd", per_sequence=True)
                if vision_inputs is not None:
                    continue  # images run in THD packs only
            with progress.stage(f"megatron-core ablation ({knob}={value})"):
                result = run_mcore(variant, sequences, capture=False, vision_inputs=vision_inputs)
                runs[result.label] = result
            add(ref, result, "ablation", False, criterion)
            comparisons[-1]["knob"] = {"name": knob, "value": value, "from": getattr(r["profile"], knob)}
    if opts.vllm_python:
        if device == "cuda":
            torch.cuda.empty_cache()
        kwargs = dict(opts.vllm_kwargs)
        if device == "cuda":
            kwargs.setdefault("gpu_memory_utilization", 0.5)
        with progress.stage("vLLM (subprocess, weights exported from the mcore model)"):
            vllm = run_vllm(opts.vllm_python, export_dir, sequences, dtype=dtype, vocab_size=vocab,
                            work_dir=work / "vllm", llm_kwargs=kwargs)  # fmt: skip
            runs[vllm.label] = vllm
        add(ref, vllm, "rollout", True, "tolerance")
        add(main, vllm, "rollout", False, "tolerance")
    if decoder is not None:
        _decode_worst(comparisons, sequences, decoder)
    notes = _notes(opts, r, source, token_info, runs, device)
    gating = [c for c in comparisons if c["gating"]]
    export_ok = export is None or export["bitwise_equal_to_checkpoint"]
    verdict = "pass" if all(c["passed"] for c in gating) and export_ok else "fail"
    from .environment import environment

    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "mcore-zoo parity-report", "version": _zoo_version()},
        "created": started.isoformat(timespec="seconds"),
        "command": opts.command or "",
        "verdict": verdict,
        "mode": criterion,
        "model": source.describe(),
        "inputs": token_info,
        "dtype": r["dtype_name"],
        "device": device,
        "tolerances": tol.as_dict(),
        "tolerance_floor": r["tolerance"].as_dict(),
        "runs": {label: run.info for label, run in runs.items()},
        "export": export,
        "notes": notes,
        "comparisons": comparisons,
        "environment": environment(device),
        "timings": dict(progress.timings),
    }


#: knob -> backends where flipping it changes the built model
_KNOB_BACKENDS = {
    "norm": ("te", "local", "portable"),
    "rope_freqs": ("te", "local", "portable"),
    "rope_fusion": ("te",),
    "bias_activation_fusion": ("te", "local", "portable"),
    "masked_softmax_fusion": ("local",),
    "attention": ("te", "local", "portable"),
    "fuse_norm_into_linear": ("te",),
    "linear_bias": ("local", "portable"),
}


def _is_moe(source: Any, ignore_fields: dict[str, str]) -> bool:
    """Whether the run's model has MoE layers (its HF config converted as the mcore build converts
    it; a config that does not convert is reported by that build)."""
    try:
        return source.architecture.config_from_hf(source.config, ignore_fields=ignore_fields).moe is not None
    except ZooError:
        return False


def ablation_profiles(
    profile: Any, backend: str, architecture: Any, config: dict[str, Any], device: str,
    ignore_fields: Optional[dict[str, str]] = None,
) -> list[tuple[str, Any, Any]]:
    """``(knob, value, profile)`` for every knob where ``default`` and ``hf-exact`` differ, flipped
    alone from ``profile`` to the other profile's value; knobs that cannot change this model on
    this backend and device are left out."""
    from ..config.transformer import fused_softmax_available
    from ..numerics.profiles import get_profile

    cuda = device == "cuda"
    other = get_profile("default" if profile.norm == "hf" else "hf-exact").for_device(cuda)
    arch = architecture.config_from_hf(config, ignore_fields=ignore_fields)
    out = []
    for knob, backends in _KNOB_BACKENDS.items():
        value = getattr(other, knob)
        if value == getattr(profile, knob) or backend not in backends:
            continue
        flipped = profile.with_knobs(**{knob: value}).for_device(cuda)
        if flipped.knobs() == profile.knobs():
            continue  # the device switches it off anyway
        if knob == "rope_freqs" and arch.rope.rope_type != "default":
            continue  # mcore cannot compute these frequencies
        if knob == "masked_softmax_fusion" and (flipped.attention != "backend" or not fused_softmax_available()):
            continue
        if knob == "linear_bias" and not (arch.qkv_bias or arch.mlp_bias or arch.attn_output_bias):
            continue
        if knob == "fuse_norm_into_linear" and flipped.norm != "mcore":
            continue
        out.append((knob, value, flipped))
    return out


def _notes(opts: ParityOptions, r: dict[str, Any], source: Any, token_info: dict[str, Any],
           runs: dict[str, RunResult], device: str) -> list[str]:  # fmt: skip
    """Caveats of this run, shown under the verdict."""
    notes = [token_info["note"]] if token_info.get("note") else []
    from ..provenance import provider_note

    provider = provider_note(source.architecture)
    if provider:
        notes.insert(0, provider)
    from ..provenance import amendment_notes

    try:
        amended = source.architecture.config_from_hf(source.config, ignore_fields=opts.ignore_fields)
    except Exception:  # noqa: BLE001 - the run itself reports a config that does not convert
        amended = None
    if amended is not None:  # what an extension changed in a built-in's (or a plugin's) conversion
        at = 1 if provider else 0
        notes[at:at] = amendment_notes(amended)
    for name, reason in sorted(opts.ignore_fields.items()):
        notes.append(f"HF config field {name!r} ignored on request (--ignore-field): {reason}")
    other = "sdpa" if opts.reference == "eager" else "eager"
    if opts.baseline and not supports_attention(source.architecture, other):
        notes.append(f"no HF {other}-vs-{opts.reference} baseline: transformers' {source.architecture.name} has no"
                     f" {other} attention; tolerances are the defaults")  # fmt: skip
    if opts.bitwise and device == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":0:0":
        notes.append("cuBLAS split-K is allowed (CUBLAS_WORKSPACE_CONFIG is not ':0:0'): a THD pack multiplies"
                     " more rows than each sequence alone and some shapes then sum in another order; start"
                     " the process with CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 for bitwise THD.")  # fmt: skip
    odd: dict[str, list[str]] = {}
    for label, run in runs.items():
        if run.info.get("params_not_in_dtype"):
            listed = ", ".join(f"{name} ({dt})" for name, dt in sorted(run.info["params_not_in_dtype"].items()))
            odd.setdefault(listed, []).append(label)
    for listed, labels in odd.items():
        notes.append(f"{', '.join(labels)}: parameters not in {r['dtype_name']}: {listed}. A trainer's"
                     " mixed-precision wrapper may cast them; this run measures the model as built.")  # fmt: skip
    if source.random_weights and r["dtype_name"] != "float32" and opts.baseline:
        notes.append("random weights with sharp attention amplify rounding differences layer after layer; the"
                     " baseline row shows how far transformers' own two attention implementations drift apart.")  # fmt: skip
    return notes


def check_export(checkpoint: Path, export_dir: Path, dtype: torch.dtype,
                 not_exported: Sequence[Sequence[str]] = ()) -> dict[str, Any]:
    """Compare the mcore model's HF export (what vLLM loads) with the source checkpoint, tensor by
    tensor (source cast to the run dtype): names must match and values be identical.

    ``not_exported``: ``(regex, reason)`` pairs of the model's weight map for checkpoint tensors it
    ignores by name (e.g. a vision tower that is not built): those are listed under ``left_out``
    with their reason instead of ``missing``; whether the engine needs them is the engine's run to
    show (it fails to load without them)."""
    from ..weights.io import HFCheckpoint

    src, exp = HFCheckpoint(checkpoint), HFCheckpoint(export_dir)
    try:
        ignored = {"lm_head.weight"} if "lm_head.weight" not in exp.keys() else set()
        absent = sorted(src.keys() - exp.keys() - ignored)
        extra = sorted(exp.keys() - src.keys())
        different = sorted(n for n in src.keys() & exp.keys() if not torch.equal(src.read(n).to(dtype), exp.read(n)))
    finally:
        src.close()
        exp.close()
    patterns = [(re.compile(pattern), reason) for pattern, reason in not_exported]
    left_out: dict[str, list[str]] = {}
    missing = []
    for name in absent:
        reason = next((why for pattern, why in patterns if pattern.fullmatch(name)), None)
        if reason is None:
            missing.append(name)
        else:
            left_out.setdefault(reason, []).append(name)
    return {
        "tensors": len(exp.keys()),
        "missing": missing,
        "left_out": left_out,
        "unexpected": extra,
        "different": different,
        "bitwise_equal_to_checkpoint": not (missing or extra or different),
    }


def _decode_worst(comparisons: list[dict[str, Any]], sequences: list[torch.Tensor], tok: Any) -> None:
    for c in comparisons:
        for row in c["worst_tokens"]:
            seq = sequences[row["sequence"]]
            lo = max(0, row["position"] - 6)
            row["context"] = tok.decode(seq[lo : row["position"] + 1].tolist())
            row["next_text"] = tok.decode([row["next_token"]])


def _zoo_version() -> str:
    from .._version import __version__

    return __version__


def command_line(argv: list[str]) -> str:
    return "mcore-zoo " + " ".join(shlex.quote(a) for a in argv)


__all__ = ["ParityOptions", "Progress", "run_parity", "resolve", "compare", "SCHEMA_VERSION"]
