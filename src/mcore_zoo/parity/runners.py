"""Runners: run one engine on a list of token sequences and return what the metrics need.

* :func:`run_hf` - the transformers model (``eager`` or ``sdpa``), loaded with
  ``from_pretrained(dtype=...)``, each sequence alone (batch 1: the reference has no padding).
* :func:`run_mcore` - a zoo-built Megatron-Core model (``te`` / ``local`` / ``portable``, THD or
  BSHD, all sequences in one forward or one at a time), in this process or, for TP > 1, on
  ``tp`` spawned ranks (:func:`mcore_zoo.distributed.launch`; gloo on CPU, NCCL with a GPU per rank).
* :func:`run_vllm` - vLLM in *another* Python environment (it pins torch / transformers), as a
  subprocess running :mod:`mcore_zoo.parity.vllm_worker`; prompt log-probs of each sequence.

Each returns a :class:`RunResult`: per-sequence logits (or log-probs), per-site hidden states
(see :mod:`mcore_zoo.numerics.capture`) and an ``info`` dict for the report (backend, modules,
numerics profile and its knobs, fusion flags, timings).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import ZooError
from ..numerics.capture import HiddenCapture, hf_sites, is_vision_site, mcore_sites, to_bsh_hf, to_bsh_mcore
from ..numerics.metrics import Predictions

#: TransformerConfig fields that select fused kernels (shown in the report's environment block)
FUSION_FIELDS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
)


@dataclass
class RunResult:
    """One engine's outputs on the run's sequences.

    Attributes:
        label: short name used in the report (``hf-eager``, ``mcore-te-thd``, ``vllm``...).
        predictions: logits or log-probs per sequence.
        hidden: site -> per-sequence ``[len_i, hidden]`` CPU tensors (empty when not captured).
        info: JSON-ready description (engine, dtype, modules, profile, timings).
    """

    label: str
    predictions: Predictions
    hidden: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------- transformers
def run_hf(
    architecture: Any,
    checkpoint: os.PathLike,
    sequences: list[torch.Tensor],
    *,
    dtype: torch.dtype,
    attn_implementation: str = "eager",
    device: str = "cpu",
    capture: bool = True,
    experts_implementation: Optional[str] = None,
    vision_inputs: Optional[list[Optional[dict]]] = None,
) -> RunResult:
    """The transformers reference, each sequence alone (see module docstring).
    ``experts_implementation``: MoE models, the transformers experts kernel the mcore model's
    ``moe_experts`` knob follows (``None``: transformers' default). ``vision_inputs``: a
    vision-language model's per-sequence images (transformers' processor keys; ``None``: text)."""
    from .reference import load_reference

    t0 = time.perf_counter()
    model = load_reference(architecture, checkpoint, dtype=dtype, attn_implementation=attn_implementation, device=device,
                           experts_implementation=experts_implementation)  # fmt: skip
    t_load = time.perf_counter()
    sites = hf_sites(model) if capture else {}
    logits = []
    with torch.no_grad(), HiddenCapture(sites, to_bsh_hf) as cap:
        for i, seq in enumerate(sequences):
            images = (vision_inputs or [None] * len(sequences))[i]
            out = model(seq[None].to(device), use_cache=False, **_hf_vision_kwargs(model, seq, images, device))
            logits.append(out.logits[0].detach().to("cpu"))
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    t_run = time.perf_counter()
    # a site never run (a vision tower on text-only inputs) has nothing to compare
    hidden = {site: [rec[0] for rec in records] for site, records in cap.records.items() if records}
    label = f"hf-{attn_implementation}"
    info = {
        "engine": "transformers",
        "class": type(model).__name__,
        "attn_implementation": attn_implementation,
        "dtype": _dtype_name(dtype),
        "device": device,
        "batching": "each sequence alone (batch 1)",
        "loaded_with": f"from_pretrained(dtype={_dtype_name(dtype)}, attn_implementation={attn_implementation!r}"
                       + (f", experts_implementation={experts_implementation!r})" if experts_implementation else ")"),
        "seconds": {"load": round(t_load - t0, 3), "forward": round(t_run - t_load, 3)},
    }
    del model
    return RunResult(label, Predictions(tokens=list(sequences), logits=logits), hidden, info)


def _hf_vision_kwargs(model: Any, seq: torch.Tensor, images: Optional[dict], device: str) -> dict[str, Any]:
    """transformers' image arguments of one sequence: the processor's tensors and the token types."""
    if not images:
        return {}
    types = (seq == model.config.image_token_id).int() + 2 * (seq == model.config.video_token_id).int()
    return {"mm_token_type_ids": types[None].to(device), **{k: v.to(device) for k, v in images.items()}}


# ---------------------------------------------------------------------------- Megatron-Core
@dataclass(frozen=True)
class McoreSpec:
    """How to build and run the mcore model of a parity run (picklable: crosses to TP ranks).

    Attributes:
        checkpoint: HF checkpoint directory to build from and load.
        backend: ``te`` / ``local`` / ``portable``.
        numerics: a :class:`~mcore_zoo.numerics.profiles.NumericsProfile`.
        dtype: parameter / compute dtype.
        seq_format: ``thd`` (one packed row) or ``bshd`` (right-padded batch).
        tp: tensor-parallel size (> 1 runs on spawned ranks).
        device: ``cpu`` or ``cuda``.
        per_sequence: run each sequence in its own forward (batch 1) instead of all at once.
        tag: appended to the label (ablation runs: the flipped knob).
        ignore_fields: ``(hf_field, reason)`` pairs the build accepts unclassified
            (``build_model(ignore_fields=)``; ``parity-report --ignore-field``).
    """

    checkpoint: str
    backend: str
    numerics: Any
    dtype: torch.dtype
    seq_format: str = "thd"
    tp: int = 1
    device: str = "cpu"
    per_sequence: bool = False
    tag: str = ""
    ignore_fields: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        parts = ["mcore", self.backend, self.seq_format]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.per_sequence:
            parts.append("b1")
        if self.tag:
            parts.append(self.tag)
        return "-".join(parts)


def _module_name(module: Any) -> str:
    if module is None:
        return "-"
    name = type(module).__name__
    extra = module.extra_repr() if hasattr(module, "extra_repr") else ""
    if name == "PortableAttention" and "kernel=" in extra:
        name += f"(kernel={extra.split('kernel=')[1].split(',')[0]})"
    return name


def describe_mcore(model: torch.nn.Module) -> dict[str, Any]:
    """Backend modules, numerics profile and fusion flags of a zoo-built model."""
    from ..handle import handle_of

    info = handle_of(model)
    layer = model.decoder.layers[0] if len(model.decoder.layers) else None
    attn = getattr(layer, "self_attention", None)
    mlp = getattr(layer, "mlp", None)
    modules = {
        "input_layernorm": _module_name(getattr(layer, "input_layernorm", None)),
        "linear_qkv": _module_name(getattr(attn, "linear_qkv", None)),
        "core_attention": _module_name(getattr(attn, "core_attention", None)),
        "linear_proj": _module_name(getattr(attn, "linear_proj", None)),
        "pre_mlp_layernorm": _module_name(getattr(layer, "pre_mlp_layernorm", None)),
        "linear_fc1": _module_name(getattr(mlp, "linear_fc1", None)),
        "final_layernorm": _module_name(getattr(model.decoder, "final_layernorm", None)),
    }
    if attn is not None and getattr(attn, "q_layernorm", None) is not None:
        modules["q_layernorm"] = _module_name(attn.q_layernorm)
    other_dtypes = {}
    for name, param in model.named_parameters():  # parameters not in the run's params_dtype
        if param.dtype != info.options.params_dtype:
            other_dtypes[re.sub(r"\.\d+\.", ".*.", name)] = _dtype_name(param.dtype)
    return {
        "numerics_profile": info.numerics.name,
        "numerics_knobs": info.numerics.knobs(),
        "fusions": {name: bool(getattr(info.transformer_config, name, False)) for name in FUSION_FIELDS},
        "attention_backend": str(getattr(info.transformer_config, "attention_backend", "")).split(".")[-1],
        "modules": modules,
        "params_not_in_dtype": other_dtypes,
    }


def _split_hidden(records: dict[str, list[torch.Tensor]], spec: McoreSpec, batch: Any, lengths: list[int]) -> dict[str, list[torch.Tensor]]:
    out = {}
    for site, recs in records.items():
        if not recs:  # a site never run (a vision tower on text-only inputs)
            continue
        if is_vision_site(site):  # one record per tower call (a sequence with images), as transformers'
            out[site] = [rec[0] for rec in recs]
        elif spec.per_sequence:  # one record per sequence, each [1, padded len, h]
            out[site] = [rec[0, :n] for rec, n in zip(recs, lengths)]
        elif spec.seq_format == "thd":
            (rec,) = recs
            out[site] = [t.clone() for t in batch.unpack(rec)]
        else:
            (rec,) = recs
            out[site] = [rec[i, :n].clone() for i, n in enumerate(lengths)]
    return out


def _run_mcore_here(spec: McoreSpec, sequences: list[torch.Tensor], capture: bool, export_dir: Optional[str],
                    vision_inputs: Optional[list[Optional[dict]]] = None) -> Optional[RunResult]:  # fmt: skip
    """Build, run and (optionally) export in this process; returns None on TP ranks other than 0."""
    import mcore_zoo
    from ..packing import alignment_for, pack_sequences
    from ..handle import handle_of
    from ..parallel import ensure_model_parallel
    from ..placement import Parallelism

    ensure_model_parallel(Parallelism(tp=spec.tp))
    t0 = time.perf_counter()
    model = mcore_zoo.build_model(
        spec.checkpoint, backend=spec.backend, numerics=spec.numerics, params_dtype=spec.dtype,
        load=spec.checkpoint, device=spec.device, ignore_fields=dict(spec.ignore_fields) or None,
    ).eval()  # fmt: skip
    t_load = time.perf_counter()
    lengths = [int(s.numel()) for s in sequences]
    batch = pack_sequences(sequences, align=alignment_for(spec.tp))
    sites = mcore_sites(model) if capture else {}
    with torch.no_grad(), HiddenCapture(sites, to_bsh_mcore) as cap:
        images = {} if vision_inputs is None else {"vision_inputs": vision_inputs}
        if spec.per_sequence:
            logits = [mcore_zoo.packed_forward(model, [s], seq_format=spec.seq_format, return_logprobs=False,
                                               **({"vision_inputs": [vision_inputs[i]]} if images else {})).logits[0]
                      for i, s in enumerate(sequences)]  # fmt: skip
        elif images:  # the same pack, built by the vision-language forward from the sequences
            logits = mcore_zoo.packed_forward(model, sequences, seq_format=spec.seq_format, return_logprobs=False,
                                              align=batch.align, **images).logits  # fmt: skip
        else:
            logits = mcore_zoo.packed_forward(model, batch, seq_format=spec.seq_format, return_logprobs=False).logits
    if spec.device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    t_run = time.perf_counter()
    logits = [l.detach().to("cpu") for l in logits]
    rank = handle_of(model).placement.tp_rank
    if export_dir is not None:  # every TP rank takes part in the gathers; rank 0 writes the files
        if rank == 0:
            mcore_zoo.save_hf_checkpoint(model, export_dir, dtype=spec.dtype, overwrite=True)
        else:
            with tempfile.TemporaryDirectory(prefix="mcore-zoo-export-") as scratch:
                mcore_zoo.save_hf_checkpoint(model, Path(scratch) / "export", dtype=spec.dtype)
    info = {
        "engine": "megatron-core",
        "backend": spec.backend,
        "seq_format": spec.seq_format,
        "tp": spec.tp,
        "dtype": _dtype_name(spec.dtype),
        "device": spec.device,
        "batching": "each sequence alone (batch 1)" if spec.per_sequence else (
            "one THD pack (PackedSeqParams)" if spec.seq_format == "thd" else "one right-padded BSHD batch"),
        **describe_mcore(model),
        "seconds": {"build_and_load": round(t_load - t0, 3), "forward": round(t_run - t_load, 3)},
    }  # fmt: skip
    if export_dir is not None:  # checkpoint tensors the weight map ignores by name: never in the export
        info["not_exported"] = [list(pair) for pair in handle_of(model).weight_map.ignored]
    if rank != 0:
        return None
    hidden = _split_hidden(cap.records, spec, batch, lengths)
    del model
    return RunResult(spec.label, Predictions(tokens=list(sequences), logits=logits), hidden, info)


def _mcore_rank(spec: McoreSpec, sequences: list[torch.Tensor], capture: bool, export_dir: Optional[str],
                vision_inputs: Optional[list[Optional[dict]]] = None) -> Optional[RunResult]:  # fmt: skip
    quiet_libraries()  # spawned ranks: library import warnings are noise here
    return _run_mcore_here(spec, sequences, capture, export_dir, vision_inputs)


def quiet_libraries() -> None:
    """Silence import-time warnings and progress bars of the libraries (not the harness's own lines)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Apex.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - a missing transformers is reported by the run itself
        pass


def run_mcore(
    spec: McoreSpec,
    sequences: list[torch.Tensor],
    *,
    capture: bool = True,
    export_dir: Optional[os.PathLike] = None,
    vision_inputs: Optional[list[Optional[dict]]] = None,
) -> RunResult:
    """Run the mcore model (TP > 1: on ``spec.tp`` spawned ranks; rank 0's outputs are returned).

    ``export_dir``: also write the model's HF export there (``save_hf_checkpoint``), the weights
    other engines (vLLM) then load. ``vision_inputs``: a vision-language model's per-sequence
    images (``packed_forward``'s ``vision_inputs``).
    """
    export = str(export_dir) if export_dir is not None else None
    if spec.tp == 1:
        from ..placement import Placement

        if Placement.current().tp != 1:
            raise ZooError("this process already runs Megatron-Core with TP > 1; the parity runner needs TP=1 here")
        result = _run_mcore_here(spec, sequences, capture, export, vision_inputs)
    else:
        from ..distributed import launch

        t0 = time.perf_counter()
        results = launch(_mcore_rank, spec.tp, spec, sequences, capture, export, vision_inputs)
        result = results[0]
        result.info["seconds"]["launch_total"] = round(time.perf_counter() - t0, 3)
    assert result is not None
    return result


# ---------------------------------------------------------------------------- vLLM
WORKER = Path(__file__).with_name("vllm_worker.py")

#: Above this vocabulary size vLLM returns top-k log-probs only (full rows would be huge
#: Python dicts); KL is then not computed.
FULL_VOCAB_LIMIT = 32768


def run_vllm(
    python: str,
    checkpoint: os.PathLike,
    sequences: list[torch.Tensor],
    *,
    dtype: torch.dtype,
    vocab_size: int,
    work_dir: os.PathLike,
    llm_kwargs: Optional[dict[str, Any]] = None,
    topk: Optional[int] = None,
    timeout: float = 1800.0,
) -> RunResult:
    """vLLM prompt log-probs in the environment of ``python`` (see module docstring).

    Full-vocabulary log-prob rows when ``vocab_size <= FULL_VOCAB_LIMIT`` (or ``topk=-1``), else
    the top ``topk`` (default 20). Raises :class:`ZooError` with the tail of vLLM's log on failure.
    """
    if not Path(python).exists():
        raise ZooError(f"vLLM python {python!r} does not exist (set --vllm-python or MCORE_ZOO_VLLM_PYTHON)")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if topk is None:
        topk = -1 if vocab_size <= FULL_VOCAB_LIMIT else 20
    request = {
        "checkpoint": str(checkpoint),
        "sequences": [s.tolist() for s in sequences],
        "dtype": _dtype_name(dtype),
        "topk": topk,
        "vocab_size": vocab_size,
        "out": str(work),
        "llm_kwargs": dict(llm_kwargs or {}),
    }
    (work / "request.json").write_text(json.dumps(request))
    log = work / "vllm.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run([python, "-I", str(WORKER), str(work / "request.json")], stdout=f,
                                  stderr=subprocess.STDOUT, env=env, cwd=str(work), timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ZooError(f"vLLM run timed out after {timeout:.0f} s (log: {log})") from None
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise ZooError(f"vLLM run failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    from safetensors.torch import load_file

    tensors = load_file(str(work / "logprobs.safetensors"))
    result = json.loads((work / "result.json").read_text())
    n = len(sequences)
    full = bool(result["full_vocabulary"])
    predictions = Predictions(
        tokens=list(sequences),
        logprob_rows=[tensors[f"rows.{i}"] for i in range(n)] if full else None,
        logprobs=None if full else [tensors[f"lp.{i}"] for i in range(n)],
        top1=None if full else [tensors[f"top1.{i}"] for i in range(n)],
    )
    info = {
        "engine": "vllm",
        "python": str(python),
        "versions": result["versions"],
        "dtype": _dtype_name(dtype),
        "batching": "one generate() call, prompt log-probs (vLLM schedules the batch)",
        "weights": "HF export of the mcore model (mcore_zoo.save_hf_checkpoint)",
        "log_probs": "full vocabulary" if full else f"top-{result['topk']} (KL not computed)",
        "settings": result["settings"],
        "seconds": {**{k: round(v, 3) for k, v in result["seconds"].items()}, "subprocess_total": round(seconds, 3)},
    }
    return RunResult("vllm", predictions, {}, info)
