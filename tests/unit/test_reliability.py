"""Reliability: no silent wrong weights, no lost data. Shard paths stay inside the checkpoint,
tied embeddings are compared, output directories are never clobbered, malformed headers are named."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mcore_zoo
from mcore_zoo.errors import CheckpointFormatError, ZooError
from mcore_zoo.weights.io import SAFE_INDEX, HFCheckpoint


def _split(ckpt: Path, dst: Path, files: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Copy ``ckpt`` to ``dst`` with its tensors spread over ``files`` (paths as the index names
    them, relative to ``dst``) and an index; returns ``{file: tensors}``."""
    dst.mkdir(parents=True)
    shutil.copy(ckpt / "config.json", dst / "config.json")
    state = load_file(str(ckpt / "model.safetensors"))
    names = sorted(state)
    parts: dict[str, dict[str, torch.Tensor]] = {f: {} for f in files}
    for i, name in enumerate(names):
        parts[files[i % len(files)]][name] = state[name]
    weight_map = {}
    for file, tensors in parts.items():
        path = (dst / file).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    (dst / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return parts


# ---------------------------------------------------------------------------- 1. shard paths
def test_index_shard_outside_the_checkpoint_is_refused(mpu, reference_checkpoint, tmp_path):
    """``../other/X`` next to a local ``X`` used to read the local file's bytes for the other
    file's tensors (a wrong model, exit 0)."""
    src = reference_checkpoint("LlamaForCausalLM")
    ckpt = tmp_path / "ckpt"
    parts = _split(src, ckpt, ["model-00001-of-00002.safetensors", "../other/model-00001-of-00002.safetensors"])
    assert (tmp_path / "other" / "model-00001-of-00002.safetensors").is_file() and parts
    with pytest.raises(CheckpointFormatError, match=r"\.\./other/model-00001-of-00002\.safetensors"):
        HFCheckpoint(ckpt)
    model = mcore_zoo.build_model(src, backend="local")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointFormatError, match="inside the checkpoint directory"):
        mcore_zoo.load_hf_weights(model, ckpt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_index_absolute_shard_path_is_refused(mpu, reference_checkpoint, tmp_path):
    src = reference_checkpoint("LlamaForCausalLM")
    outside = tmp_path / "elsewhere" / "model-00002-of-00002.safetensors"
    ckpt = tmp_path / "ckpt"
    _split(src, ckpt, ["model-00001-of-00002.safetensors", str(outside)])
    assert outside.is_file()
    with pytest.raises(CheckpointFormatError, match="inside the checkpoint directory"):
        HFCheckpoint(ckpt)


def test_shards_in_a_subdirectory_load(mpu, reference_checkpoint, tmp_path):
    """Used to fail with a bare KeyError after some parameters were already overwritten."""
    src = reference_checkpoint("LlamaForCausalLM")
    ckpt = tmp_path / "ckpt"
    _split(src, ckpt, ["shards/model-00001-of-00002.safetensors", "shards/model-00002-of-00002.safetensors"])
    state = load_file(str(src / "model.safetensors"))
    with HFCheckpoint(ckpt) as reader:
        assert reader.keys() == set(state)
        for name, tensor in state.items():
            assert torch.equal(reader.read(name), tensor), name
    model = mcore_zoo.build_model(src, backend="local", load=ckpt)
    for name, tensor in mcore_zoo.iter_hf_weights(model):
        assert torch.equal(tensor, state[name]), name


def test_index_names_are_normalised(mpu, reference_checkpoint, tmp_path):
    """``./a.safetensors`` and ``a.safetensors`` are one file (opened once, tensors found)."""
    src = reference_checkpoint("LlamaForCausalLM")
    ckpt = tmp_path / "ckpt"
    _split(src, ckpt, ["a.safetensors", "b.safetensors"])
    index = json.loads((ckpt / SAFE_INDEX).read_text())
    for name, file in index["weight_map"].items():
        index["weight_map"][name] = "./" + file if hash(name) % 2 else "sub/../" + file
    (ckpt / SAFE_INDEX).write_text(json.dumps(index))
    state = load_file(str(src / "model.safetensors"))
    with HFCheckpoint(ckpt) as reader:
        assert all(torch.equal(reader.read(n), t) for n, t in state.items())


# ---------------------------------------------------------------------------- 6. header values
def _header_file(path: Path, header: dict, data: bytes = b"") -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [4.9, 1], "data_offsets": [0, 16]}, "malformed entry"),
        ({"dtype": "F32", "shape": [4, 1], "data_offsets": ["0", "16"]}, "malformed entry"),
        ({"dtype": "F32", "shape": [4, 1], "data_offsets": [0.0, 16.0]}, "malformed entry"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "malformed entry"),
        ({"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]}, r"quantized checkpoints are not supported \(F8_E4M3\)"),
        ({"dtype": "F8_E5M2", "shape": [4, 4], "data_offsets": [0, 16]}, r"quantized checkpoints are not supported \(F8_E5M2\)"),
        ("not an entry", "malformed entry"),
        ({"shape": [4, 1], "data_offsets": [0, 16]}, "malformed entry"),  # no dtype
        ({"dtype": "X99", "shape": [4, 1], "data_offsets": [0, 16]}, "malformed entry"),  # no safetensors dtype
        ({"dtype": ["F32"], "shape": [4, 1], "data_offsets": [0, 16]}, "malformed entry"),
        ({"dtype": "F32", "shape": [4, 1], "data_offsets": [0, 16, 16]}, "malformed entry"),
        ({"dtype": "F32", "shape": [-4, -1], "data_offsets": [0, 16]}, "do not hold F32"),
    ],
)
def test_malformed_header_values_are_named(tmp_path, entry, message):
    path = _header_file(tmp_path / "model.safetensors", {"w": entry}, b"\0" * 16)
    with pytest.raises(CheckpointFormatError, match=message):
        HFCheckpoint(tmp_path)
    assert "w" in str(pytest.raises(CheckpointFormatError, HFCheckpoint, tmp_path).value) and path


