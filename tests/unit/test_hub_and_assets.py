"""Hugging Face Hub ids (offline, from a pre-filled cache) and the files that travel with the
weights (tokenizer, generation_config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.cli import main

ASSETS = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast"}',
    "special_tokens_map.json": "{}",
    "generation_config.json": '{"do_sample": true, "temperature": 0.6, "top_p": 0.95}',
}


def _with_assets(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for name, text in ASSETS.items():
        (dst / name).write_text(text)
    (dst / "pytorch_model.bin").write_bytes(b"never fetched")  # a Hub download is safetensors only
    return dst


def _fill_cache(cache: Path, repo: str, source: Path, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The layout huggingface_hub writes: blobs, snapshots/<commit>/ (links to blobs), refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        blob = root / "blobs" / f"blob-{path.name}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder named like the repo
    from mcore_zoo import hub

    hub._snapshot.cache_clear()
    yield cache
    hub._snapshot.cache_clear()


def test_hub_id_builds_loads_and_converts_offline(mpu, reference_checkpoint, tmp_path, offline_hub):
    src = _with_assets(reference_checkpoint("Qwen2ForCausalLM"), tmp_path / "src")
    _fill_cache(offline_hub, "tiny-org/tiny-qwen2", src)
    assert mcore_zoo.lookup("tiny-org/tiny-qwen2").name == "Qwen2ForCausalLM"
    model = mcore_zoo.build_model("tiny-org/tiny-qwen2", backend="local", load="tiny-org/tiny-qwen2")
    state = load_file(str(src / "model.safetensors"))
    for name, tensor in mcore_zoo.iter_hf_weights(model):
        assert torch.equal(tensor, state[name])
    assert main(["-q", "convert", "--hf", "tiny-org/tiny-qwen2@main", "--out", str(tmp_path / "mcore")]) == 0
    assert (tmp_path / "mcore" / "hf_assets" / "tokenizer.json").is_file()


def test_unknown_hub_id_offline_is_one_clear_error(offline_hub, capsys):
    assert main(["show", "--config", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert "nobody/nothing" in err and "HF_HUB_OFFLINE" in err and len(err.strip().splitlines()) == 1


def test_hub_download_patterns_are_safetensors_only():
    import fnmatch

    from mcore_zoo.hub import ALLOW_PATTERNS, is_hub_id

    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)

    assert fetched("model-00001-of-00002.safetensors") and fetched("tokenizer.model") and fetched("config.json")
    assert not fetched("pytorch_model.bin") and not fetched("model.pt") and not fetched("model.gguf")
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("Qwen/Qwen3-8B@v1.0")
    assert not is_hub_id("LlamaForCausalLM") and not is_hub_id("../x/y") and not is_hub_id("a/config.json")


def test_save_hf_checkpoint_writes_tokenizer_and_generation_config(mpu, reference_checkpoint, tmp_path):
    src = _with_assets(reference_checkpoint("LlamaForCausalLM"), tmp_path / "src")
    (src / "pytorch_model.bin").unlink()
    model = mcore_zoo.build_model(src, backend="local", load=src)
    out = tmp_path / "export"
    mcore_zoo.save_hf_checkpoint(model, out)
    for name, text in ASSETS.items():
        assert (out / name).read_text() == text, name
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(str(out)).temperature == 0.6


def test_convert_round_trip_keeps_tokenizer_and_generation_config(mpu, reference_checkpoint, tmp_path):
    src = _with_assets(reference_checkpoint("LlamaForCausalLM"), tmp_path / "src")
    (src / "pytorch_model.bin").unlink()
    assert main(["-q", "convert", "--hf", str(src), "--out", str(tmp_path / "mcore")]) == 0
    assert main(["-q", "convert", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    for name, text in ASSETS.items():
        assert (tmp_path / "back" / name).read_text() == text, name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_assets_that_link_outside_the_checkpoint_are_refused(mpu, reference_checkpoint, tmp_path):
    """A tokenizer file that is a link to a file outside the checkpoint (or the Hub cache entry
    it comes from) is refused by name, by ``save_hf_checkpoint``, ``convert --hf`` and
    ``convert --mcore`` (its ``hf_assets/``): its contents never reach an export."""
    from mcore_zoo.errors import InputError

    secret = tmp_path / "secret.txt"
    secret.write_text("not for the export")
    src = _with_assets(reference_checkpoint("LlamaForCausalLM"), tmp_path / "src")
    (src / "pytorch_model.bin").unlink()
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    model = mcore_zoo.build_model(src, backend="portable", load=src, params_dtype=torch.float32)
    with pytest.raises(InputError, match="tokenizer.json.*outside the checkpoint"):
        mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["-q", "convert", "--hf", str(src), "--out", str(tmp_path / "m1")]) == 2
    assert not (tmp_path / "m1").exists()
    # an mcore checkpoint whose hf_assets/ holds such a link
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").write_text(ASSETS["tokenizer.json"])
    assert main(["-q", "convert", "--hf", str(src), "--out", str(tmp_path / "m2")]) == 0
    linked = tmp_path / "m2" / "hf_assets" / "tokenizer.json"
    linked.unlink()
    linked.symlink_to(secret)
    assert main(["-q", "convert", "--mcore", str(tmp_path / "m2"), "--out", str(tmp_path / "back")]) == 2
    assert not (tmp_path / "back").exists()
    # a link inside the checkpoint is fine
    linked.unlink()
    linked.symlink_to(tmp_path / "m2" / "hf_assets" / "tokenizer_config.json")
    assert main(["-q", "convert", "--mcore", str(tmp_path / "m2"), "--out", str(tmp_path / "back")]) == 0
