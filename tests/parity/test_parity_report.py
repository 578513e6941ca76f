"""``mcore-zoo parity-report`` end to end on CPU: the default job, bitwise mode, the invariance
matrix, and the mutations the report must catch (exit code 1, guilty layer named).

Each mutation is a bug on the mcore side only (a plugin's weight map or config converter); the
reference is always the real transformers model on the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore_zoo.architecture import Architecture
from mcore_zoo.cli import main
from mcore_zoo.weights.rules import Rule, WeightMap

from .mutations import SwapQueryAndKey
from ..conftest import ARCHS, CONFIGS


def _report(out, stem):
    return json.loads((out / f"{stem}.json").read_text())


def _parity(report):
    return next(c for c in report["comparisons"] if c["role"] == "parity")


def test_default_main_job_passes_and_writes_all_formats(tmp_path, capsys):
    """What the README advertises: --arch alone, CPU, tolerance mode; JSON + Markdown + HTML."""
    code = main(["parity-report", "--arch", "LlamaForCausalLM", "--out", str(tmp_path), "-q"])
    assert code == 0
    report = _report(tmp_path, "LlamaForCausalLM")
    assert report["schema_version"] == 1 and report["verdict"] == "pass"
    assert report["command"] == f"mcore-zoo parity-report --arch LlamaForCausalLM --out {tmp_path} -q"
    parity = _parity(report)
    assert parity["metrics"]["positions"] == 60 + 16 + 39 + 7
    assert parity["metrics"]["top1_agreement"] == 1.0
    assert [row["site"] for row in parity["layers"]] == ["embedding", "layer.0", "layer.1", "final_norm", "logits"]
    assert {c["role"] for c in report["comparisons"]} == {"parity", "baseline"}
    md = (tmp_path / "LlamaForCausalLM.md").read_text()
    assert "**Verdict: PASS**" in md and "## Environment" in md and "megatron-core" in md
    assert "numerics profile `default`" in md and "apply_rope_fusion=False" in md
    html = (tmp_path / "LlamaForCausalLM.html").read_text()
    assert html.count("<svg") >= 3 and "first divergent" not in html.lower().split("<h2>summary")[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_bitwise_mode_passes_for_every_architecture(tmp_path, arch):
    """--bitwise selects the hf-exact profile: THD-packed mcore == HF eager on each sequence, bit for bit;
    batch 1 vs N is bitwise too; BSHD (right-padded) vs THD is judged by tolerance."""
    code = main(["parity-report", "--arch", arch, "--bitwise", "--invariance", "--out", str(tmp_path), "-q",
                 "--format", "json"])  # fmt: skip
    report = _report(tmp_path, arch)
    assert code == 0, [c["failures"] for c in report["comparisons"]]
    assert report["mode"] == "bitwise"
    assert report["runs"]["mcore-portable-thd"]["numerics_profile"] == "hf-exact"
    gating = [c for c in report["comparisons"] if c["gating"]]
    assert {c["candidate"] for c in gating} == {"mcore-portable-thd", "mcore-portable-bshd", "mcore-portable-thd-b1"}
    for c in gating:
        if c["candidate"] == "mcore-portable-bshd":
            assert c["criterion"] == "tolerance" and c["passed"]
            continue
        assert c["criterion"] == "bitwise"
        assert c["metrics"]["bitwise_equal"] and c["metrics"]["max_abs_dlogp"] == 0.0
        assert all(row["bitwise_equal"] for row in c["layers"])


class _SwapQKHeadsInLayer(WeightMap):
    """The dense weight map with one bug: in decoder layer ``layer`` the first query head of every
    group and the group's key head trade places (what a wrong q/k interleave does)."""

    def __init__(self, good: WeightMap, layer: int):
        super().__init__(good.arch, good.rules, good.ignored)
        self.layer = layer

    def bind(self, module, **kw):
        bound = super().bind(module, **kw)
        target = f"decoder.layers.{self.layer}.self_attention.linear_qkv.weight"
        for i, b in enumerate(bound):
            if b.mcore == target:
                r = b.rule
                bound[i] = type(b)(Rule(r.mcore, r.sources, SwapQueryAndKey(), r.export, r.layer_kind, r.note), b.mcore, b.hf)
        return bound


