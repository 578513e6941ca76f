"""gpt-oss: MXFP4 expert checkpoints (``*_blocks`` / ``*_scales`` in the published layout, built from
random FP4 codes and scales) load equal to transformers' own dequantization, bitwise; the model
then equals transformers' on the dequantized checkpoint; export gives transformers' state dict
(the stacked, dequantized experts) and the blocks re-quantize byte for byte."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mcore_zoo
from mcore_zoo.errors import ConfigError
from mcore_zoo.weights.mxfp4 import Mxfp4Checkpoint, dequantize_mxfp4, quantize_mxfp4

ARCH = "GptOssForCausalLM"
QCONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                      "lm_head"], "quant_method": "mxfp4"}  # fmt: skip
PROJECTIONS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of an ``[E, in, out]`` projection in the published layout: ``[E, out, in/32, 16]``
    random FP4 code pairs, ``[E, out, in/32]`` exponents around 2 ** -6."""
    experts, width, out = shape
    blocks = torch.randint(0, 256, (experts, out, width // 32, 16), generator=generator).to(torch.uint8)
    scales = torch.randint(127 - 9, 127 - 4, (experts, out, width // 32), generator=generator).to(torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_checkpoints(tmp_path_factory, zoo_reference_checkpoint):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = zoo_reference_checkpoint(ARCH)
    state = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    packed, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(PROJECTIONS):
            blocks, scales = _random_mxfp4(tuple(tensor.shape), generator)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = dequantized[name] = tensor
    config = json.loads((source / "config.json").read_text())
    mxfp4_dir, deq_dir = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("dequantized")
    save_file(packed, str(mxfp4_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    (mxfp4_dir / "config.json").write_text(json.dumps(dict(config, quantization_config=QCONFIG)))
    (deq_dir / "config.json").write_text(json.dumps(config))
    return mxfp4_dir, deq_dir, packed, dequantized


def _build(ckpt, dtype=torch.float32):
    return mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", load=ckpt, params_dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_is_transformers(mxfp4_checkpoints, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, _, packed, _ = mxfp4_checkpoints
    for name in (n[: -len("_blocks")] for n in packed if n.endswith("_blocks")):
        blocks, scales = packed[name + "_blocks"], packed[name + "_scales"]
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales).to(dtype), want), name
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), want), name


def test_mxfp4_load_equals_transformers_dequantization(mpu, mxfp4_checkpoints, zoo_hf_reference):
    mxfp4_dir, deq_dir, _, _ = mxfp4_checkpoints
    model, reference = _build(mxfp4_dir), _build(deq_dir)
    params = dict(reference.state_dict())
    for name, value in model.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.equal(value, params[name]), name
    hf = zoo_hf_reference(ARCH, deq_dir, "eager")
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids, torch.arange(24).expand(2, -1), None), hf(ids).logits)


def test_export_is_the_dequantized_state_dict_and_requantizes_byte_for_byte(mpu, mxfp4_checkpoints):
    mxfp4_dir, _, packed, dequantized = mxfp4_checkpoints
    exported = dict(mcore_zoo.iter_hf_weights(_build(mxfp4_dir)))
    assert set(exported) == set(dequantized)
    for name, tensor in dequantized.items():
        assert torch.equal(exported[name], tensor), name
        if name.endswith(PROJECTIONS):
            blocks, scales = quantize_mxfp4(exported[name])
            assert torch.equal(blocks, packed[name + "_blocks"]) and torch.equal(scales, packed[name + "_scales"]), name


