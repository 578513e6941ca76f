"""FP8 block-quantized checkpoints: safetensors dtypes, dequantization and quantization against
transformers' own FP8 code (``transformers/integrations/finegrained_fp8.py``), the byte-exact
round trip through a real safetensors file, the config parser's refusals, and mutations."""

from __future__ import annotations

import json
import struct
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_zoo.errors import (
    CheckpointFormatError,
    ShapeMismatchError,
    UnclassifiedConfigFieldsError,
    UnsupportedConfigError,
    ZooError,
)
from mcore_zoo.weights.fp8 import (
    Fp8BlockFormat,
    dequantize_block,
    plan_fp8_tensors,
    quantize_block,
    requantize_block,
    scale_grid,
)
from mcore_zoo.weights.io import HFCheckpoint, write_safetensors

fp8_tf = pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers.utils.quantization_config import FineGrainedFP8Config

E4M3 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparisons: -0.0 != 0.0, NaN payloads count)."""
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def hf_ops(block=(128, 128)):
    quantizer = types.SimpleNamespace(
        quantization_config=FineGrainedFP8Config(weight_block_size=tuple(block))
    )
    return fp8_tf.Fp8Quantize(quantizer), fp8_tf.Fp8Dequantize(quantizer)


def random_fp8(shape, gen) -> torch.Tensor:
    """Random finite e4m3 codes (every code but the two NaNs)."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x7E
    return raw.view(E4M3)


def random_scales(shape, gen) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 2.0 ** torch.randint(-14, -4, shape, generator=gen)).to(
        torch.float32
    ) + 1e-6


def deepseek_weight_dequant(
    x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, block=(128, 128)
) -> torch.Tensor:
    """DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``, one program per block: the block's
    elements widened to fp32, times the block's scale, stored into ``dtype`` (edge blocks masked)."""
    rows, cols = x.shape
    y = torch.empty(rows, cols, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            y[blk] = (x[blk].to(torch.float32) * s[i, j]).to(dtype)
    return y


# ---------------------------------------------------------------------------- safetensors dtypes


def test_reader_new_dtypes_bitwise(tmp_path):
    gen = torch.Generator().manual_seed(0)
    raw = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    tensors = {
        "e4m3": raw(6, 10).view(torch.float8_e4m3fn),  # all byte patterns, NaNs included
        "e5m2": raw(6, 10).view(torch.float8_e5m2),
        "u16": raw(4, 8).view(torch.uint16),
        "u32": raw(4, 16).view(torch.uint32),
        "u64": raw(4, 32).view(torch.uint64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    header_dtypes = {
        k: v["dtype"] for k, v in _header(tmp_path / "model.safetensors").items() if k != "__metadata__"
    }
    assert header_dtypes == {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "u16": "U16", "u32": "U32", "u64": "U64"}
    with HFCheckpoint(tmp_path, allow_fp8=True) as ckpt:
        for name, tensor in tensors.items():
            assert ckpt.dtype(name) == tensor.dtype
            assert same_bits(ckpt.read(name), tensor), name
            assert same_bits(ckpt.read(name, axis=0, rank=1, size=2), tensor.chunk(2, 0)[1]), name
            out = torch.empty(tensor.shape, dtype=tensor.dtype)
            ckpt.read_into(name, out)
            assert same_bits(out, tensor), name
    # and the writer: safetensors reads back what write_safetensors wrote
    write_safetensors(tmp_path / "again.safetensors", tensors)
    back = load_file(str(tmp_path / "again.safetensors"))
    assert all(same_bits(back[k], v) for k, v in tensors.items())


def test_reader_refuses_other_quantized_dtypes(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2, dtype=torch.uint8)}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["w"]["dtype"] = "F8_E8M0"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])
    with pytest.raises(CheckpointFormatError, match="F8_E8M0"):
        HFCheckpoint(tmp_path, allow_fp8=True)


