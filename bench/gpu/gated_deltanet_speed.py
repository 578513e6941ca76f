"""What THD packing costs one gated DeltaNet layer: forward + backward time of the zoo's layer on one
THD pack of mixed-length sequences against the same sequences on BSHD (issue: packing must not cost
more than 5%).

One layer at a published config's full width (default: Qwen3-Next-80B-A3B's gated DeltaNet block,
16 key / 32 value heads of 128, which Qwen3.5-9B and Qwen3.5-35B-A3B share), taken from a
one-layer model built by ``mcore_zoo.build_model`` (``local`` backend, random init). Per case:

* ``thd``: the sequences packed into one ``[t, 1, h]`` tensor with ``cu_seqlens``, the layer as
  the profiles build it (numerics knob ``linear_attention_pack="each"``: each sequence run alone
  inside the layer, from a zero state and convolution window, one after the other);
* ``thd_batch``: the same pack with ``linear_attention_pack="batch"`` (inside the layer the pack's
  sequences run as one right-padded batch);
* ``bshd_padded``: the same sequences as one ``[s_max, b, h]`` batch, right-padded to the longest
  (what a BSHD trainer runs; the padding rows cost compute);
* ``bshd_each``: each sequence as its own batch of one (the work the pack does, without it);
* with flash-linear-attention (``--kernel fla``, or ``auto`` where fla runs): ``thd_fla``, the pack
  as one varlen call of fla's convolution and delta rule (numerics knob
  ``linear_attention_kernel="fla"``), ``thd_batch_fla``, the pack as one right-padded batch inside the
  layer on fla's kernels (``linear_attention_pack="batch"``), and ``bshd_padded_fla``, the padded
  batch on fla's kernels.

The rows above run the layer on transformers' torch math (``linear_attention_kernel="torch"``).

Times are medians of ``--iters`` runs after warm-up (CUDA events on the GPU). ``thd_vs_padded`` and
``thd_vs_each`` are the ratios of the THD time to each BSHD time, ``thd_batch_vs_padded`` that of
``thd_batch`` (1.05 is the issue's bound); with fla, ``fla_thd_vs_padded`` (``thd_fla`` /
``bshd_padded_fla``, the bound again: ``fla_bound_met``; ``fla_batch_vs_padded`` likewise for
``thd_batch_fla``, and ``fla_best_vs_padded`` the faster THD form's) and ``fla_vs_torch`` (``thd_fla`` /
``thd_batch``: fla's time against the torch path's best THD form). ``max_abs_diff_*``: the largest
difference between the pack's outputs and each BSHD form's (``max_abs_diff_batch``: ``thd_batch`` vs
``thd``; ``max_abs_diff_fla``: ``thd_fla`` vs ``thd``; ``max_abs_diff_fla_padded``: ``thd_fla`` vs
``bshd_padded_fla``), per token (0.0: bitwise). The script fails (exit 1) where a case raises, or
where fla's pack differs from the torch pack by more than ``FLA_TOLERANCE`` (bf16: a state leaking
across ``cu_seqlens`` or a wrong calling convention shows as O(1) differences).

    PYTHONPATH=src python bench/gpu/gated_deltanet_speed.py --out OUT/gated_deltanet_thd.json
    PYTHONPATH=src:FLA_DIR python bench/gpu/gated_deltanet_speed.py --kernel fla --out OUT/gated_deltanet_fla.json
    PYTHONPATH=src python bench/gpu/gated_deltanet_speed.py --device cpu --tiny --iters 1 --out x.json

``--profile``: one more call of the THD and padded forms per case (fla's, else the torch path's
batch forms) under torch's profiler; each op table goes beside ``--out`` (``STEM-CASE-FORM.txt``),
and the JSON gets the call's wall time and summed device time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "tests" / "fixtures" / "configs" / "qwen3-next-80b-a3b.json"
#: (name, lengths): a mixed pack a trainer sees, and many short sequences (the per-sequence loop's worst case)
CASES = [("mixed", [2048, 1024, 768, 512, 300, 100, 37]), ("many-short", [256] * 16)]
TINY = {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 96}  # fmt: skip
#: largest |thd_fla - thd| accepted, relative to the largest output (bf16 kernels of another op order)
FLA_TOLERANCE = 0.05


def layer_config(path: Path, tiny: bool) -> dict[str, Any]:
    """The published config's language model with one (gated DeltaNet) layer, a dense MLP and a
    small vocabulary: only the layer's token mixer is timed."""
    raw = json.loads(path.read_text())
    text = dict(raw.get("text_config", raw))
    text.update(num_hidden_layers=1, vocab_size=1024, num_experts=0, mtp_num_hidden_layers=0,
                layer_types=["linear_attention"], full_attention_interval=4)  # fmt: skip
    text.setdefault("intermediate_size", 1024)
    if "architectures" not in text:
        text["architectures"] = [raw["architectures"][0].replace("ForConditionalGeneration", "ForCausalLM")]
    if tiny:
        text.update(TINY)
    return text


