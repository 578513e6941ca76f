"""FP8 block-quantized DeepSeek-V3.2 / GLM-5 checkpoints, as for DeepSeek-V3 (``test_mla_fp8.py``):
a tiny checkpoint quantized with the reference quantizer (blocks of 16 x 16) loads equal (bitwise)
to the reference dequantization, and ``save_hf_checkpoint(fp8=True)`` writes it back byte for byte.

The lightning indexer's weights are quantized as the published checkpoints and transformers have
them: ``indexer.wq_b`` and ``indexer.wk`` are FP8 linears with their ``weight_scale_inv``;
``indexer.weights_proj`` stays unquantized (transformers keeps it out of the FP8 conversion through
``_keep_in_fp32_modules``; DeepSeek-V3.2-Exp's own model builds it in the default dtype), and
``indexer.k_norm`` is a LayerNorm. The sequences are longer than the example's ``index_topk`` (8), so
the indexer selects: its scores run on the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo

from .test_mla_fp8 import QCONFIG, _quantized, write_fp8_checkpoints

ARCHS = ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"]
INDEXER_QUANTIZED = ("indexer.wq_b.weight", "indexer.wk.weight")
INDEXER_PLAIN = ("indexer.weights_proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")


def _dsa_quantized(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3's quantized linears, the indexer's ``wq_b`` / ``wk`` among them, without the
    indexer's ``weights_proj``."""
    return _quantized(name, tensor) and not name.endswith("indexer.weights_proj.weight")


@pytest.fixture(scope="module", params=ARCHS)
def fp8_checkpoints(request, tmp_path_factory, zoo_reference_checkpoint):
    source = zoo_reference_checkpoint(request.param)
    written = write_fp8_checkpoints(source, tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("dequantized"),
                                    quantized=_dsa_quantized)  # fmt: skip
    return (request.param, *written)


def _build(ckpt, dtype=torch.float32):
    return mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", load=ckpt, params_dtype=dtype).eval()


def test_indexer_tensors_quantized_as_published(fp8_checkpoints):
    _, _, _, fp8 = fp8_checkpoints
    for suffix in INDEXER_QUANTIZED:
        names = [k for k in fp8 if k.endswith(suffix)]
        assert names and all(fp8[k].dtype == torch.float8_e4m3fn and k + "_scale_inv" in fp8 for k in names), suffix
    for suffix in INDEXER_PLAIN:
        names = [k for k in fp8 if k.endswith(suffix)]
        assert names and all(fp8[k].dtype != torch.float8_e4m3fn and k + "_scale_inv" not in fp8 for k in names)


def test_fp8_load_equals_reference_dequantization(mpu, fp8_checkpoints, zoo_hf_reference):
    arch, fp8_dir, deq_dir, _ = fp8_checkpoints
    model, reference = _build(fp8_dir), _build(deq_dir)
    params = dict(reference.state_dict())
    for name, value in model.state_dict().items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.equal(value, params[name]), name
    # the whole model against transformers' model of the dequantized checkpoint, with selection
    hf = zoo_hf_reference(arch, deq_dir, "eager")
    assert hf.config.index_topk < 24
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, torch.arange(24).expand(2, -1), None)
        assert torch.equal(out, hf(ids).logits)


@pytest.mark.parametrize("dtype,scales", [(torch.float32, "fresh"), (torch.bfloat16, "source")])
def test_fp8_export_identical_bytes(mpu, fp8_checkpoints, tmp_path, dtype, scales):
    _, fp8_dir, _, source = fp8_checkpoints
    model = _build(fp8_dir, dtype)
    out = tmp_path / "export"
    mcore_zoo.save_hf_checkpoint(model, out, fp8=True, fp8_scales=scales)
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    quantized = {k for k in source if k.endswith("_scale_inv")}
    assert set(exported) == set(source)
    assert any("indexer.wq_b" in k for k in quantized) and any("indexer.wk" in k for k in quantized)
    for name in quantized | {k[: -len("_scale_inv")] for k in quantized}:
        assert exported[name].dtype == source[name].dtype, name
        assert torch.equal(exported[name].view(torch.uint8), source[name].view(torch.uint8)), name
    for name in (k for k in source if k.endswith("indexer.weights_proj.weight")):
        assert exported[name].dtype != torch.float8_e4m3fn, name
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QCONFIG