def test_reader_reads_fp8_only_when_asked(tmp_path):
    save_file({"w": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"not supported \(F8_E4M3\)"):
        HFCheckpoint(tmp_path)
    with HFCheckpoint(tmp_path, allow_fp8=True) as ckpt:
        assert ckpt.dtype("w") == torch.float8_e4m3fn


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


# ---------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)])
def test_dequantize_equals_transformers(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    q = random_fp8(shape, gen)
    s = random_scales(scale_grid(shape, (128, 128)), gen)
    _, hf_dequant = hf_ops()
    expected = hf_dequant._dequantize_one(q, s, output_dtype=dtype)
    assert same_bits(dequantize_block(q, s, dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block",
    [((300, 200), (128, 128)), ((129, 1), (128, 128)), ((1, 129), (128, 128)), ((13, 22), (4, 8))],
)
def test_dequantize_partial_edge_blocks(dtype, shape, block):
    gen = torch.Generator().manual_seed(2)
    q = random_fp8(shape, gen)
    s = random_scales(scale_grid(shape, block), gen)
    ours = dequantize_block(q, s, dtype, block=block)
    assert same_bits(ours, deepseek_weight_dequant(q, s, dtype, block))
    # transformers' own edge-block handling (its backward helper, from transformers 5.2x on)
    # computes in the target dtype; in fp32 that is the same single rounding: bit for bit
    if hasattr(fp8_tf, "_dequantize_fp8_weight"):
        hf_fp32 = fp8_tf._dequantize_fp8_weight(q, s, list(block), torch.float32)
        assert same_bits(ours, hf_fp32.to(dtype))


def test_dequantize_op_order_matters_in_bf16():
    """Mutation: multiplying in bf16 (``bf16(q) * bf16(s)``, transformers' backward helper) is not
    the reference dequantization - the test above could tell them apart."""
    gen = torch.Generator().manual_seed(3)
    q = random_fp8((256, 256), gen)
    s = random_scales((2, 2), gen)
    expanded = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bf16_mul = q.to(torch.bfloat16) * expanded.to(torch.bfloat16)
    assert not same_bits(bf16_mul, dequantize_block(q, s, torch.bfloat16))
    assert same_bits((q.to(torch.float32) * expanded).to(torch.bfloat16), dequantize_block(q, s, torch.bfloat16))


def test_dequantize_refuses_wrong_grids():
    gen = torch.Generator().manual_seed(4)
    q = random_fp8((256, 384), gen)
    s = random_scales((2, 3), gen)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 3\)"):
        dequantize_block(q, s.t().contiguous())  # transposed grid
    with pytest.raises(ShapeMismatchError):
        dequantize_block(q, s[:, :2].contiguous())
    with pytest.raises(ZooError, match="float32"):
        dequantize_block(q, s.to(torch.bfloat16))
    with pytest.raises(ZooError, match="float8"):
        dequantize_block(q.to(torch.float32), s)
    # a square grid passes the shape check, so a transposed one must change the values
    q2, s2 = random_fp8((256, 256), gen), random_scales((2, 2), gen)
    assert not same_bits(dequantize_block(q2, s2.t().contiguous()), dequantize_block(q2, s2))


# ---------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256)])
def test_quantize_equals_transformers(dtype, shape):
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    w[..., :128, :128] = 0  # a zero block: scale_inv 1
    w[..., 128:, 128:256] *= 1e-30  # tiny values
    w[..., 0, 200] = -w[..., 0, 200].abs() * 1e-9  # underflows to -0 in fp8
    hf_quant, _ = hf_ops()
    expected = hf_quant._quantize_one("x.weight", w)
    q, s = quantize_block(w)
    assert same_bits(q, expected["x.weight"])
    assert same_bits(s, expected["x.weight_scale_inv"])
    assert float(s.reshape(-1, *s.shape[-2:])[0, 0, 0]) == 1.0


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((13, 22), (4, 8))])
def test_quantize_partial_edge_blocks(shape, block):
    """transformers leaves a tensor the block does not divide unquantized; an edge block here is
    quantized as transformers quantizes a tensor of exactly that block's shape."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(shape, generator=gen)
    q, s = quantize_block(w, block=block)
    assert s.shape == scale_grid(shape, block)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            piece = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            hf_quant, _ = hf_ops(piece.shape)
            expected = hf_quant._quantize_one("x.weight", piece.contiguous())
            assert same_bits(
                q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].contiguous(),
                expected["x.weight"],
            )
            assert same_bits(s[i, j].reshape(1, 1), expected["x.weight_scale_inv"])


def test_quantize_refuses_non_finite_and_other_formats():
    w = torch.ones(128, 128)
    w[3, 4] = float("nan")
    with pytest.raises(ZooError, match="inf or NaN"):
        quantize_block(w)
    with pytest.raises(ZooError, match="e5m2"):
        quantize_block(torch.ones(128, 128), fmt="e5m2")


# ---------------------------------------------------------------------------- round trip


def all_codes() -> torch.Tensor:
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)
    return q[~q.float().isnan()]  # the 254 finite values


def test_plain_requantization_moves_scales():
    """Why the export needs :func:`requantize_block`: the reference quantizer re-applied to a
    reference block's fp32 dequantization changes some scales by an ulp or two (11.8% of the
    scales of all 2^23 amax values of a binade: bench/fp8_roundtrip.py)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4096, 64, generator=gen)
    q, s = quantize_block(w, block=(1, 64))
    loaded = dequantize_block(q, s, torch.float32, block=(1, 64))
    q2, s2 = quantize_block(loaded, block=(1, 64))
    assert same_bits(q2, q)  # the fp8 values survive ...
    changed = float((s2.view(torch.int32) != s.view(torch.int32)).float().mean())
    assert 0.08 < changed < 0.20  # ... the scales do not
    q3, s3 = requantize_block(loaded, block=(1, 64))
    assert same_bits(q3, q) and same_bits(s3, s)


