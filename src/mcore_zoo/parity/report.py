"""Render a parity report (the dict :func:`mcore_zoo.parity.harness.run_parity` returns).

* :func:`to_json` - the stable, versioned schema (``schema_version``; docs/parity/README.md).
* :func:`to_markdown` - PR-ready: verdict, summary table, per-layer tables naming the first
  divergent site, worst tokens, environment (versions, hardware, backends, numerics profile, knobs,
  fusion flags).
* :func:`to_html` - the same, self-contained, with inline SVG plots (per-layer error curve,
  ``|dlogp|`` histogram); no plotting library.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

SUMMARY_COLUMNS = ("mean |dlogp|", "p99", "max", "KL mean", "top-1", "exp|dlogp|", "bitwise")


def fmt(value: Any, digits: int = 3) -> str:
    """Compact number formatting for tables (``-`` for missing values)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _finite(value: Any) -> Any:
    """Non-finite floats as strings ("nan", "inf"): the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(_finite(report), indent=2, allow_nan=False, default=str) + "\n"


# ---------------------------------------------------------------------------- shared pieces
def _result(c: dict[str, Any]) -> str:
    if not c["gating"]:
        return "info"
    return "PASS" if c["passed"] else "**FAIL**"


def _summary_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in report["comparisons"]:
        m = c["metrics"]
        gate = c["criterion"] if c["gating"] else "not gating"
        rows.append([
            f"`{c['candidate']}` vs `{c['reference']}`", c["role"], gate,
            fmt(m["mean_abs_dlogp"]), fmt(m["p99_abs_dlogp"]), fmt(m["max_abs_dlogp"]), fmt(m["kl_mean"]),
            pct(m["top1_agreement"]), f"{m['token_mult_prob_error']:.7f}", fmt(m["bitwise_equal"]), _result(c),
        ])  # fmt: skip
    return rows


def _parity(report: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in report["comparisons"] if c["role"] == "parity")


def _ablation_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in report["comparisons"]:
        if c["role"] != "ablation":
            continue
        m, k = c["metrics"], c.get("knob", {})
        rows.append([f"`{k.get('name')}`", f"`{k.get('from')}`", f"`{k.get('value')}`", fmt(m["mean_abs_dlogp"]),
                     fmt(m["max_abs_dlogp"]), fmt(m["kl_mean"]), pct(m["top1_agreement"]), fmt(m["bitwise_equal"])])  # fmt: skip
    return rows


def _tolerance_line(report: dict[str, Any]) -> str:
    t = report["tolerances"]
    parts = []
    for key, label in (("mean_abs_dlogp", "mean |dlogp|"), ("p99_abs_dlogp", "p99 |dlogp|"),
                       ("max_abs_dlogp", "max |dlogp|"), ("kl_mean", "KL mean")):  # fmt: skip
        if t.get(key) is not None:
            parts.append(f"{label} <= {fmt(t[key])}")
    if t.get("top1_min") is not None:
        parts.append(f"top-1 >= {pct(t['top1_min'])}")
    gates = ", ".join(parts) or "none"
    floor = report.get("tolerance_floor") or t
    if t.get("baseline_factor") and floor != t:
        gates += (f" (the dtype's defaults relaxed to {fmt(t['baseline_factor'])}x transformers' own gap between"
                  " its two attention implementations, the baseline row)")  # fmt: skip
    elif t.get("baseline_factor"):
        gates += f" (each bound would relax to {fmt(t['baseline_factor'])}x the baseline row's value where looser)"
    return (f"Tolerances ({report['dtype']}): {gates}. Per-layer rows are flagged when the relative mean error"
            f" exceeds {fmt(t['hidden_rel'])}"
            + (" (bitwise mode: any difference)." if report["mode"] == "bitwise" else "."))  # fmt: skip


def _model_line(report: dict[str, Any]) -> str:
    m = report["model"]
    s = m["shape"]
    weights = f"random weights (seed {m['seed']})" if m["random_weights"] else "checkpoint weights"
    shape = (f"{s['layers']} layers, hidden {s['hidden']}, intermediate {s['intermediate']}, heads {s['heads']}"
             f" / {s['kv_heads']} kv, head_dim {s['head_dim']}, vocab {s['vocab']}"
             + (", tied embeddings" if s.get("tied_embeddings") else ""))  # fmt: skip
    scale = f"; scaled with `--scale {m['scale']}`" if m.get("scale") else ""
    return f"{m['origin']}{scale}; {weights}; {shape}"


def _inputs_line(report: dict[str, Any]) -> str:
    i = report["inputs"]
    src = f"tokenizer ({i['tokenizer']}), built-in sample text" if i["source"] == "tokenizer" else f"random ids (seed {i['seed']})"
    lengths = ", ".join(map(str, i["lengths"]))
    positions = report["comparisons"][0]["metrics"]["positions"] if report["comparisons"] else 0
    line = f"{len(i['lengths'])} sequences of lengths {lengths} ({i['total_tokens']} tokens, {positions} predicted positions); {src}"
    vision = i.get("vision")
    if vision and vision.get("text_only"):
        line += "; text only (`--images 0`: no vision inputs, the language model alone)"
    elif vision:
        line += (f"; {vision['images']} image(s) of random pixels in sequence(s)"
                 f" {', '.join(map(str, vision['sequences_with_an_image'])) or 'none'}")  # fmt: skip
    return line


def _layer_rows(c: dict[str, Any]) -> list[list[str]]:
    rows = []
    first = c["first_divergent_site"]
    for row in c["layers"]:
        mark = ""
        if row["site"] == first:
            mark = "**first divergent**"
        elif row["flagged"]:
            mark = "flagged"
        rows.append([
            row["site"], fmt(row["max_abs"]), fmt(row["mean_abs"]), fmt(row["rel_mean_abs"]),
            fmt(max(0.0, 1.0 - row["cosine_min"])), fmt(row["bitwise_equal"]), mark,
        ])  # fmt: skip
    return rows


def _worst_rows(c: dict[str, Any]) -> list[list[str]]:
    rows = []
    for w in c["worst_tokens"]:
        token = str(w["next_token"])
        if "next_text" in w:
            token += f" {json.dumps(w['next_text'])}"
        rows.append([
            str(w["sequence"]), str(w["position"]), token, fmt(w["ref_logp"], 6), fmt(w["cand_logp"], 6),
            fmt(w["abs_dlogp"]), fmt(w["ref_top1"]), fmt(w["cand_top1"]),
        ])  # fmt: skip
    return rows


def _engine_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label, info in report["runs"].items():
        if info["engine"] == "megatron-core":
            what = f"backend `{info['backend']}`, {info['seq_format'].upper()}, TP {info['tp']}"
            profile = f"`{info['numerics_profile']}`"
            modules = ", ".join(f"{k}={v}" for k, v in info["modules"].items())
        elif info["engine"] == "transformers":
            what = f"`{info['class']}`, attn_implementation `{info['attn_implementation']}`"
            profile, modules = "-", info["loaded_with"]
        else:
            versions = info.get("versions", {})
            what = f"vLLM {versions.get('vllm', '?')} (torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')})"
            profile, modules = "-", f"{info['weights']}; {info['log_probs']}"
        rows.append([f"`{label}`", what, info["dtype"], info["batching"], profile, modules])
    return rows


def _md_table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    out = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(esc(cell) for cell in row) + " |" for row in rows]
    return out


# ---------------------------------------------------------------------------- Markdown
def to_markdown(report: dict[str, Any]) -> str:
    """The PR-ready Markdown report."""
    arch = report["model"]["architecture"]
    verdict = report["verdict"].upper()
    lines = [
        f"# Parity report: {arch} - {verdict}",
        "",
        f"`{report['command']}`" if report.get("command") else "",
        "",
        f"**Verdict: {verdict}** - mode `{report['mode']}`, dtype `{report['dtype']}`, device `{report['device']}`;"
        f" created {report['created']} by {report['tool']['name']} {report['tool']['version']}"
        f" (report schema v{report['schema_version']}).",
        "",
        f"- **Model**: `{arch}`: {_model_line(report)}.",
        f"- **Inputs**: {_inputs_line(report)}.",
    ]
    failing = [c for c in report["comparisons"] if c["gating"] and not c["passed"]]
    for c in failing:
        where = f"; first divergent site: **{c['first_divergent_site']}**" if c["first_divergent_site"] else ""
        lines.append(f"- **Failed**: `{c['name']}`: {'; '.join(c['failures'])}{where}.")
    for note in report.get("notes") or []:
        lines.append(f"- **Note**: {note}")
    lines += ["", "## Summary", ""]
    header = ["comparison", "role", "criterion", *SUMMARY_COLUMNS, "result"]
    lines += _md_table(header, _summary_rows(report))
    lines += ["", _tolerance_line(report) + " `exp|dlogp|` is the mean of exp(|dlogp|)"
              " (token_mult_prob_error; 1 is perfect).", ""]  # fmt: skip
    ablation = _ablation_rows(report)
    if ablation:
        lines += ["## Ablation: each numerics knob flipped alone", "",
                  f"From profile `{report['runs'][_parity(report)['candidate']].get('numerics_profile', '?')}`; every row changes one"
                  f" knob and is compared with `{_parity(report)['reference']}` (the parity row is the baseline).", ""]
        lines += _md_table(["knob", "from", "to", "mean |dlogp|", "max |dlogp|", "KL", "top-1", "bitwise"], ablation)
        lines.append("")
    for c in report["comparisons"]:
        if not c["layers"] or c["role"] == "baseline":
            continue
        first = c["first_divergent_site"]
        lines += [f"## Per-layer hidden states: `{c['candidate']}` vs `{c['reference']}`", ""]
        lines.append(f"First divergent site: **{first}**." if first else "No site crosses the layer threshold.")
        lines.append("")
        lines += _md_table(["site", "max abs", "mean abs", "rel mean abs", "1 - cos (worst token)", "bitwise", ""],
                           _layer_rows(c))  # fmt: skip
        lines.append("")
    for c in report["comparisons"]:
        if c["role"] != "parity" and c["passed"]:
            continue
        if not c["worst_tokens"]:
            continue
        lines += [f"## Worst tokens: `{c['candidate']}` vs `{c['reference']}`", ""]
        lines += _md_table(["seq", "pos", "next token", "ref logp", "cand logp", "|dlogp|", "ref top-1", "cand top-1"],
                           _worst_rows(c))  # fmt: skip
        lines.append("")
    lines += _environment_md(report)
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def _environment_md(report: dict[str, Any]) -> list[str]:
    env = report["environment"]
    v = env["versions"]
    hw = env["hardware"]
    lines = ["## Environment", ""]
    lines.append("- **Versions**: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    gpu = f"; GPU {', '.join(hw['gpus'])} (sm {hw['compute_capability']}, CUDA {hw['cuda']}, cuDNN {hw['cudnn']})" if hw.get("gpus") else ""
    lines.append(f"- **Hardware**: {hw['cpu']} ({hw['cpu_count']} CPUs, {hw['torch_threads']} torch threads){gpu}; {hw['platform']}")
    settings = {k: val for k, val in env["settings"].items() if k != "env"}
    lines.append("- **Settings**: " + ", ".join(f"{k}={val}" for k, val in settings.items()))
    lines.append("- **Environment variables**: " + (", ".join(f"`{k}={val}`" for k, val in env["settings"]["env"].items()) or "none that select kernels"))
    for label, info in report["runs"].items():
        if info["engine"] == "megatron-core":
            knobs = ", ".join(f"{k}={val}" for k, val in info["numerics_knobs"].items())
            fusions = ", ".join(f"{k}={val}" for k, val in info["fusions"].items())
            lines.append(f"- **`{label}`**: numerics profile `{info['numerics_profile']}` ({knobs}); fusion flags: {fusions};"
                         f" attention_backend={info.get('attention_backend', '-')}")  # fmt: skip
    export = report.get("export")
    if export:
        verdict = "bitwise equal to the checkpoint" if export["bitwise_equal_to_checkpoint"] else (
            f"DIFFERS from the checkpoint (missing {export['missing']}, unexpected {export['unexpected']},"
            f" different {export['different']})")  # fmt: skip
        lines.append(f"- **HF export** (the weights vLLM loaded): {export['tensors']} tensors, {verdict}")
        for reason, names in export.get("left_out", {}).items():
            lines.append(f"  - left out by the weight map ({reason}): {len(names)} checkpoint tensors, e.g. `{names[0]}`")
    lines += ["", "Engines:", ""]
    lines += _md_table(["run", "engine", "dtype", "batching", "numerics", "modules / loading"], _engine_rows(report))
    timings = ", ".join(f"{k} {val:.1f} s" for k, val in report["timings"].items())
    lines += ["", f"Timings: {timings}.", ""]
    return lines


# ---------------------------------------------------------------------------- HTML
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#1b1f24;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:right}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}code{background:#f2f2f2;padding:0 3px;border-radius:3px}
.pass{color:#116329;font-weight:bold}.fail{color:#b42318;font-weight:bold}.info{color:#666}
.verdict{font-size:1.3em;padding:.4em .8em;border-radius:6px;display:inline-block}
.verdict.pass{background:#dafbe1}.verdict.fail{background:#ffebe9}
tr.flag td{background:#fff4e5}tr.first td{background:#ffd8d3;font-weight:bold}
.plots{display:flex;flex-wrap:wrap;gap:1.5em}.muted{color:#666}
"""

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")