def test_a_malformed_entry_after_a_good_one_of_its_dtype_is_named(tmp_path):
    """The dtype checks run once per dtype: an entry after a well-formed one of the same dtype is
    still checked whole."""
    _header_file(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                  "b": {"dtype": "F32", "shape": [True], "data_offsets": [16, 20]}}, b"\0" * 20)  # fmt: skip
    with pytest.raises(CheckpointFormatError, match="tensor 'b': malformed entry"):
        HFCheckpoint(tmp_path)


def test_quantized_dtype_refused_even_when_readable(tmp_path, monkeypatch):
    """Once the dtype table can read FP8, loading still refuses it (keyed on the header's name)."""
    from mcore_zoo.weights import io

    monkeypatch.setitem(io._DTYPES, "F8_E4M3", torch.uint8)
    _header_file(tmp_path / "model.safetensors", {"w": {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]}}, b"\0" * 16)
    assert set(io.read_safetensors_header(tmp_path / "model.safetensors")) == {"w"}
    with pytest.raises(CheckpointFormatError, match=r"quantized checkpoints are not supported \(F8_E4M3\)"):
        HFCheckpoint(tmp_path)


def test_deeply_nested_header_is_named(tmp_path):
    blob = b"[" * 100000 + b"]" * 100000
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_weights_path_that_is_not_a_file(tmp_path, kind):
    import os

    target = tmp_path / "model.safetensors"
    if kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"w": 3}, "x"])
def test_index_with_a_non_mapping_weight_map(tmp_path, weight_map):
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError, match="weight_map"):
        HFCheckpoint(tmp_path)


# ---------------------------------------------------------------------------- 2. tied embeddings
def _with_head(src: Path, dst: Path, head) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state["lm_head.weight"] = head(state["model.embed_tokens.weight"])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_tied_config_with_a_different_lm_head_is_refused(mpu, reference_checkpoint, tmp_path):
    src = reference_checkpoint("Qwen2ForCausalLM")  # tie_word_embeddings: true
    assert json.loads((src / "config.json").read_text())["tie_word_embeddings"] is True

    def perturb(emb):
        head = emb.clone()
        head[7, 3] += 1.0
        return head

    ckpt = _with_head(src, tmp_path / "c", perturb)
    model = mcore_zoo.build_model(src, backend="local")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ZooError, match=r"'lm_head\.weight' differs .*row 7"):
        mcore_zoo.load_hf_weights(model, ckpt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_tied_config_with_an_identical_lm_head_loads(mpu, reference_checkpoint, tmp_path):
    src = reference_checkpoint("Qwen2ForCausalLM")
    ckpt = _with_head(src, tmp_path / "c", lambda emb: emb.clone())
    report = mcore_zoo.load_hf_weights(mcore_zoo.build_model(src, backend="local"), ckpt)
    assert "lm_head.weight" in report.ignored


# ---------------------------------------------------------------------------- 3. output directories
def test_the_final_swap_refuses_a_target_that_appeared_meanwhile(tmp_path):
    from mcore_zoo.weights.io import atomic_output_dir

    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match="while this output was written"):
        with atomic_output_dir(out) as tmp:
            (tmp / "mine.txt").write_text("second")
            with atomic_output_dir(out) as other:  # a concurrent run finishes first
                (other / "theirs.txt").write_text("first")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial left behind


