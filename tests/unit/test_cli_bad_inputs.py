"""Every bad input the command line can meet ends in one line on stderr and exit 2: no traceback.

Each case damages a copy of a tiny checkpoint (or a config, a distributed checkpoint, a flag) and
runs the command that meets it. ``--debug`` (or ``MCORE_ZOO_DEBUG=1``) brings the traceback back.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_zoo.cli import main


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_header(ckpt: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite model.safetensors' JSON header (the data section is kept)."""
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])


def _first(header: dict) -> dict:
    return header[sorted(k for k in header if k != "__metadata__")[0]]


def _as_fp8(entry: dict) -> None:
    """Relabel a tensor entry as F8_E4M3, keeping its bytes (more elements of one byte each)."""
    width = {"F32": 4, "BF16": 2, "F16": 2}[entry["dtype"]]
    entry.update(dtype="F8_E4M3", shape=[entry["shape"][0] * width, *entry["shape"][1:]])


def _set_config(ckpt: Path, **fields) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(fields)
    (ckpt / "config.json").write_text(json.dumps(config))


def _index(ckpt: Path, weight_map) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _hf_cases(tmp: Path, src: Path, tied_src: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a fragment the message must hold)."""
    cases: dict[str, tuple[list[str], str]] = {}

    def hf(name: str, damage: Callable[[Path], None], fragment: str, source: Path = src) -> None:
        ckpt = _copy(source, tmp / name)
        damage(ckpt)
        cases[name] = (["convert", "--hf", str(ckpt), "--out", str(tmp / f"{name}-out")], fragment)

    hf("string-offsets", lambda c: _edit_header(c, lambda h: _first(h).update(data_offsets=["0", "16"])), "malformed entry")
    hf("float-offsets", lambda c: _edit_header(c, lambda h: _first(h).update(data_offsets=[0.0, 16.0])), "malformed entry")
    hf("fractional-shape", lambda c: _edit_header(c, lambda h: _first(h).update(shape=[64.9, 64])), "malformed entry")
    hf("fp8", lambda c: _edit_header(c, lambda h: _as_fp8(_first(h))), "quantized checkpoints are not supported (F8_E4M3)")

    def nested(c: Path) -> None:
        blob = b"[" * 50000 + b"]" * 50000
        (c / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)

    hf("deep-nesting", nested, "nested too deeply")
    hf("weight-map-not-strings", lambda c: _index(c, {"model.norm.weight": 7}), "weight_map")
    hf("weight-map-list", lambda c: _index(c, ["model.safetensors"]), "weight_map")
    hf("index-not-json", lambda c: (c / "model.safetensors.index.json").write_bytes(b"\xff\xfe{"), "invalid index")
    hf("shard-escapes", lambda c: _index(c, {k: "../elsewhere/model.safetensors" for k in load_file(str(c / "model.safetensors"))}),
       "inside the checkpoint directory")  # fmt: skip

    def as_dir(c: Path) -> None:
        (c / "model.safetensors").unlink()
        (c / "model.safetensors").mkdir()

    hf("weights-a-directory", as_dir, "not a regular file")
    hf("truncated", lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:500]), "model.safetensors")
    hf("config-not-utf8", lambda c: (c / "config.json").write_bytes(b'{"model_type": "llama", "x": "\xff\xfe"}'), "not UTF-8")
    hf("config-not-json", lambda c: (c / "config.json").write_text("{"), "not valid JSON")
    def theta_words(c: Path) -> None:  # a transformers-4 style config: rope_theta at the top level
        config = json.loads((c / "config.json").read_text())
        scaling = config.pop("rope_parameters", None) or config.pop("rope_scaling", None) or {}
        scaling.pop("rope_theta", None)
        config.update(rope_theta="ten thousand", rope_scaling=scaling or None)
        (c / "config.json").write_text(json.dumps(config))

    hf("rope-theta-words", theta_words, "rope_theta")

    def other_head(c: Path) -> None:
        state = load_file(str(c / "model.safetensors"))
        state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
        save_file(state, str(c / "model.safetensors"), metadata={"format": "pt"})

    hf("tied-different-lm-head", other_head, "lm_head.weight", source=tied_src)
    return cases


@pytest.fixture(scope="module")
def mcore_ckpt(tmp_path_factory, mpu, reference_checkpoint) -> Path:
    out = tmp_path_factory.mktemp("dist") / "mcore"
    assert main(["-q", "convert", "--hf", str(reference_checkpoint("Qwen2ForCausalLM")), "--out", str(out)]) == 0
    return out


def _all_cases(tmp: Path, src: Path, tied: Path, mcore: Path) -> dict[str, tuple[list[str], str]]:
    cases = _hf_cases(tmp, src, tied)

    def dist(name: str, damage: Callable[[Path], None], fragment: str) -> None:
        ckpt = _copy(mcore, tmp / name)
        damage(ckpt)
        cases[name] = (["convert", "--mcore", str(ckpt), "--out", str(tmp / f"{name}-out")], fragment)

    def truncate(pattern: str) -> Callable[[Path], None]:
        def cut(c: Path) -> None:
            for f in c.glob(pattern):
                f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 3)])

        return cut

    dist("dist-metadata-truncated", truncate(".metadata"), "damaged or truncated")
    dist("dist-distcp-truncated", truncate("*.distcp"), "cannot be read")
    dist("dist-meta-garbage", lambda c: (c / "mcore_zoo.json").write_text("{not json"), "mcore_zoo.json")
    dist("dist-meta-wrong-type", lambda c: (c / "mcore_zoo.json").write_text(json.dumps(
        {**json.loads((c / "mcore_zoo.json").read_text()), "hf_config": "oops"})), "hf_config")  # fmt: skip
    cases["max-shard-size"] = (["convert", "--mcore", str(mcore), "--out", str(tmp / "m-out"), "--max-shard-size", "abc"], "--max-shard-size")
    occupied = tmp / "occupied"
    occupied.mkdir()
    (occupied / "keep").write_text("x")
    cases["out-not-empty"] = (["convert", "--hf", str(src), "--out", str(occupied)], "--overwrite")
    cases["out-is-input"] = (["convert", "--hf", str(src), "--out", str(src), "--overwrite"], "is the input")
    cases["out-contains-input"] = (["convert", "--hf", str(src), "--out", str(src.parent), "--overwrite"], "contains the input")
    cases["knob"] = (["parity-report", "--arch", "LlamaForCausalLM", "--knob", "foo=bar", "--no-layers", "--lengths", "4"], "foo")
    grouped = ["parity-report", "--arch", "Qwen3MoeForCausalLM", "--knob", "grouped_experts=true", "--no-layers", "--lengths", "4"]
    cases["grouped-experts-local"] = (grouped + ["--backend", "local"], "grouped_experts=True needs backend 'te'")
    cases["grouped-experts-hf-exact"] = (grouped + ["--numerics", "hf-exact"], "grouped_experts=True is refused")
    bins = tmp / "bins"
    bins.mkdir()
    shutil.copy(src / "config.json", bins / "config.json")
    torch.save(load_file(str(src / "model.safetensors")), bins / "pytorch_model.bin")
    cases["parity-model-bin"] = (["parity-report", "--model", str(bins), "--lengths", "4"], "allow_torch_load")
    damaged = _copy(src, tmp / "parity-damaged")
    (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:300])
    cases["parity-model-damaged"] = (["parity-report", "--model", str(damaged), "--lengths", "4"], "model.safetensors")
    cases["show-rope-theta"] = (["show", "--config", str(tmp / "rope-theta-words")], "rope_theta")
    cases["show-config-not-utf8"] = (["show", "--config", str(tmp / "config-not-utf8")], "not UTF-8")
    return cases


def test_every_bad_input_is_one_line_and_exit_2(mpu, reference_checkpoint, mcore_ckpt, tmp_path, capsys):
    src = _copy(reference_checkpoint("LlamaForCausalLM"), tmp_path / "src" / "llama")
    cases = _all_cases(tmp_path, src, reference_checkpoint("Qwen2ForCausalLM"), mcore_ckpt)
    assert len(cases) >= 25
    capsys.readouterr()
    problems = []
    for name, (argv, fragment) in cases.items():
        code = main(["-q", *argv])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or "Traceback" in err or fragment not in err or ": error: " not in err:
            problems.append(f"{name}: exit {code}, stderr {err!r} (wanted {fragment!r})")
    assert not problems, "\n".join(problems)
    # nothing was written next to the outputs, and the inputs survived
    assert not any(p.name.startswith(".") and ".partial-" in p.name for p in tmp_path.iterdir())
    assert (src / "model.safetensors").is_file() and (tmp_path / "occupied" / "keep").is_file()


def test_a_write_failure_names_the_output(mpu, reference_checkpoint, tmp_path, capsys, monkeypatch):
    """A full or read-only disk surfaces from torch's writer as 'unexpected pos 704 vs 598'."""
    from mcore_zoo.distributed import io as dist_io

    def full_disk(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(dist_io, "write_streaming", full_disk)
    out = tmp_path / "out"
    source = reference_checkpoint("LlamaForCausalLM")
    capsys.readouterr()  # the fixture's own output (transformers' progress bar when it writes the checkpoint here)
    assert main(["-q", "convert", "--hf", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(out) in err and "is the disk full" in err and "read-only" in err
    assert list(tmp_path.iterdir()) == []


def test_debug_brings_the_traceback_back(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff")
    cmd = [sys.executable, "-m", "mcore_zoo.cli", "show", "--config", str(tmp_path)]
    quiet = subprocess.run(cmd, capture_output=True, text=True)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1
    loud = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True)
    assert loud.returncode != 0 and "Traceback" in loud.stderr
