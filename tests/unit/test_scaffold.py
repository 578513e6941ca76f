"""``mcore-zoo new-plugin``: the generated package says what the author must fill in, refuses to
clobber, and - once the TODOs are filled in - installs and passes mcore-zoo's conformance suite."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from mcore_zoo.architecture import Architecture
from mcore_zoo.cli import main
from mcore_zoo.errors import UnclassifiedConfigFieldsError

from ..conftest import pip_install_target, subprocess_env


def load_module(path):
    spec = importlib.util.spec_from_file_location(f"generated_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phi3_todo_lists_the_fields_and_tensors_the_dense_decoder_does_not_cover(tmp_path, capsys):
    out = tmp_path / "pkg"
    assert main(["new-plugin", "phi3x", "--arch", "Phi3ForCausalLM", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "src/mcore_zoo_phi3x/__init__.py",
                     "src/mcore_zoo_phi3x/plugin.py", "tests/test_conformance.py"]  # fmt: skip
    pyproject = (out / "pyproject.toml").read_text()
    assert '[project.entry-points.mcore_zoo]\nphi3x = "mcore_zoo_phi3x.plugin"' in pyproject
    assert 'plugin = "phi3x"' in (out / "tests/test_conformance.py").read_text()
    fields = ["embd_pdrop", "original_max_position_embeddings", "resid_pdrop", "sliding_window"]
    tensors = ["model.layers.{layer}.mlp.gate_up_proj.weight", "model.layers.{layer}.self_attn.qkv_proj.weight"]
    source = (out / "src/mcore_zoo_phi3x/plugin.py").read_text()
    readme = (out / "README.md").read_text()
    for name in fields + tensors:
        assert name in source and name in printed
    assert all(f"`{name}`" in readme for name in fields) and "split_rows" in source
    # the four contributions, named lazily, and the fail-closed converter
    module = load_module(out / "src/mcore_zoo_phi3x/plugin.py")
    (entry,) = module.mcore_zoo_architectures()
    assert (entry.converter, entry.weight_rules) == ("mcore_zoo_phi3x.plugin:convert", "mcore_zoo_phi3x.plugin:weight_map")
    assert (entry.layer_spec, entry.forward) == ("mcore_zoo_phi3x.plugin:layer_spec", "mcore_zoo_phi3x.plugin:forward")
    arch = Architecture(entry.replace(converter=module.convert, weight_rules=module.weight_map), "phi3x", "test", "0")
    with pytest.raises(UnclassifiedConfigFieldsError) as err:
        arch.config_from_hf(arch.example_config())
    assert sorted(err.value.fields) == fields


def test_json_output_and_refusals(tmp_path, capsys):
    assert main(["new-plugin", "helium", "--arch", "HeliumForCausalLM", "--out", str(tmp_path / "h"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["todo_fields"] == ["attention_bias", "mlp_bias"] and report["unconsumed_tensors"] == []
    # the directory is not empty now
    assert main(["new-plugin", "helium", "--arch", "HeliumForCausalLM", "--out", str(tmp_path / "h")]) == 2
    assert "not empty" in capsys.readouterr().err
    # an architecture another plugin provides needs --override
    assert main(["new-plugin", "myllama", "--arch", "LlamaForCausalLM", "--out", str(tmp_path / "l")]) == 2
    assert "already provided by plugin 'llama' from mcore-zoo" in capsys.readouterr().err
    assert main(["new-plugin", "myllama", "--arch", "LlamaForCausalLM", "--out", str(tmp_path / "l"), "--override"]) == 0
    assert "override=True" in (tmp_path / "l/src/mcore_zoo_myllama/plugin.py").read_text()
    capsys.readouterr()
    # a misspelt class gets suggestions; a bad plugin name is refused
    assert main(["new-plugin", "x", "--arch", "Phi3ForCausalLm", "--out", str(tmp_path / "x")]) == 2
    assert "Did you mean: Phi3ForCausalLM" in capsys.readouterr().err
    assert main(["new-plugin", "Bad-Name", "--arch", "HeliumForCausalLM", "--out", str(tmp_path / "y")]) == 2
    assert "lowercase" in capsys.readouterr().err


FILLED_IN = '''    import dataclasses

    reader.expect("attention_bias", False, reason="q/k/v biases are not implemented")
    reader.expect("mlp_bias", False, reason="MLP biases are not implemented")
    arch = read_dense_decoder(reader)
    return arch.replace(rope=dataclasses.replace(arch.rope, interleaved=True))  # Helium rotates pairs (0::2, 1::2)
'''


@pytest.mark.slow
def test_generated_package_installs_and_passes_once_filled_in(tmp_path):
    """Generated for Helium (a transformers architecture mcore-zoo does not ship): as generated, it
    installs, registers, and stops at the config contract naming the two fields to classify; with
    those classified (and Helium's interleaved RoPE pairs set) every contract passes."""
    out = tmp_path / "mcore-zoo-helium"
    assert main(["new-plugin", "helium", "--arch", "HeliumForCausalLM", "--out", str(out)]) == 0
    target = tmp_path / "site"
    pip_install_target(out, target, tmp_path)

    def run_tests(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--basetemp={tmp_path / 'tmp'}", *args],
                              cwd=out, env=subprocess_env(target), capture_output=True, text=True, timeout=900)  # fmt: skip

    first = run_tests("-k", "registration or test_config")
    assert first.returncode == 1
    assert "registration     1 passed" in first.stdout and "config           1 failed" in first.stdout
    assert "UnclassifiedConfigFieldsError" in first.stdout and "attention_bias = False" in first.stdout
    assert "mlp_bias = False" in first.stdout and "how to fix:" in first.stdout

    installed = target / "mcore_zoo_helium" / "plugin.py"
    source = installed.read_text()
    assert source.count("    return read_dense_decoder(reader)\n") == 1
    installed.write_text(source.replace("    return read_dense_decoder(reader)\n", FILLED_IN))
    second = run_tests()
    assert second.returncode == 0, second.stdout[-6000:]
    for contract in ("registration", "config", "build", "weight-map", "parity", "thd", "tensor-parallel", "bad-input"):
        assert f"{contract:<16} 1 passed\n" in second.stdout