def test_overwrite_replaces_only_a_previous_zoo_output(tmp_path):
    from mcore_zoo.weights.io import atomic_output_dir

    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["b.txt"]
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match="did not write.*notes.txt"):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "c.txt").write_text("3")
    assert (out / "notes.txt").read_text() == "the user's" and (out / "b.txt").is_file()


def test_overwrite_checks_every_depth(tmp_path):
    """The manifest lists every file the zoo wrote at every depth with its size: a user's file in a
    sub-folder of a previous output, a file changed since, or a link stops ``overwrite``."""
    import os

    from mcore_zoo.weights.io import atomic_output_dir

    out = tmp_path / "out"

    def write(first: str) -> None:
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "sub" / "deeper").mkdir(parents=True)
            (tmp / "sub" / "deeper" / "w.bin").write_text(first)
            (tmp / "top.txt").write_text("t")

    write("1")
    write("2")  # a previous zoo output, untouched: replaced
    assert (out / "sub" / "deeper" / "w.bin").read_text() == "2"
    for name, make in [("sub/deeper/notes.txt", lambda p: p.write_text("the user's")),
                       ("sub/deeper/w.bin", lambda p: p.write_text("changed by the user")),
                       ("sub/mine", lambda p: p.mkdir()),
                       ("sub/link", lambda p: p.symlink_to(tmp_path))]:  # fmt: skip
        target = out / name
        before = target.read_text() if target.is_file() else None
        make(target)
        with pytest.raises(FileExistsError, match=name):
            write("3")
        assert (out / "top.txt").is_file()  # nothing removed
        if before is None:
            target.unlink() if target.is_symlink() or target.is_file() else os.rmdir(target)
        else:
            target.write_text(before)
    write("4")
    assert (out / "sub" / "deeper" / "w.bin").read_text() == "4"


def test_overwrite_never_deletes_an_input_or_its_parent(mpu, reference_checkpoint, tmp_path):
    from mcore_zoo.cli import main

    src = tmp_path / "models" / "hf"
    shutil.copytree(reference_checkpoint("Qwen2ForCausalLM"), src)
    (tmp_path / "models" / "other.txt").write_text("unrelated")
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src.parent):
        assert main(["convert", "--hf", str(src), "--out", str(out), "--overwrite"]) == 2
    assert sorted(p.name for p in src.iterdir()) == before
    assert (tmp_path / "models" / "other.txt").read_text() == "unrelated"
    mcore = tmp_path / "mcore"
    assert main(["convert", "--hf", str(src), "--out", str(mcore)]) == 0
    assert main(["convert", "--mcore", str(mcore), "--out", str(mcore), "--overwrite"]) == 2
    assert (mcore / "mcore_zoo.json").is_file()


def test_cli_message_names_the_flag(mpu, reference_checkpoint, tmp_path, capsys):
    from mcore_zoo.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["convert", "--hf", str(reference_checkpoint("Qwen2ForCausalLM")), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err


def test_stale_partials_of_killed_runs_are_removed(tmp_path):
    import socket
    import subprocess

    from mcore_zoo.weights.io import atomic_output_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.partial-{socket.gethostname()}-{dead.pid}-abcd1234"
    stale.mkdir()
    (stale / "shard.tmp").write_bytes(b"\0" * 1000)
    foreign = tmp_path / ".out.partial-otherhost-1-abcd1234"
    foreign.mkdir()
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("1")
    assert not stale.exists() and foreign.exists()


def test_output_directories_follow_the_umask(tmp_path):
    import os

    from mcore_zoo.weights.io import atomic_output_dir

    old = os.umask(0o022)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "a.txt").write_text("1")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------------------- 6. config values