def test_broken_weight_map_fails_and_names_the_guilty_layer(tmp_path, monkeypatch, capsys):
    good = Architecture.weight_map
    monkeypatch.setattr(Architecture, "weight_map", lambda self, arch: _SwapQKHeadsInLayer(good(self, arch), 1))
    code = main(["parity-report", "--arch", "Qwen2ForCausalLM", "--set", "num_hidden_layers=3", "--out", str(tmp_path)])
    assert code == 1
    report = _report(tmp_path, "Qwen2ForCausalLM")
    parity = _parity(report)
    assert report["verdict"] == "fail" and not parity["passed"]
    assert parity["first_divergent_site"] == "layer.1"
    rows = {row["site"]: row for row in parity["layers"]}
    assert rows["layer.0"]["bitwise_equal"] or not rows["layer.0"]["flagged"]
    assert rows["layer.1"]["rel_mean_abs"] > 1e-2
    assert parity["metrics"]["mean_abs_dlogp"] > 1e-2
    md = (tmp_path / "Qwen2ForCausalLM.md").read_text()
    assert "| layer.1 |" in md and "**first divergent**" in md.split("| layer.1 |")[1].split("\n")[0]
    assert "first divergent site: layer.1" in capsys.readouterr().out


def test_wrong_rope_base_fails_at_the_first_layer(tmp_path, monkeypatch):
    """A converter that maps the RoPE base wrongly (x2): caught, first divergent site layer.0."""
    convert = Architecture.config_from_hf

    def wrong_rope(self, *a, **kw):
        arch = convert(self, *a, **kw)
        return arch.replace(rope=dataclasses.replace(arch.rope, theta=arch.rope.theta * 2))

    monkeypatch.setattr(Architecture, "config_from_hf", wrong_rope)
    code = main(["parity-report", "--arch", "LlamaForCausalLM", "--out", str(tmp_path), "-q", "--format", "json"])
    assert code == 1
    parity = _parity(_report(tmp_path, "LlamaForCausalLM"))
    assert parity["first_divergent_site"] == "layer.0"
    assert parity["metrics"]["max_abs_dlogp"] > 1e-2


def test_tolerance_mode_default_profile_is_within_float32_tolerance_not_bitwise(tmp_path):
    """Stock kernels (default profile, Qwen3's head_dim 24: mcore's folded softmax scale) are not
    bitwise but well inside the float32 tolerances; --bitwise on the same build fails with exit 1."""
    args = ["parity-report", "--arch", "Qwen3ForCausalLM", "--backend", "local", "--numerics", "default",
            "--out", str(tmp_path), "-q", "--format", "json"]  # fmt: skip
    assert main(args) == 0
    parity = _parity(_report(tmp_path, "Qwen3ForCausalLM"))
    assert parity["candidate"] == "mcore-local-bshd"
    assert not parity["metrics"]["bitwise_equal"] and parity["metrics"]["mean_abs_dlogp"] < 1e-5
    assert main(args + ["--bitwise"]) == 1


