"""FP8 block-quantized DeepSeek-V3 checkpoints: a tiny checkpoint quantized with the reference
quantizer (blocks of 16 x 16 so that the tiny tensors hold several, with partial edge blocks) loads
equal (bitwise) to the reference dequantization, and ``save_hf_checkpoint(fp8=True)`` writes the
same tensors back byte for byte (fp32 with fresh scales; bf16 with the source scales)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mcore_zoo
from mcore_zoo.weights.fp8 import dequantize_block, quantize_block

ARCH = "DeepseekV3ForCausalLM"
BLOCK = [16, 16]
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    # what DeepSeek-V3 quantizes: the linear layers (not embeddings, norms, router, lm_head)
    return tensor.dim() == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.weight"))


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory, zoo_reference_checkpoint):
    source = zoo_reference_checkpoint(ARCH)
    return write_fp8_checkpoints(source, tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("dequantized"))


def write_fp8_checkpoints(source, fp8_dir, deq_dir, quantized=_quantized):
    """``source`` quantized with the reference quantizer (``fp8_dir``; the tensors ``quantized(name,
    tensor)`` picks) and its reference dequantization (``deq_dir``); returns ``(fp8_dir, deq_dir,
    fp8 tensors)``."""
    state = load_file(str(source / "model.safetensors"))
    fp8, deq = {}, {}
    for name, tensor in state.items():
        if quantized(name, tensor):
            q, s = quantize_block(tensor.float(), BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_block(q, s, torch.float32, BLOCK)
        else:
            fp8[name] = deq[name] = tensor
    config = json.loads((source / "config.json").read_text())
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    (fp8_dir / "config.json").write_text(json.dumps(dict(config, quantization_config=QCONFIG)))
    (deq_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir, fp8


def _build(ckpt, dtype=torch.float32):
    return mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", load=ckpt, params_dtype=dtype).eval()


def test_fp8_load_equals_reference_dequantization(mpu, fp8_checkpoints, zoo_hf_reference):
    fp8_dir, deq_dir, _ = fp8_checkpoints
    model, reference = _build(fp8_dir), _build(deq_dir)
    params = dict(reference.state_dict())
    for name, value in model.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.equal(value, params[name]), name
    # and the whole model against transformers' model of the dequantized checkpoint
    hf = zoo_hf_reference(ARCH, deq_dir, "eager")
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, torch.arange(24).expand(2, -1), None)
        assert torch.equal(out, hf(ids).logits)


@pytest.mark.parametrize("dtype,scales", [(torch.float32, "fresh"), (torch.bfloat16, "source")])
def test_fp8_export_identical_bytes(mpu, fp8_checkpoints, tmp_path, dtype, scales):
    fp8_dir, _, source = fp8_checkpoints
    model = _build(fp8_dir, dtype)
    out = tmp_path / "export"
    mcore_zoo.save_hf_checkpoint(model, out, fp8=True, fp8_scales=scales)
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    quantized = {k for k in source if k.endswith("_scale_inv")}
    assert set(exported) == set(source)
    for name in quantized | {k[: -len("_scale_inv")] for k in quantized}:
        assert exported[name].dtype == source[name].dtype, name
        assert torch.equal(exported[name].view(torch.uint8), source[name].view(torch.uint8)), name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QCONFIG


def test_dequantized_export_drops_quantization_config(mpu, fp8_checkpoints, tmp_path):
    fp8_dir, deq_dir, _ = fp8_checkpoints
    out = tmp_path / "plain"
    mcore_zoo.save_hf_checkpoint(_build(fp8_dir), out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain, deq = load_file(str(next(out.glob("*.safetensors")))), load_file(str(deq_dir / "model.safetensors"))
    assert set(plain) == set(deq) and all(torch.equal(plain[k], deq[k]) for k in deq)


def test_other_quantization_refused_naming_it(mpu, fp8_checkpoints):
    from mcore_zoo.errors import UnsupportedConfigError
    from mcore_zoo.registry import get_registry

    arch = get_registry().get(ARCH)
    config = dict(arch.entry.example_config, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(UnsupportedConfigError, match="quant_method"):
        arch.config_from_hf(config)


def test_fp8_export_needs_an_fp8_source(mpu, fp8_checkpoints, tmp_path):
    from mcore_zoo.errors import ZooError

    _, deq_dir, _ = fp8_checkpoints
    with pytest.raises(ZooError, match="not loaded from an FP8"):
        mcore_zoo.save_hf_checkpoint(_build(deq_dir), tmp_path / "x", fp8=True)


def test_fp8_state_dict_loads(mpu, fp8_checkpoints):
    """An in-memory FP8 state dict (weights + scales) loads like the file."""
    fp8_dir, deq_dir, fp8 = fp8_checkpoints
    model = mcore_zoo.build_model(fp8_dir, backend="local", numerics="hf-exact", params_dtype=torch.float32)
    mcore_zoo.load_hf_state_dict(model, dict(fp8))
    reference = _build(deq_dir)
    params = dict(reference.state_dict())
    for name, value in model.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.equal(value, params[name]), name


def test_convert_hf_reads_fp8_checkpoints_as_load_does(mpu, fp8_checkpoints, tmp_path):
    """``convert --hf`` opens an FP8 block-quantized checkpoint as ``build_model(load=)`` does
    (dequantized as it is read): the distributed checkpoint, converted back to HF, holds the
    reference dequantization in the checkpoint's own unquantized dtype."""
    from mcore_zoo.cli import main

    fp8_dir, deq_dir, _ = fp8_checkpoints
    assert main(["convert", "--hf", str(fp8_dir), "--out", str(tmp_path / "mcore")]) == 0
    assert main(["convert", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    want = load_file(str(deq_dir / "model.safetensors"))
    assert set(back) == set(want)
    assert all(torch.equal(back[k], want[k].to(back[k].dtype)) for k in want)
    assert all(back[k].dtype == want[k].dtype for k in want if "embed_tokens" in k)