def _config_dir(tmp_path: Path, edit) -> Path:
    from mcore_zoo.testing.common import case_config

    config = case_config("LlamaForCausalLM")
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_show_marks_fields_only_transformers_defaults_filled(tmp_path, capsys):
    from mcore_zoo.cli import main

    path = _config_dir(tmp_path, lambda c: (c.pop("hidden_size"), c.pop("head_dim", None)))
    assert main(["show", "--config", str(path), "--json"]) == 0
    fields = {f["field"]: f for f in json.loads(capsys.readouterr().out)["fields"]}
    assert fields["hidden_size"]["value"] == 4096 and fields["hidden_size"]["present"] is False
    assert fields["num_hidden_layers"]["present"] is True
    assert fields["rope_parameters"]["present"] is True  # derived from rope_theta / rope_scaling


def test_rope_theta_that_is_not_a_number_is_refused(tmp_path):
    from mcore_zoo.errors import UnsupportedConfigError

    path = _config_dir(tmp_path, lambda c: c.update(rope_theta="ten thousand"))
    with pytest.raises(UnsupportedConfigError, match="rope_theta='ten thousand'"):
        mcore_zoo.lookup(str(path)).config_from_hf(str(path))


def test_non_utf8_config_is_named(tmp_path):
    from mcore_zoo.errors import ConfigError
    from mcore_zoo.config.normalize import normalize_hf_config

    (tmp_path / "config.json").write_bytes(b'{"model_type": "llama", "name": "\xff"}')
    with pytest.raises(ConfigError, match="config.json is not UTF-8"):
        normalize_hf_config(tmp_path)


def test_parity_model_refuses_bin_before_transformers_reads_it(tmp_path, reference_checkpoint, monkeypatch):
    from mcore_zoo.parity.inputs import prepare_model

    src = reference_checkpoint("LlamaForCausalLM")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    torch.save(load_file(str(src / "model.safetensors")), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="allow_torch_load"):
        prepare_model(model=str(tmp_path), work_dir=tmp_path / "work")


def test_unknown_numerics_knob_is_named():
    from mcore_zoo.numerics.profiles import get_profile

    with pytest.raises(ZooError, match="unknown numerics knob 'foo'"):
        get_profile("default").with_knobs(foo="bar")


def test_max_shard_size_must_be_a_size():
    from mcore_zoo.weights.io import parse_size

    assert parse_size("1.5KiB") == 1536 and parse_size(10) == 10 and parse_size("5GB") == 5 * 10**9
    for bad in ("abc", "0", "-1MB", "GB"):
        with pytest.raises(ZooError, match="size"):
            parse_size(bad)


class _Payload:
    """Unpickling this runs a command (the way a crafted .metadata attacks a reader)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_crafted_dcp_metadata_runs_no_code(mpu, reference_checkpoint, tmp_path):
    """``convert --mcore`` and ``load_mcore_checkpoint`` read a distributed checkpoint's
    ``.metadata`` with an allow-list unpickler: a pickle that would run a command is refused,
    naming the file and the global, and the command never runs (unless the user trusts it)."""
    import pickle

    from mcore_zoo.cli import main
    from mcore_zoo.distributed.io import read_dcp_metadata

    ckpt = reference_checkpoint("LlamaForCausalLM")
    mcore = tmp_path / "mcore"
    assert main(["-q", "convert", "--hf", str(ckpt), "--out", str(mcore)]) == 0
    assert type(read_dcp_metadata(mcore / ".metadata")).__name__ == "Metadata"  # the real one passes
    marker = tmp_path / "pwned"
    (mcore / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ZooError, match=r"\.metadata.*refused to unpickle (posix|os)\.system"):
        read_dcp_metadata(mcore / ".metadata")
    assert main(["-q", "convert", "--mcore", str(mcore), "--out", str(tmp_path / "back")]) == 2
    assert not marker.exists() and not (tmp_path / "back").exists()
    model = mcore_zoo.build_model(ckpt, backend="portable", params_dtype=torch.float32)
    with pytest.raises(ZooError, match="refused to unpickle"):
        mcore_zoo.load_mcore_checkpoint(model, mcore)
    assert not marker.exists()