def build_layer(config: dict[str, Any], device: str, dtype: torch.dtype) -> torch.nn.Module:
    import mcore_zoo

    model = mcore_zoo.build_model(config, backend="local", params_dtype=dtype, device=device)
    layer = model.decoder.layers[0].self_attention
    if type(layer).__name__ != "PortableGatedDeltaNet":
        raise SystemExit(f"layer 0 is {type(layer).__name__}, not the gated DeltaNet layer")
    return layer


def timed(fn: Callable[[], None], device: str, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` (synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profile_form(fn: Callable[[], None], device: str, path: Path) -> dict[str, float]:
    """One call of ``fn`` under torch's profiler: the ops' table (top 30 by self device time, or
    CPU time on the CPU) written to ``path``; returns the wall time and the summed self device
    time in milliseconds (their gap: host time the device waited on)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    fn()  # warm
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    path.write_text(events.table(sort_by=key, row_limit=30) + "\n")
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3 if device == "cuda" else 0.0
    return {"wall_ms": wall, "device_busy_ms": busy}


def run_case(layer: torch.nn.Module, lengths: list[int], device: str, dtype: torch.dtype, iters: int,
             warmup: int, fla: bool = False, profile_to: Path | None = None) -> dict[str, Any]:  # fmt: skip
    from megatron.core.packed_seq_params import PackedSeqParams

    hidden = layer.out_proj.out_features
    gen = torch.Generator(device="cpu").manual_seed(0)
    seqs = [torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype) for n in lengths]
    grads = [torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype) for n in lengths]
    bounds = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip
    packed = torch.cat(seqs).unsqueeze(1)  # [t, 1, h]
    packed_grad = torch.cat(grads).unsqueeze(1)
    longest = max(lengths)
    padded = torch.zeros(longest, len(seqs), hidden, device=device, dtype=dtype)
    padded_grad = torch.zeros_like(padded)  # padding rows get no gradient
    for i, (x, g) in enumerate(zip(seqs, grads)):
        padded[: len(x), i], padded_grad[: len(g), i] = x, g

    def step(x: torch.Tensor, grad: torch.Tensor, packed_seq_params: Any = None) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        out, _ = layer(x, None, packed_seq_params=packed_seq_params)
        out.backward(grad)
        return out.detach()

    def zero_grads() -> None:
        for p in layer.parameters():
            p.grad = None

    def thd(pack: str, kernel: str = "torch") -> None:
        layer.pack, layer.kernel = pack, kernel
        try:
            zero_grads()
            step(packed, packed_grad, params)
        finally:
            layer.pack, layer.kernel = "each", "torch"

    def padded_fla() -> None:
        layer.kernel = "fla"
        try:
            zero_grads()
            step(padded, padded_grad)
        finally:
            layer.kernel = "torch"

    forms = {
        "thd": lambda: thd("each"),
        "thd_batch": lambda: thd("batch"),
        "bshd_padded": lambda: (zero_grads(), step(padded, padded_grad)),
        "bshd_each": lambda: (zero_grads(), [step(x.unsqueeze(1), g.unsqueeze(1)) for x, g in zip(seqs, grads)]),
    }
    if fla:
        forms.update(thd_fla=lambda: thd("each", "fla"), thd_batch_fla=lambda: thd("batch", "fla"),
                     bshd_padded_fla=padded_fla)  # fmt: skip
    result: dict[str, Any] = {"lengths": lengths, "tokens": sum(lengths), "padded_tokens": longest * len(lengths)}
    for name, fn in forms.items():
        result[f"{name}_ms"] = timed(fn, device, iters, warmup)
    if profile_to is not None:  # the fla forms (else the torch ones): where the time goes, op by op
        for name in ("thd_fla", "thd_batch_fla", "bshd_padded_fla") if fla else ("thd_batch", "bshd_padded"):
            result[f"{name}_profile"] = profile_form(forms[name], device, profile_to.with_name(f"{profile_to.name}-{name}.txt"))
    result["thd_vs_padded"] = result["thd_ms"] / result["bshd_padded_ms"]
    result["thd_vs_each"] = result["thd_ms"] / result["bshd_each_ms"]
    result["thd_batch_vs_padded"] = result["thd_batch_ms"] / result["bshd_padded_ms"]
    with torch.no_grad():
        thd = layer(packed, None, packed_seq_params=params)[0][:, 0].float()
        pad = layer(padded, None)[0].float()
        starts = bounds.tolist()
        diff_pad = max(float((thd[starts[i]:starts[i + 1]] - pad[: n, i]).abs().max()) for i, n in enumerate(lengths))
        diff_each = max(float((thd[starts[i]:starts[i + 1]] - layer(x.unsqueeze(1), None)[0][:, 0].float()).abs().max())
                        for i, x in enumerate(seqs))  # fmt: skip
        layer.pack = "batch"
        batched = layer(packed, None, packed_seq_params=params)[0][:, 0].float()
        layer.pack = "each"
    result["max_abs_diff_padded"], result["max_abs_diff_each"] = diff_pad, diff_each
    result["max_abs_diff_batch"] = float((batched - thd).abs().max())
    if fla:
        result["fla_thd_vs_padded"] = result["thd_fla_ms"] / result["bshd_padded_fla_ms"]
        result["fla_batch_vs_padded"] = result["thd_batch_fla_ms"] / result["bshd_padded_fla_ms"]
        result["fla_best_vs_padded"] = min(result["fla_thd_vs_padded"], result["fla_batch_vs_padded"])
        result["fla_bound_met"] = result["fla_best_vs_padded"] <= 1.05
        result["fla_vs_torch"] = result["thd_fla_ms"] / result["thd_batch_ms"]
        with torch.no_grad():
            layer.kernel = "fla"
            fla_pack = layer(packed, None, packed_seq_params=params)[0][:, 0].float()
            fla_pad = layer(padded, None)[0].float()
            layer.pack = "batch"
            fla_batch = layer(packed, None, packed_seq_params=params)[0][:, 0].float()
            layer.kernel, layer.pack = "torch", "each"
        result["max_abs_diff_fla"] = float((fla_pack - thd).abs().max())
        result["max_abs_diff_fla_padded"] = max(float((fla_pack[starts[i]:starts[i + 1]] - fla_pad[: n, i]).abs().max())
                                                for i, n in enumerate(lengths))  # fmt: skip
        result["max_abs_diff_fla_batch"] = float((fla_batch - fla_pack).abs().max())
        result["fla_within_tolerance"] = result["max_abs_diff_fla"] <= FLA_TOLERANCE * float(thd.abs().max())
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# THD vs BSHD: one gated DeltaNet layer, forward + backward ({report['device_name']}, {report['dtype']})",
             "", f"Layer of `{report['config']}`: {report['layer']}.", "",
             "| case | tokens (padded) | THD ms | THD batch ms | BSHD padded ms | BSHD one by one ms | THD / padded |"
             " THD batch / padded | THD / one by one | max \\|d\\| vs padded | max \\|d\\| vs one by one |"
             " max \\|d\\| batch vs THD |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, r in report["cases"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['tokens']} ({r['padded_tokens']}) | {r['thd_ms']:.2f} | {r['thd_batch_ms']:.2f} |"
                     f" {r['bshd_padded_ms']:.2f} | {r['bshd_each_ms']:.2f} | {r['thd_vs_padded']:.3f} |"
                     f" {r['thd_batch_vs_padded']:.3f} | {r['thd_vs_each']:.3f} | {r['max_abs_diff_padded']:.3g} |"
                     f" {r['max_abs_diff_each']:.3g} | {r['max_abs_diff_batch']:.3g} |")  # fmt: skip
    fla = {name: r for name, r in report["cases"].items() if "thd_fla_ms" in r}
    if fla:
        lines += ["", f"flash-linear-attention {report['fla']} (numerics knob `linear_attention_kernel=\"fla\"`):", "",
                  "| case | THD fla (varlen) ms | THD fla batch ms | BSHD padded fla ms | varlen / padded | batch / padded |"
                  " bound 1.05 (faster form) | THD fla / THD batch (torch) | max \\|d\\| fla vs torch |"
                  " max \\|d\\| fla THD vs fla padded | max \\|d\\| fla batch vs varlen |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for name, r in fla.items():
            lines.append(f"| {name} | {r['thd_fla_ms']:.2f} | {r['thd_batch_fla_ms']:.2f} | {r['bshd_padded_fla_ms']:.2f} |"
                         f" {r['fla_thd_vs_padded']:.3f} | {r['fla_batch_vs_padded']:.3f} |"
                         f" {'met' if r['fla_bound_met'] else 'MISSED'} | {r['fla_vs_torch']:.3f} |"
                         f" {r['max_abs_diff_fla']:.3g} | {r['max_abs_diff_fla_padded']:.3g} | {r['max_abs_diff_fla_batch']:.3g} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny layer (a dry run of the script on the CPU)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kernel", choices=("torch", "fla", "auto"), default="auto",
                    help="fla: add the fla forms (refused where fla cannot run); auto: where it can; torch: none")
    ap.add_argument("--out", type=Path, required=True, help="JSON path (Markdown beside it)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call of the THD and padded forms per case (op tables beside --out)")
    args = ap.parse_args(argv)
    from mcore_zoo.families.gated_deltanet import kernels

    if args.kernel == "fla":
        kernels.check_kernel("fla", args.device)
    fla = args.kernel == "fla" or (args.kernel == "auto" and kernels.fla_problem(args.device) is None)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    config = layer_config(args.config, args.tiny)
    layer = build_layer(config, args.device, dtype)
    spec = layer.spec
    report: dict[str, Any] = {
        "config": args.config.name, "device": args.device, "dtype": str(dtype).replace("torch.", ""),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "iters": args.iters, "warmup": args.warmup,
        "layer": (f"hidden {config['hidden_size']}, {spec.num_key_heads} key heads x {spec.key_head_dim},"
                  f" {spec.num_value_heads} value heads x {spec.value_head_dim}, conv {spec.conv_kernel_dim},"
                  f" chunk {spec.chunk_size}"),
        "fla": kernels.load_fla().version if fla else None,
        "cases": {},
    }  # fmt: skip
    status = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, lengths in CASES:
        if args.tiny:
            lengths = [max(2, n // 16) for n in lengths]
        try:
            profile_to = args.out.with_name(f"{args.out.stem}-{name}") if args.profile else None
            report["cases"][name] = run_case(layer, lengths, args.device, dtype, args.iters, args.warmup, fla=fla,
                                             profile_to=profile_to)  # fmt: skip
            if fla and not report["cases"][name]["fla_within_tolerance"]:
                status = 1  # fla's pack is not the torch pack's result
        except Exception as exc:  # recorded; the next case runs
            report["cases"][name] = {"lengths": lengths, "error": f"{type(exc).__name__}: {exc}"}
            status = 1
        print(name, json.dumps(report["cases"][name]), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    return status


if __name__ == "__main__":
    sys.exit(main())
