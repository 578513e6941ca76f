"""The conformance suite judged by its own verdicts: a pytest run (in a subprocess, as a plugin
author runs it) over fake installed distributions - a correct plugin, one with a broken weight map,
one whose converter classifies fields in bulk, one that claims a built-in architecture, one whose
import raises, one that imports torch at discovery, and one that is not installed. Each broken
plugin must fail exactly the contract it breaks, with a message naming the contract and the fix;
the correct plugin passes next to them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from ..conftest import subprocess_env
from .test_registry import make_dist

GOOD = '''
from mcore_zoo import ModelEntry, hookimpl
from mcore_zoo.plugins.llama import EXAMPLE_CONFIG

def entry(arch, **kw):
    fields = dict(model_type="llama", converter="mcore_zoo.plugins.llama:convert",
                  weight_rules="mcore_zoo.weights.dense:dense_decoder_weight_map",
                  example_config=dict(EXAMPLE_CONFIG, architectures=[arch]),
                  hf_model_class="transformers:LlamaForCausalLM")
    fields.update(kw)
    return ModelEntry(arch, **fields)

@hookimpl
def mcore_zoo_architectures():
    return [entry({arch!r}{extra})]
'''

SWAPPED_RULES = '''
def weight_map(arch):
    """gate and up swapped: the round trip still holds, the model is wrong."""
    from mcore_zoo.weights.dense import dense_decoder_weight_map
    from mcore_zoo.weights.rules import Rule, WeightMap
    good = dense_decoder_weight_map(arch)
    rules = [Rule(r.mcore, tuple(reversed(r.sources)), r.transform) if r.mcore.endswith("linear_fc1.weight") else r
             for r in good.rules]
    return WeightMap(arch, rules, good.ignored)
'''

LAZY_CONVERTER = '''
def convert(reader):
    """classifies whatever is left in bulk: an unknown field passes silently."""
    from mcore_zoo.plugins.llama import convert as llama
    arch = llama(reader)
    for name in list(reader.unclassified()):
        reader.ignore(name, "everything else is fine")
    return arch
'''

BAD_SPEC = '''
def layer_spec(arch, backend, numerics, *, config, vp_stage=None, pp_rank=None):
    """a q_layernorm slot filled with a module whose constructor Megatron-Core cannot call."""
    import copy
    import torch
    from mcore_zoo.specs.gpt import gpt_layer_specs
    block = gpt_layer_specs(arch, backend, numerics, config=config, vp_stage=vp_stage, pp_rank=pp_rank)
    layer = copy.deepcopy(block.layer_specs[0])
    layer.submodules.self_attention.submodules.q_layernorm = torch.nn.LayerNorm
    block.layer_specs = [layer] * len(block.layer_specs)
    return block
'''

SUITES = '''
from mcore_zoo.testing import ConformanceSuite

class TestGood(ConformanceSuite):
    plugin = "good"

class TestSwapped(ConformanceSuite):
    plugin = "swapped"

class TestLazy(ConformanceSuite):
    plugin = "lazy"

class TestRival(ConformanceSuite):
    plugin = "rival"

class TestBadSpec(ConformanceSuite):
    plugin = "badspec"

class TestBroken(ConformanceSuite):
    plugin = "broken"

class TestHeavy(ConformanceSuite):
    plugin = "heavy"

class TestMissing(ConformanceSuite):
    plugin = "not_installed"
'''

SELECTION = (
    "(TestGood and not tensor_parallel and not expert_parallel and not gradients) or (TestSwapped and (weight_map or parity)) or (TestLazy and bad_input)"
    " or (TestRival and (registration or test_config)) or (TestBadSpec and (test_build or weight_map)) or TestBroken or ((TestHeavy or TestMissing) and registration)"
)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    make_dist(site, "zoo-good", "1.0", "good", "zoo_good", GOOD.format(arch="GoodLlamaForCausalLM", extra=""))
    make_dist(site, "zoo-swapped", "1.0", "swapped", "zoo_swapped",
              GOOD.format(arch="SwappedLlamaForCausalLM", extra=', weight_rules="zoo_swapped:weight_map"') + SWAPPED_RULES)
    make_dist(site, "zoo-lazy", "1.0", "lazy", "zoo_lazy",
              GOOD.format(arch="LazyLlamaForCausalLM", extra=', converter="zoo_lazy:convert"') + LAZY_CONVERTER)
    make_dist(site, "zoo-badspec", "1.0", "badspec", "zoo_badspec",
              GOOD.format(arch="BadSpecLlamaForCausalLM", extra=', layer_spec="zoo_badspec:layer_spec"') + BAD_SPEC)
    make_dist(site, "zoo-rival", "0.9", "rival", "zoo_rival", GOOD.format(arch="LlamaForCausalLM", extra=""))
    make_dist(site, "zoo-broken", "0.1", "broken", "zoo_broken", "raise RuntimeError('needs CUDA 99')\n")
    make_dist(site, "zoo-heavy", "1.0", "heavy", "zoo_heavy", "import torch\n" + GOOD.format(arch="HeavyLlamaForCausalLM", extra=""))  # fmt: skip
    project = tmp_path_factory.mktemp("project")
    (project / "test_plugins.py").write_text(textwrap.dedent(SUITES))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k", SELECTION,
         f"--junitxml={project / 'junit.xml'}", f"--basetemp={project / 'tmp'}", "test_plugins.py"],
        cwd=project, env=subprocess_env(site), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    results = {}
    for case in ET.parse(project / "junit.xml").getroot().iter("testcase"):
        failure = case.find("failure")
        skipped = case.find("skipped")
        outcome = "failed" if failure is not None else "skipped" if skipped is not None else "passed"
        text = "" if failure is None else (failure.get("message", "") + "\n" + (failure.text or ""))
        results[f"{case.get('classname').split('.')[-1]}::{case.get('name')}"] = (outcome, text)
    return proc, results


def outcome(verdicts, name):
    return verdicts[1][name]


def test_correct_plugin_passes_next_to_broken_ones(verdicts):
    proc, results = verdicts
    good = {k: v[0] for k, v in results.items() if k.startswith("TestGood::")}
    assert set(good) == {f"TestGood::test_{c}" + ("[good]" if c == "registration" else "[GoodLlamaForCausalLM]")
                         for c in ("registration", "config", "build", "weight_map", "parity", "thd", "bad_input")}, good  # fmt: skip
    assert set(good.values()) == {"passed"}, proc.stdout[-5000:]
    assert proc.returncode == 1  # the broken plugins fail the run


def test_broken_weight_map_fails_parity_not_round_trip(verdicts):
    assert outcome(verdicts, "TestSwapped::test_weight_map[SwappedLlamaForCausalLM]")[0] == "passed"
    status, text = outcome(verdicts, "TestSwapped::test_parity[SwappedLlamaForCausalLM]")
    assert status == "failed"
    assert "mcore-zoo contract 'parity' broken for SwappedLlamaForCausalLM (example config)" in text
    assert "how to fix:" in text
    assert "where False" not in text  # the suite's own messages, not assertion introspection
    # the stage-by-stage diagnosis points at the first layer's MLP, after equal embedding and attention
    assert "embedding: equal" in text and "layer 0 attention: equal" in text
    assert "layer 0 MLP: max |diff|" in text and "first difference is in layer 0 MLP: check the activation, the gate/up order" in text


def test_model_that_cannot_be_constructed_breaks_the_build_contract_wherever_it_is_built(verdicts):
    """A bad q_layernorm spec: contract ``build`` broken, in its own test and in the weight-map
    test that needed the model (not reported as a weight-map failure)."""
    for test in ("test_build", "test_weight_map"):
        status, text = outcome(verdicts, f"TestBadSpec::{test}[BadSpecLlamaForCausalLM]")
        assert status == "failed", (test, text)
        assert "mcore-zoo contract 'build' broken for BadSpecLlamaForCausalLM (example config), backend" in text, text
        assert "contract 'weight-map' broken" not in text and "LayerNorm" in text


def test_bulk_classifying_converter_fails_bad_input(verdicts):
    status, text = outcome(verdicts, "TestLazy::test_bad_input[LazyLlamaForCausalLM]")
    assert status == "failed" and "contract 'bad-input'" in text
    assert "zoo_conformance_unknown_field" in text and "classify fields one by one" in text


def test_architecture_claimed_twice_is_a_conflict_naming_both(verdicts):
    for name in ("TestRival::test_registration[rival]", "TestRival::test_config[LlamaForCausalLM]"):
        status, text = outcome(verdicts, name)
        assert status == "failed" and "contract 'registration'" in text and "PluginConflictError" in text
        assert "plugin 'llama' from mcore-zoo" in text and "plugin 'rival' from zoo-rival 0.9" in text
        assert "override=True" in text


def test_plugin_whose_import_raises_is_reported_and_the_rest_is_skipped(verdicts):
    status, text = outcome(verdicts, "TestBroken::test_registration[broken]")
    assert status == "failed" and "plugin 'broken' (zoo-broken 0.1) failed to load" in text
    assert "RuntimeError: needs CUDA 99" in text
    assert outcome(verdicts, "TestBroken::test_config[none]")[0] == "skipped"


def test_heavy_import_at_discovery_and_missing_plugin(verdicts):
    status, text = outcome(verdicts, "TestHeavy::test_registration[heavy]")
    assert status == "failed" and "imports torch" in text
    status, text = outcome(verdicts, "TestMissing::test_registration[not_installed]")
    assert status == "failed" and "no plugin named 'not_installed' is installed" in text and "good (zoo-good)" in text


def test_report_is_short_and_summarised(verdicts):
    proc, _ = verdicts
    out = proc.stdout
    assert "mcore-zoo conformance" in out and "registration" in out and "broken for:" in out
    # contract failures are reported as their message, not as a traceback through the suite
    assert "suite.py:" not in out and "checks.py:" not in out


def test_the_gradient_contract_catches_a_gradient_off_by_a_little(mpu, reference_checkpoint):
    """``check_gradients`` (contract ``gradients``): gathered gradients equal to one process's pass;
    one tensor off by 0.1% of its largest entry - what a parameter whose TP partial gradients are
    never summed looks like, only smaller - fails, naming the tensor and the rank."""
    import torch

    from mcore_zoo.registry import get_registry
    from mcore_zoo.testing.checks import GRADIENT_NUMERICS, build, check_gradients, gradient_step
    from mcore_zoo.testing.contracts import ContractError

    architecture = get_registry().get("LlamaForCausalLM")
    ckpt = reference_checkpoint("LlamaForCausalLM")
    grads = gradient_step(build(architecture, ckpt, numerics=GRADIENT_NUMERICS, load=ckpt))
    check_gradients(architecture, ckpt, "llama", [{"llama": {"grads": grads}}] * 2, "TP=2")
    name = "model.layers.0.self_attn.q_proj.weight"
    off = dict(grads)
    off[name] = grads[name] + 1e-3 * grads[name].abs().max() * torch.sign(torch.randn_like(grads[name]))
    with pytest.raises(ContractError, match=r"rank 1: model\.layers\.0\.self_attn\.q_proj\.weight"):
        check_gradients(architecture, ckpt, "llama", [{"llama": {"grads": grads}}, {"llama": {"grads": off}}], "TP=2")