def test_an_expert_slice_reads_only_that_expert(mxfp4_checkpoints):
    from mcore_zoo.weights.io import HFCheckpoint

    mxfp4_dir, _, packed, dequantized = mxfp4_checkpoints
    name = next(n for n in dequantized if n.endswith(".mlp.experts.gate_up_proj"))
    ckpt = Mxfp4Checkpoint(HFCheckpoint(mxfp4_dir))
    try:
        assert ckpt.shape(name) == tuple(dequantized[name].shape)
        out = torch.empty(dequantized[name][3].shape[0], dequantized[name].shape[2] // 2)
        nbytes = ckpt.read_into(name, out, axis=2, rank=1, size=2, select=(0, 3, 4))
        assert torch.equal(out, dequantized[name][3:4, :, out.shape[1]:].reshape(out.shape))
        per_expert = (packed[name + "_blocks"][0].numel() + packed[name + "_scales"][0].numel())
        assert nbytes <= per_expert  # one expert's blocks and scales, not the layer's
    finally:
        ckpt.close()


def test_other_quantization_refused_naming_it():
    from mcore_zoo.plugins.gpt_oss import EXAMPLE_CONFIG

    config = dict(EXAMPLE_CONFIG, quantization_config={"quant_method": "gptq"})
    with pytest.raises(ConfigError, match="quantization_config"):
        mcore_zoo.lookup(config).config_from_hf(config)


def test_example_config_exercises_every_gpt_oss_feature(zoo_reference_checkpoint, zoo_hf_reference):
    """The parity contracts pass on the example config; this shows they would catch a dropped
    feature: each one changes transformers' logits on a sequence five windows long."""
    hf = zoo_hf_reference(ARCH, zoo_reference_checkpoint(ARCH), "eager")
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return hf(ids).logits

    base = logits()
    layers = hf.model.layers
    mutations = {
        "attention sinks": [(layer.self_attn.sinks, 0.0) for layer in layers],
        "router bias": [(layer.mlp.router.bias, 0.0) for layer in layers],
        "expert biases": [(layer.mlp.experts.gate_up_proj_bias, 0.0) for layer in layers],
    }
    for feature, params in mutations.items():
        saved = [p.detach().clone() for p, _ in params]
        with torch.no_grad():
            for p, value in params:
                p.fill_(value)
        moved = (logits() - base).abs().max().item()
        with torch.no_grad():
            for (p, _), old in zip(params, saved):
                p.copy_(old)
        assert moved > 1e-3, f"{feature}: logits moved by {moved:.2e} only"
    for layer in layers:
        layer.mlp.experts.limit = float("inf")
    moved = (logits() - base).abs().max().item()
    for layer in layers:
        layer.mlp.experts.limit = hf.config.swiglu_limit
    assert moved > 1e-3, f"swiglu clamp: logits moved by {moved:.2e} only"
    window, per_layer = hf.config.sliding_window, [layer.self_attn.sliding_window for layer in layers]
    hf.config.sliding_window = 10_000
    for layer in layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 10_000
    moved = (logits() - base).abs().max().item()
    hf.config.sliding_window = window
    for layer, own in zip(layers, per_layer):
        layer.self_attn.sliding_window = own
    assert moved > 1e-3, f"sliding window: logits moved by {moved:.2e} only"
    assert torch.equal(logits(), base)


@pytest.mark.parametrize("published", ["gpt-oss-20b.json", "gpt-oss-120b.json"])
def test_parity_report_on_published_config(tmp_path, published):
    """``mcore-zoo parity-report --config <published> --random-weights --scale tiny`` passes (the
    published MXFP4 ``quantization_config`` included: random weights are written unquantized)."""
    from pathlib import Path

    from mcore_zoo.cli import main

    config = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / published
    code = main(["parity-report", "--config", str(config), "--random-weights", "--scale", "tiny", "--out", str(tmp_path),
                 "-q", "--format", "json"])  # fmt: skip
    report = json.loads((tmp_path / f"{ARCH}.json").read_text())
    assert code == 0, report["verdict"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_export_writes_the_loaded_bytes(mpu, mxfp4_checkpoints, tmp_path, dtype):
    mxfp4_dir, _, packed, _ = mxfp4_checkpoints
    out = tmp_path / "out"
    mcore_zoo.save_hf_checkpoint(_build(mxfp4_dir, dtype), out, mxfp4=True)
    written = load_file(str(out / "model.safetensors"))
    for name in (n for n in packed if n.endswith(("_blocks", "_scales"))):
        assert torch.equal(written[name], packed[name]), name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QCONFIG


def test_mxfp4_export_needs_an_mxfp4_source(mpu, mxfp4_checkpoints, tmp_path):
    _, deq_dir, _, _ = mxfp4_checkpoints
    with pytest.raises(mcore_zoo.ZooError, match="mxfp4=True"):
        mcore_zoo.save_hf_checkpoint(_build(deq_dir), tmp_path / "out", mxfp4=True)