def _svg_layer_curve(report: dict[str, Any]) -> str:
    """Relative mean error per capture site, one line per comparison (log scale)."""
    series = [(c["name"], c["layers"]) for c in report["comparisons"] if c["layers"]]
    if not series:
        return ""
    sites = [row["site"] for row in series[0][1]]
    width, height, left, right, top, bottom = 760, 300, 60, 60, 20, 80
    floor = -12
    values = [row["rel_mean_abs"] for _, rows in series for row in rows if row["rel_mean_abs"] > 0]
    hi = math.ceil(math.log10(max(values))) if values else 0
    hi = max(hi, math.ceil(math.log10(report["tolerances"]["hidden_rel"])) + 1, floor + 2)
    lo = min([math.floor(math.log10(v)) for v in values] + [hi - 2]) if values else floor
    lo = max(lo - 1, floor)

    def x(i: int) -> float:
        return left + (width - left - right) * (i / max(1, len(sites) - 1))

    def y(v: float) -> float:
        e = lo if v <= 0 else max(lo, min(hi, math.log10(v)))
        return top + (height - top - bottom) * (hi - e) / (hi - lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20 * len(series)}" font-size="11">']
    for e in range(lo, hi + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10.0 ** e):.1f}" y2="{y(10.0 ** e):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    thr = report["tolerances"]["hidden_rel"]
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(thr):.1f}" y2="{y(thr):.1f}" stroke="#b42318" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{width - right}" y="{y(thr) - 4:.1f}" text-anchor="end" fill="#b42318">flag threshold {fmt(thr)}</text>')
    for i, site in enumerate(sites):
        parts.append(f'<text transform="translate({x(i):.1f},{height - bottom + 12}) rotate(40)" font-size="10">{html.escape(site)}</text>')
    for k, (name, rows) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        by_site = {row["site"]: row["rel_mean_abs"] for row in rows}
        pts = [(x(i), y(by_site[s]), by_site[s]) for i, s in enumerate(sites) if s in by_site]
        dash = "" if k == 0 else f' stroke-dasharray="{3 + 2 * k} {2 + k}"'
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="' + " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in pts) + '"/>')
        for px, py, v in pts:
            shape = f'<rect x="{px - 3:.1f}" y="{py - 3:.1f}" width="6" height="6" fill="white" stroke="{color}"/>' if v == 0 else f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>'
            parts.append(shape)
        ly = height + 14 * k + 4
        parts.append(f'<rect x="{left}" y="{ly}" width="10" height="10" fill="{color}"/><text x="{left + 16}" y="{ly + 9}">{html.escape(name)}</text>')
    parts.append(f'<text x="8" y="{top - 6}" class="muted">rel mean |error| (log; hollow squares: exactly 0)</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_histogram(c: dict[str, Any]) -> str:
    """|dlogp| per decade (and exact zeros) for one comparison."""
    h = c["histogram"]
    labels = ["0"] + [f"1e{d}" for d in h["decades"]]
    counts = [h["zero"]] + h["counts"]
    width, height, left, bottom, top = 380, 170, 36, 30, 24
    bar = (width - left - 10) / len(counts)
    peak = max(counts) or 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="10">',
             f'<text x="4" y="12">{html.escape(c["name"])}: |dlogp| per decade</text>']  # fmt: skip
    for i, (label, n) in enumerate(zip(labels, counts)):
        bh = (height - top - bottom) * n / peak
        bx = left + i * bar
        color = "#2ca02c" if i == 0 else "#1f77b4"
        parts.append(f'<rect x="{bx + 1:.1f}" y="{height - bottom - bh:.1f}" width="{bar - 2:.1f}" height="{bh:.1f}" fill="{color}"><title>{label}: {n}</title></rect>')
        if n:
            parts.append(f'<text x="{bx + bar / 2:.1f}" y="{height - bottom - bh - 2:.1f}" text-anchor="middle">{n}</text>')
        parts.append(f'<text x="{bx + bar / 2:.1f}" y="{height - bottom + 12}" text-anchor="middle">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _html_table(header: Sequence[str], rows: list[list[str]], row_classes: Optional[list[str]] = None) -> str:
    def cell(text: str) -> str:
        text = html.escape(text)
        if text.startswith("**") and text.endswith("**"):
            return f"<b>{text[2:-2]}</b>"
        if text.startswith("`") and "` vs `" in text:
            return text.replace("`", "")
        return text.strip("`")

    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def to_html(report: dict[str, Any]) -> str:
    """Self-contained HTML report with inline SVG plots."""
    arch = html.escape(report["model"]["architecture"])
    v = report["verdict"]
    body = [
        f"<h1>Parity report: {arch}</h1>",
        f'<p><span class="verdict {v}">{v.upper()}</span> &nbsp; mode <code>{report["mode"]}</code>, dtype'
        f' <code>{report["dtype"]}</code>, device <code>{report["device"]}</code>; {html.escape(report["created"])},'
        f' {html.escape(report["tool"]["name"])} {report["tool"]["version"]}, schema v{report["schema_version"]}</p>',
        f"<p><code>{html.escape(report.get('command') or '')}</code></p>",
        f"<p><b>Model</b>: {html.escape(_model_line(report))}.<br><b>Inputs</b>: {html.escape(_inputs_line(report))}.</p>",
    ]
    for c in report["comparisons"]:
        if c["gating"] and not c["passed"]:
            where = f"; first divergent site: <b>{html.escape(c['first_divergent_site'])}</b>" if c["first_divergent_site"] else ""
            body.append(f'<p class="fail">Failed: {html.escape(c["name"])}: {html.escape("; ".join(c["failures"]))}{where}</p>')
    for note in report.get("notes") or []:
        body.append(f'<p class="muted"><b>Note</b>: {html.escape(note)}</p>')
    body.append("<h2>Summary</h2>")
    rows = _summary_rows(report)
    classes = ["" if not c["gating"] else ("" if c["passed"] else "first") for c in report["comparisons"]]
    body.append(_html_table(["comparison", "role", "criterion", *SUMMARY_COLUMNS, "result"], rows, classes))
    body.append(f'<p class="muted">{html.escape(_tolerance_line(report))} exp|dlogp| is token_mult_prob_error (1 is perfect).</p>')
    ablation = _ablation_rows(report)
    if ablation:
        body.append("<h2>Ablation: each numerics knob flipped alone</h2>")
        body.append(_html_table(["knob", "from", "to", "mean |dlogp|", "max |dlogp|", "KL", "top-1", "bitwise"], ablation))
    body.append("<h2>Plots</h2><div class='plots'>")
    body.append(_svg_layer_curve(report))
    body.append("</div><div class='plots'>")
    body += [_svg_histogram(c) for c in report["comparisons"]]
    body.append("</div>")
    for c in report["comparisons"]:
        if not c["layers"]:
            continue
        first = c["first_divergent_site"]
        body.append(f"<h2>Per-layer hidden states: {html.escape(c['name'])}</h2>")
        body.append(f"<p>First divergent site: <b>{html.escape(first)}</b></p>" if first else "<p>No site crosses the layer threshold.</p>")
        classes = ["first" if r["site"] == first else ("flag" if r["flagged"] else "") for r in c["layers"]]
        body.append(_html_table(["site", "max abs", "mean abs", "rel mean abs", "1 - cos (worst token)", "bitwise", ""], _layer_rows(c), classes))
    for c in report["comparisons"]:
        if c["worst_tokens"] and (c["role"] == "parity" or not c["passed"]):
            body.append(f"<h2>Worst tokens: {html.escape(c['name'])}</h2>")
            body.append(_html_table(["seq", "pos", "next token", "ref logp", "cand logp", "|dlogp|", "ref top-1", "cand top-1"], _worst_rows(c)))
    env_md = _environment_md(report)
    body.append("<h2>Environment</h2><ul>")
    for line in env_md[2:]:
        if line.startswith("- "):
            body.append("<li>" + _inline_md(line[2:]) + "</li>")
    body.append("</ul>")
    body.append(_html_table(["run", "engine", "dtype", "batching", "numerics", "modules / loading"], _engine_rows(report)))
    timings = ", ".join(f"{k} {val:.1f} s" for k, val in report["timings"].items())
    body.append(f'<p class="muted">Timings: {html.escape(timings)}.</p>')
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Parity report: {arch} ({v})</title>"
            f"<style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")  # fmt: skip


def _inline_md(text: str) -> str:
    out = html.escape(text)
    while "**" in out:
        out = out.replace("**", "<b>", 1).replace("**", "</b>", 1)
    parts = out.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def write_reports(report: dict[str, Any], out_dir: Path, stem: str, formats: Sequence[str] = ("json", "md", "html")) -> list[Path]:
    """Write ``<stem>.json`` / ``.md`` / ``.html`` under ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    render = {"json": to_json, "md": to_markdown, "html": to_html}
    paths = []
    for kind in formats:
        path = out_dir / f"{stem}.{kind}"
        path.write_text(render[kind](report))
        paths.append(path)
    return paths