def test_scaled_published_config_keeps_what_decides_numerics(tmp_path):
    from mcore_zoo.parity.inputs import scale_config

    config = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    small, changes = scale_config(config, "tiny")
    assert small["num_attention_heads"] // small["num_key_value_heads"] == 4
    assert "head_dim" not in small and small["hidden_size"] // small["num_attention_heads"] == 128
    assert small["hidden_size"] == 512 and small["num_hidden_layers"] == 2
    assert small["rope_scaling"] == config["rope_scaling"] and small["rope_theta"] == config["rope_theta"]
    assert small["vocab_size"] == 512 and small["bos_token_id"] < 512
    assert set(changes) >= {"num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers"}
    code = main(["parity-report", "--config", str(CONFIGS / "qwen2.5-7b.json"), "--random-weights", "--scale", "tiny",
                 "--lengths", "40,9", "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    assert code == 0
    report = _report(tmp_path, "Qwen2ForCausalLM")
    assert report["model"]["scale"] == "tiny" and report["model"]["shape"]["head_dim"] == 128
    assert report["model"]["changes"]["num_hidden_layers"] == [28, 2]


def test_set_reaches_the_nested_configs_of_a_vision_language_config(tmp_path):
    """``--set text_config.FIELD=V`` / ``vision_config.FIELD=V`` change the nested field (recorded under
    that key); a top-level field is set as before; a nested object the config lacks is refused."""
    from mcore_zoo.errors import ZooError
    from mcore_zoo.parity.inputs import prepare_model

    four = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    settings = {"text_config.num_hidden_layers": 4, "text_config.layer_types": four, "vision_config.depth": 1}
    source = prepare_model(config=str(CONFIGS / "qwen3.5-9b.json"), random_weights=True, scale="tiny",
                           settings=settings, work_dir=tmp_path)  # fmt: skip
    assert source.config["text_config"]["num_hidden_layers"] == 4 and source.config["text_config"]["layer_types"] == four
    assert source.config["vision_config"]["depth"] == 1 and "text_config.num_hidden_layers" not in source.config
    assert source.changes["text_config.num_hidden_layers"] == [32, 4]
    with pytest.raises(ZooError, match="no nested 'audio_config'"):
        prepare_model(config=str(CONFIGS / "qwen3.5-9b.json"), random_weights=True, scale="tiny",
                      settings={"audio_config.depth": 1}, work_dir=tmp_path / "x")  # fmt: skip


def test_checkpoint_with_tokenizer_uses_its_tokens(tmp_path, reference_checkpoint):
    """--model DIR: real weights as saved, token ids from the checkpoint's tokenizer; worst tokens decoded."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint("MistralForCausalLM"), ckpt)
    words = sorted({w for w in __import__("mcore_zoo.parity.inputs", fromlist=["x"]).SAMPLE_TEXT.split()})[:250]
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(str(ckpt))
    out = tmp_path / "out"
    assert main(["parity-report", "--model", str(ckpt), "--lengths", "30,12", "--out", str(out), "-q"]) == 0
    report = _report(out, "MistralForCausalLM")
    assert report["inputs"]["source"] == "tokenizer" and not report["model"]["random_weights"]
    worst = _parity(report)["worst_tokens"]
    assert worst and all("next_text" in w for w in worst)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--arch", "GPT2LMHeadModel"], "LlamaForCausalLM"),
        (["--config", str(CONFIGS / "llama-3.1-8b.json")], "--random-weights"),
        (["--arch", "LlamaForCausalLM", "--backend", "te"], "Transformer Engine"),
        (["--arch", "LlamaForCausalLM", "--backend", "local", "--seq-format", "thd"], "cannot run THD"),
        (["--arch", "LlamaForCausalLM", "--lengths", "5,1"], "at least 2 tokens"),
        (["--arch", "LlamaForCausalLM", "--tol", "bogus=1"], "unknown tolerance"),
        (["--model", "/nonexistent/ckpt"], "not a checkpoint directory"),
        (["--arch", "LlamaForCausalLM", "--vllm-python", "/nonexistent/python"], "does not exist"),
    ],
)
def test_usage_and_load_errors_exit_2(args, message, capsys):
    assert main(["parity-report", *args, "-q"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_invariance_matrix_with_tp2(tmp_path):
    """TP2 (gloo, two spawned ranks) vs TP1, THD vs BSHD and batch 1 vs N, in one report
    (--invariance-tp alone asks for the whole matrix)."""
    code = main(["parity-report", "--arch", "Qwen2ForCausalLM", "--invariance-tp", "2",
                 "--out", str(tmp_path), "-q", "--format", "json,md"])  # fmt: skip
    assert code == 0
    report = _report(tmp_path, "Qwen2ForCausalLM")
    rows = {c["candidate"]: c for c in report["comparisons"] if c["role"] == "invariance"}
    assert set(rows) == {"mcore-portable-bshd", "mcore-portable-thd-b1", "mcore-portable-thd-tp2"}
    tp2 = rows["mcore-portable-thd-tp2"]
    assert tp2["criterion"] == "tolerance" and tp2["metrics"]["max_abs_dlogp"] < 1e-4
    assert report["runs"]["mcore-portable-thd-tp2"]["tp"] == 2
    assert rows["mcore-portable-thd-b1"]["metrics"]["bitwise_equal"]
    assert torch.tensor(tp2["metrics"]["top1_agreement"]) == 1.0


def test_bfloat16_bounds_relax_to_the_baseline_but_not_user_bounds(tmp_path):
    """Half precision: each default bound becomes max(floor, 2 x HF sdpa-vs-eager gap); a --tol bound stays."""
    args = ["parity-report", "--arch", "LlamaForCausalLM", "--dtype", "bfloat16", "-q", "--format", "json"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    report = _report(tmp_path / "a", "LlamaForCausalLM")
    base = next(c for c in report["comparisons"] if c["role"] == "baseline")["metrics"]
    tol, floor = report["tolerances"], report["tolerance_floor"]
    assert tol["mean_abs_dlogp"] == max(floor["mean_abs_dlogp"], 2 * base["mean_abs_dlogp"])
    assert tol["top1_min"] == min(floor["top1_min"], 1 - 2 * (1 - base["top1_agreement"]))
    assert not _parity(report)["metrics"]["bitwise_equal"]  # bf16 kernels differ: the check is not vacuous
    assert main(args + ["--out", str(tmp_path / "b"), "--tol", "mean_abs_dlogp=1e-9"]) == 1
    report = _report(tmp_path / "b", "LlamaForCausalLM")
    assert report["tolerances"]["mean_abs_dlogp"] == 1e-9
    assert _parity(report)["failures"][0].startswith("mean_abs_dlogp")


def test_unusable_tokenizer_falls_back_to_random_ids_with_a_note(tmp_path, reference_checkpoint):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_checkpoint("LlamaForCausalLM"), ckpt)
    (ckpt / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    out = tmp_path / "out"
    assert main(["parity-report", "--model", str(ckpt), "--out", str(out), "-q", "--format", "json"]) == 0
    report = _report(out, "LlamaForCausalLM")
    assert report["inputs"]["source"] == "random" and "not usable" in report["notes"][0]
    assert main(["parity-report", "--model", str(ckpt), "--tokens", "tokenizer", "-q"]) == 2


def test_ablation_flips_each_knob_alone_and_does_not_gate(tmp_path):
    """--ablation: one non-gating row per knob that can change this model; flipping the attention
    kernel of the local backend back to Megatron-Core's own (which folds the softmax scale into
    baddbmm; Qwen3's head_dim 24 can make that visible) shows up as a row with its own metrics and
    never fails the report. (Whether the folded scale rounds differently depends on the CPU's BLAS
    kernels: on some machines the row is bitwise, on others within 1e-6.)"""
    code = main(["parity-report", "--arch", "Qwen3ForCausalLM", "--backend", "local", "--bitwise", "--ablation",
                 "--out", str(tmp_path), "-q", "--format", "json,md"])  # fmt: skip
    report = _report(tmp_path, "Qwen3ForCausalLM")
    assert code == 0 and report["verdict"] == "pass"
    rows = {c["knob"]["name"]: c for c in report["comparisons"] if c["role"] == "ablation"}
    assert set(rows) == {"norm", "attention"}  # CPU: no fusions; no biases: linear_bias cannot matter
    assert not any(c["gating"] for c in rows.values())
    assert rows["attention"]["knob"] == {"name": "attention", "value": "backend", "from": "eager"}
    metrics = rows["attention"]["metrics"]
    assert metrics["bitwise_equal"] or 0 < metrics["max_abs_dlogp"] < 1e-5
    assert "## Ablation: each numerics knob flipped alone" in (tmp_path / "Qwen3ForCausalLM.md").read_text()
