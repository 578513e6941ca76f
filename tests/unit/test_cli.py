"""``mcore-zoo`` subcommands, in process (exit codes and output) and one conversion round trip."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from mcore_zoo.cli import main


def test_list_and_plugins(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "mcore-zoo" in out
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["architecture"] for r in rows} >= {"Qwen3ForCausalLM", "MistralForCausalLM"}
    assert main(["plugins", "--json"]) == 0
    plugins = json.loads(capsys.readouterr().out)["plugins"]
    assert all(p["status"] == "loaded" for p in plugins if p["builtin"])


def test_show_json_classifies_every_field(capsys):
    assert main(["show", "Qwen3ForCausalLM", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    kinds = {f["field"]: f["kind"] for f in shown["fields"]}
    assert kinds["head_dim"] == "mapped" and kinds["use_cache"] == "ignored"
    assert shown["transformer_config"]["qk_layernorm"] is True
    assert shown["transformer_config"]["kv_channels"] == 24
    assert any(r["transform"] == "qkv-interleave" for r in shown["weight_rules"])


def _strict_json(text: str):
    """``json.loads`` that refuses ``NaN`` / ``Infinity`` (not JSON: jq and browsers reject them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_show_json_is_strict_json_for_every_builtin(capsys):
    """Every built-in's ``show --json`` parses as strict JSON - a MoE spec holds ``-inf`` (the
    mask value of the expert groups not chosen), written as ``"-inf"``."""
    from mcore_zoo.registry import get_registry

    registry = get_registry()
    for name in registry.architectures():
        assert main(["show", name, "--json"]) == 0, name
        shown = _strict_json(capsys.readouterr().out)
        if name == "DeepseekV3ForCausalLM":
            assert shown["moe"]["group_mask_value"] == "-inf" and shown["moe"]["topk_sorted"] is False


def test_show_published_config_with_layout(capsys):
    from ..conftest import CONFIGS

    assert main(["show", "--config", str(CONFIGS / "llama-3.1-8b.json"), "--tp", "8", "--pp", "4", "--json"]) == 0
    tc = json.loads(capsys.readouterr().out)["transformer_config"]
    assert tc["tensor_model_parallel_size"] == 8 and tc["pipeline_model_parallel_size"] == 4


def test_errors_exit_2_with_the_reason(capsys):
    from ..conftest import CONFIGS

    assert main(["show", "--config", str(CONFIGS / "llama-3.1-8b.json"), "--tp", "3"]) == 2
    assert "not divisible by tp=3" in capsys.readouterr().err
    assert main(["show", "GPT2LMHeadModel"]) == 2
    assert "LlamaForCausalLM" in capsys.readouterr().err


def test_convert_round_trip_through_dist_checkpoint(mpu, reference_checkpoint, tmp_path):
    hf = reference_checkpoint("Qwen2ForCausalLM")
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "mcore")]) == 0
    assert (tmp_path / "mcore" / "mcore_zoo.json").is_file()
    assert main(["convert", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    a = load_file(str(hf / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # refuses to overwrite, leaves the existing output alone
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "mcore")]) == 2


def test_convert_needs_a_direction(tmp_path, capsys):
    assert main(["convert", "--out", str(tmp_path / "x")]) == 2
    assert "exactly one of" in capsys.readouterr().err


def test_ignore_field_on_convert_and_parity_report(mpu, reference_checkpoint, tmp_path, capsys):
    """An unclassified HF config field stops convert and parity-report, naming the field and the
    flag; ``--ignore-field NAME=REASON`` lets both run, convert records it for the way back, and the
    report says it was ignored. Without a reason the flag is refused."""
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(reference_checkpoint("LlamaForCausalLM"), hf)
    config = json.loads((hf / "config.json").read_text())
    config["made_up_field"] = 3
    (hf / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "made_up_field" in err and "--ignore-field" in err
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "m"), "--ignore-field", "made_up_field"]) == 2
    assert "NAME=REASON" in capsys.readouterr().err
    assert main(["convert", "--hf", str(hf), "--out", str(tmp_path / "m"), "--ignore-field", "made_up_field=unused"]) == 0
    meta = json.loads((tmp_path / "m" / "mcore_zoo.json").read_text())
    assert meta["ignore_fields"] == {"made_up_field": "unused"}
    assert main(["convert", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "back")]) == 0
    assert main(["convert", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "b2"), "--ignore-field", "x=y"]) == 2
    capsys.readouterr()
    assert main(["parity-report", "--model", str(hf), "-q", "--no-layers", "--no-baseline"]) == 2
    assert "made_up_field" in capsys.readouterr().err
    assert main(["parity-report", "--model", str(hf), "-q", "--no-layers", "--no-baseline",
                 "--ignore-field", "made_up_field=unused"]) == 0  # fmt: skip
    assert "'made_up_field' ignored on request (--ignore-field): unused" in capsys.readouterr().out


def test_library_warnings_only_with_debug():
    """Megatron-Core's import-time warnings (Transformer Engine / Apex missing, ...) say nothing
    about the user's input: a command prints none of them unless ``--debug``."""
    import subprocess
    import sys

    from ..conftest import CONFIGS

    command = [sys.executable, "-m", "mcore_zoo.cli", "show", "--config", str(CONFIGS / "llama-3.1-8b.json")]
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = subprocess.run(command[:3] + ["--debug"] + command[3:], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0 and "Warning" in loud.stderr


def test_show_refuses_a_field_of_the_wrong_type(tmp_path, capsys):
    """``show`` converts the config as every other command does: a RoPE base given in words is a
    usage error naming the field (exit 2), in either place transformers versions keep it."""
    from ..conftest import CONFIGS

    published = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    for where in ("top", "rope_parameters"):
        config = dict(published)
        if where == "top":
            config["rope_theta"] = "ten thousand"
        else:
            config.pop("rope_theta", None)
            config["rope_parameters"] = {**(config.pop("rope_scaling") or {}), "rope_theta": "ten thousand"}
        path = tmp_path / f"{where}.json"
        path.write_text(json.dumps(config))
        assert main(["show", "--config", str(path)]) == 2, where
        assert "rope_theta" in capsys.readouterr().err, where