def test_requantize_every_code_sampled_scales():
    """A block holding every finite e4m3 value, for random fp32 scales of many binades (the bench
    covers all 2^23 scales of a binade): bytes and scale come back exactly."""
    gen = torch.Generator().manual_seed(8)
    bits32 = torch.randint(0x3F800000, 0x40000000, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    shifts = 2.0 ** torch.randint(-116, 118, (4096,), generator=gen).to(torch.float64)
    s = (bits32.view(torch.float32).double() * shifts).to(torch.float32)[:, None]
    codes = all_codes()
    q = codes.expand(s.shape[0], codes.numel()).contiguous()
    block = (1, codes.numel())
    w = dequantize_block(q, s, torch.float32, block=block)
    q2, s2 = requantize_block(w, block=block)
    assert same_bits(q2, q)
    assert same_bits(s2, s)


def test_requantize_448_only_blocks_keep_values():
    """Worst case: a block of +-448 and zeros carries only fl(448 * s), which several scales share.
    Bytes may then differ, but the export always dequantizes to exactly what was loaded."""
    gen = torch.Generator().manual_seed(9)
    s = (torch.rand(8192, 1, generator=gen) + 1.0) * 2.0**-9
    q = torch.tensor([448.0, -448.0, 0.0]).to(E4M3).expand(s.shape[0], 3).contiguous()
    w = dequantize_block(q, s, torch.float32, block=(1, 3))
    q2, s2 = requantize_block(w, block=(1, 3))
    assert same_bits(q2, q)
    assert same_bits(dequantize_block(q2, s2, torch.float32, block=(1, 3)), w)
    assert float((s2 == s).float().mean()) > 0.85


def test_requantize_bf16():
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(512, 256, generator=gen) * 0.02
    q, s = quantize_block(w)
    loaded = dequantize_block(q, s, torch.bfloat16)
    q2, s2 = requantize_block(loaded)
    assert same_bits(q2, q)  # the fp8 bytes survive bf16
    assert not same_bits(s2, s)  # the scales cannot (a bf16 block fits thousands of fp32 scales)
    assert same_bits(dequantize_block(q2, s2, torch.bfloat16), loaded)  # a second load is the same
    plain = quantize_block(loaded)  # mutation: the reference scale alone moves some bf16 values
    assert not same_bits(dequantize_block(*plain, torch.bfloat16), loaded)
    q3, s3 = requantize_block(loaded, scale_inv=s)  # with the checkpoint's own scales: exact
    assert same_bits(q3, q) and same_bits(s3, s)


def test_requantize_fresh_weights_is_the_reference():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(300, 260, generator=gen) * 0.02
    for dtype in (torch.float32, torch.bfloat16):
        qa, sa = quantize_block(w.to(dtype))
        qb, sb = requantize_block(w.to(dtype))
        assert same_bits(qa, qb) and same_bits(sa, sb)


def _tiny_fp8_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], Fp8BlockFormat]:
    fmt = Fp8BlockFormat.from_hf(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head"]}
    )  # fmt: skip
    gen = torch.Generator().manual_seed(12)
    source = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 384, generator=gen) * 0.02,
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": torch.randn(200, 384, generator=gen) * 0.05,
        "model.layers.0.mlp.experts.0.down_proj.weight": torch.randn(384, 130, generator=gen),
    }
    source["model.layers.0.mlp.experts.0.down_proj.weight"][:128, :128] = 0
    tensors: dict[str, torch.Tensor] = {}
    for name, w in source.items():
        q, s = quantize_block(w, fmt.block, fmt.fmt)
        tensors[name] = q
        tensors[name + "_scale_inv"] = s
    tensors["model.layers.0.input_layernorm.weight"] = torch.randn(384, generator=gen).to(torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(64, 384, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors, fmt


def test_checkpoint_round_trip_identical_bytes(tmp_path):
    src = tmp_path / "src" / "model.safetensors"
    src.parent.mkdir()
    tensors, fmt = _tiny_fp8_checkpoint(src)
    _, hf_dequant = hf_ops()
    with HFCheckpoint(src.parent, allow_fp8=True) as ckpt:
        plan = plan_fp8_tensors({k: (ckpt.dtype(k), ckpt.shape(k)) for k in ckpt.keys()}, fmt)
        assert set(plan.quantized) == {
            k for k in tensors if k.endswith(".weight") and tensors[k].dtype == E4M3
        }
        assert plan.not_converted == ["lm_head.weight"]
        assert plan.plain == ["model.layers.0.input_layernorm.weight"]
        for dtype in (torch.float32, torch.bfloat16):
            exported: dict[str, torch.Tensor] = {}
            for name in sorted(ckpt.keys()):
                if name in plan.quantized:
                    loaded = dequantize_block(
                        ckpt.read(name), ckpt.read(plan.quantized[name]), dtype, fmt.block
                    )
                    reference = deepseek_weight_dequant(
                        ckpt.read(name), ckpt.read(plan.quantized[name]), dtype, fmt.block
                    )
                    assert same_bits(loaded, reference), name
                    if ckpt.shape(name)[0] % 128 == 0 and ckpt.shape(name)[1] % 128 == 0:
                        hf = hf_dequant._dequantize_one(
                            ckpt.read(name), ckpt.read(plan.quantized[name]), output_dtype=dtype
                        )
                        assert same_bits(loaded, hf), name
                    if dtype == torch.float32:
                        q, s = requantize_block(loaded, fmt.block, fmt.fmt)
                    else:  # bf16 keeps the fp8 bytes but not the scales: export with the source's scales
                        q, s = requantize_block(
                            loaded, fmt.block, fmt.fmt, scale_inv=ckpt.read(plan.quantized[name])
                        )
                    exported[name], exported[plan.quantized[name]] = q, s
                elif name not in plan.quantized.values():
                    exported[name] = ckpt.read(name)
            out = tmp_path / f"out-{str(dtype)[6:]}.safetensors"
            save_file({k: exported[k] for k in tensors}, str(out), metadata={"format": "pt"})
            assert out.read_bytes() == src.read_bytes(), dtype


# ---------------------------------------------------------------------------- tensor plan


def test_plan_fails_closed():
    fmt = Fp8BlockFormat(modules_to_not_convert=("lm_head", "model.layers.0.mlp.gate"))
    ok = {"a.weight": (E4M3, (256, 130)), "a.weight_scale_inv": (torch.float32, (2, 2))}
    assert plan_fp8_tensors(ok, fmt).quantized == {"a.weight": "a.weight_scale_inv"}
    with pytest.raises(CheckpointFormatError, match="'a.weight_scale_inv' is missing"):
        plan_fp8_tensors({"a.weight": (E4M3, (256, 130))}, fmt)
    with pytest.raises(CheckpointFormatError, match="'b.weight_scale_inv'"):
        plan_fp8_tensors(
            {**ok, "b.weight_scale_inv": (torch.float32, (1, 1)), "b.weight": (torch.bfloat16, (4, 4))}, fmt
        )
    with pytest.raises(ShapeMismatchError, match="a.weight_scale_inv"):
        plan_fp8_tensors({**ok, "a.weight_scale_inv": (torch.float32, (2, 1))}, fmt)
    with pytest.raises(CheckpointFormatError, match="expected float32"):
        plan_fp8_tensors({**ok, "a.weight_scale_inv": (torch.bfloat16, (2, 2))}, fmt)
    with pytest.raises(CheckpointFormatError, match="modules_to_not_convert"):
        plan_fp8_tensors(
            {"lm_head.weight": (E4M3, (128, 128)), "lm_head.weight_scale_inv": (torch.float32, (1, 1))}, fmt
        )
    with pytest.raises(CheckpointFormatError, match="e4m3"):
        plan_fp8_tensors(
            {"a.weight": (torch.float8_e5m2, (128, 128)), "a.weight_scale_inv": (torch.float32, (1, 1))}, fmt
        )
    skipped = plan_fp8_tensors({"model.layers.0.mlp.gate.weight": (torch.bfloat16, (8, 16)),
                                "model.layers.0.mlp.gate_proj.weight": (torch.bfloat16, (8, 16))}, fmt)  # fmt: skip
    assert skipped.not_converted == [
        "model.layers.0.mlp.gate.weight"
    ]  # module boundary: gate_proj is not gate


# ---------------------------------------------------------------------------- config


DEEPSEEK_V3 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def test_config_accepts_published_forms():
    assert Fp8BlockFormat.from_hf(DEEPSEEK_V3) == Fp8BlockFormat()
    qwen = {**DEEPSEEK_V3, "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    assert Fp8BlockFormat.from_hf(qwen).modules_to_not_convert == ("lm_head", "model.embed_tokens")
    minimax = {"quant_method": "fp8", "weight_block_size": [64, 32], "ignored_layers": ["gate"]}
    assert Fp8BlockFormat.from_hf(minimax) == Fp8BlockFormat(block=(64, 32), modules_to_not_convert=("gate",))
    # transformers' own serialisation of its config object
    assert Fp8BlockFormat.from_hf(
        FineGrainedFP8Config(modules_to_not_convert=["lm_head"])
    ).modules_to_not_convert == ("lm_head",)


@pytest.mark.parametrize(
    "change,key",
    [
        ({"quant_method": "gptq"}, "quant_method"),
        ({"quant_method": "compressed-tensors"}, "quant_method"),
        ({"fmt": "e5m2"}, "fmt"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [128, 0]}, "weight_block_size"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt"),
        ({"expert_dtype": "fp4"}, "expert_dtype"),
        ({"modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({"modules_to_not_convert": ["a"], "ignored_layers": ["b"]}, "ignored_layers"),
    ],
)
def test_config_refusals_name_the_key(change, key):
    with pytest.raises(UnsupportedConfigError, match=rf"quantization_config\.{key}") as info:
        Fp8BlockFormat.from_hf({**DEEPSEEK_V3, **change}, architecture="DeepseekV3ForCausalLM")
    assert info.value.field == f"quantization_config.{key}"
    assert "DeepseekV3ForCausalLM" in str(info.value)


def test_config_refuses_missing_block_and_unknown_keys():
    config = dict(DEEPSEEK_V3)
    del config["weight_block_size"]
    with pytest.raises(UnsupportedConfigError, match="weight_block_size"):
        Fp8BlockFormat.from_hf(config)
    with pytest.raises(UnclassifiedConfigFieldsError, match="quantization_config.kv_cache_scheme"):
        Fp8BlockFormat.from_hf({**DEEPSEEK_V3, "kv_cache_scheme": {"num_bits": 8}})
    with pytest.raises(UnsupportedConfigError, match="quant_method"):
        Fp8BlockFormat.from_hf({"weight_block_size": [128, 128]})
