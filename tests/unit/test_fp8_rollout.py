"""FP8 rollout from bf16 training (CPU): vLLM's block quantizer.

The quantizer is checked against a reference written here block by block in plain torch
(``vllm.utils.deep_gemm.per_block_cast_to_fp8`` of vLLM 0.26, read as a formula).
"""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.errors import ZooError
from mcore_zoo.weights.fp8 import dequantize_block
from mcore_zoo.weights.fp8_quantize import Fp8BlockScheme, quantize_fp8_blocks

E4M3 = torch.float8_e4m3fn


def reference_quantize(w: torch.Tensor, block: tuple[int, int], ue8m0: bool = False):
    """vLLM 0.26's ``per_block_cast_to_fp8``, one block at a time: amax (fp32, floor 1e-4),
    ``s = amax / 448``, ``q = e4m3(float32(w) * fl32(1 / s))``."""
    w2 = w.reshape(-1, *w.shape[-2:])
    rows, cols = w2.shape[-2:]
    rb, cb = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(w2.shape, dtype=E4M3)
    s = torch.empty((w2.shape[0], rb, cb), dtype=torch.float32)
    for m in range(w2.shape[0]):
        for i in range(rb):
            for j in range(cb):
                part = w2[m, i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
                amax = torch.tensor(max(part.abs().max().item(), 1e-4), dtype=torch.float32)
                scale = amax / torch.tensor(448.0)
                if ue8m0:
                    scale = torch.tensor(2.0 ** torch.ceil(torch.log2(scale)).item(), dtype=torch.float32)
                inv = torch.tensor(1.0, dtype=torch.float32) / scale
                s[m, i, j] = scale
                q[m, i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (part * inv).to(E4M3)
    return q.reshape(w.shape), s.reshape(*w.shape[:-2], rb, cb)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                                                                     b.view(torch.uint8) if b.dtype == E4M3 else b)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0-scales"])
@pytest.mark.parametrize(
    "shape,dtype,block",
    [((256, 384), torch.bfloat16, (128, 128)),  # whole blocks
     ((200, 130), torch.bfloat16, (128, 128)),  # ragged bottom and right edges
     ((2, 40, 52), torch.float32, (16, 16)),  # stacked experts, fp32, ragged
     ((24, 40), torch.float16, (8, 16))],
)  # fmt: skip
def test_quantizer_is_vllms_block_quantizer_bitwise(shape, dtype, block, ue8m0):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 3).to(dtype)
    w[..., : block[0], : block[1]] = 0  # an all-zero block: vLLM's floor 1e-4 / 448
    w[..., -1, -1] = -w.abs().max() * 2  # a block whose amax is negative
    q, s = quantize_fp8_blocks(w, block, "ue8m0" if ue8m0 else "float")
    q_ref, s_ref = reference_quantize(w, block, ue8m0)
    assert same_bits(q, q_ref) and same_bits(s, s_ref)
    assert s.reshape(-1)[0] == torch.tensor(1e-4, dtype=torch.float32) / 448 if not ue8m0 else True
    # the engine's dequantization stays within half an e4m3 step of every weight
    back = dequantize_block(q, s, torch.float32, block)
    w32 = w.float()
    step = torch.maximum(w32.abs() * 2.0**-3, s.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[
        ..., : shape[-2], : shape[-1]] * 2.0**-9)  # fmt: skip
    assert ((back - w32).abs() <= step / 2 * (1 + 1e-6)).all()
    if ue8m0:  # powers of two, and DeepGEMM's UE8M0 requantization keeps every value
        assert torch.equal(s, torch.pow(2.0, torch.log2(s).round()))
        q2, s2 = quantize_fp8_blocks(back, block, "ue8m0")
        assert torch.equal(dequantize_block(q2, s2, torch.float32, block), back)


def test_quantizer_refuses_what_it_cannot_quantize():
    with pytest.raises(ZooError, match="inf or NaN"):
        quantize_fp8_blocks(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ZooError, match="2-D"):
        quantize_fp8_blocks(torch.ones(8))
    with pytest.raises(ZooError, match="scale format"):
        Fp8BlockScheme(scale_fmt="e8m0")


def test_scheme_classifies_tensors_as_vllm_quantizes_them():
    scheme = Fp8BlockScheme()
    assert scheme.quantizes("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168))
    assert scheme.quantizes("model.layers.3.mlp.experts.7.down_proj.weight")
    assert not scheme.quantizes("model.layers.3.mlp.gate.weight", (256, 7168))  # router kept
    assert not scheme.quantizes("lm_head.weight", (1000, 64)) and not scheme.quantizes("model.norm.weight", (64,))
    assert not scheme.quantizes("model.layers.0.self_attn.o_proj.bias", (64,))
    with pytest.raises(ZooError, match="no rule for 'model.layers.0.linear_attn.conv1d.weight'"):
        scheme.quantizes("model.layers.0.linear_attn.conv1d.weight", (96, 1, 4))
    config = scheme.quantization_config(["lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"])
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate"]}  # fmt: skip
