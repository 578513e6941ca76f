"""FP8 rollout from bf16 training (CPU): vLLM's block quantizer, the FP8 block export, and the
refit into an engine serving FP8 weights.

The quantizer is checked against a reference written here block by block in plain torch
(``vllm.utils.deep_gemm.per_block_cast_to_fp8`` of vLLM 0.26, read as a formula). The refit is
checked against a stand-in engine loaded from the saved FP8 checkpoint with vLLM's loaders written
out as data (``test_refit.vllm_engine_tensors``: fp8 weights fused and split as bf16 ones; scales
expanded to one value per element, fused and split the same way, then read back one per block).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.errors import LayoutError, ZooError
from mcore_zoo.rollout import HF_NAMES, DictAdapter
from mcore_zoo.rollout.fp8 import Fp8BlockAdapter, fp8_refit_plan
from mcore_zoo.rollout.refit import get_plan
from mcore_zoo.rollout.vllm_fp8 import VLLMFp8Adapter, ZooFp8WorkerExtension
from mcore_zoo.weights.fp8 import dequantize_block
from mcore_zoo.weights.fp8_quantize import Fp8BlockScheme, quantize_fp8_blocks

from .test_refit import FakeLLM, FakeWorker, assert_same, vllm_engine_tensors

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


# ---------------------------------------------------------------------------- export and refit

SMALL = Fp8BlockScheme(block=(8, 8))  # every quantized dimension of the example configs splits on 8 at TP2
FAMILIES = [("llama", "LlamaForCausalLM"), ("qwen3-moe", "Qwen3MoeForCausalLM"), ("deepseek-v3", "DeepseekV3ForCausalLM")]


def _bf16_model(reference_checkpoint, arch):
    ckpt = reference_checkpoint(arch, {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, params_dtype=torch.bfloat16)
    return ckpt, model


def _engine_from_checkpoint(path, scheme: Fp8BlockScheme, tp: int) -> list[dict[str, torch.Tensor]]:
    """A stand-in FP8 engine loaded from a saved checkpoint: vLLM's loaders (as data) applied to
    the fp8 weights, to the other tensors, and to the scales expanded per element."""
    config = json.loads((path / "config.json").read_text())
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    scales = {n[: -len("_scale_inv")]: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    fp8 = {n: t for n, t in tensors.items() if n in scales}
    rest = {n: t for n, t in tensors.items() if n not in scales and not n.endswith("_scale_inv")}
    bm, bn = scheme.block
    expanded = {n: s.repeat_interleave(bm, -2).repeat_interleave(bn, -1)[: fp8[n].shape[0], : fp8[n].shape[1]]
                for n, s in scales.items()}  # fmt: skip
    engines = vllm_engine_tensors(fp8, config, tp)
    for engine, rest_part, scale_part in zip(engines, vllm_engine_tensors(rest, config, tp),
                                             vllm_engine_tensors(expanded, config, tp)):  # fmt: skip
        engine.update(rest_part)
        engine.update({n + "_scale_inv": s[..., ::bm, ::bn].contiguous() for n, s in scale_part.items()})
    return engines


@pytest.mark.parametrize("case,arch", FAMILIES, ids=[c for c, _ in FAMILIES])
def test_block_export_and_refit_equal_the_reference_quantizer_and_a_fresh_load(mpu, reference_checkpoint, tmp_path,
                                                                                 case, arch):  # fmt: skip
    _, model = _bf16_model(reference_checkpoint, arch)
    exported = dict(mcore_zoo.iter_hf_weights(model))
    out = tmp_path / "fp8"
    mcore_zoo.save_hf_checkpoint(model, out, fp8=SMALL)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [8, 8]
    saved = {}
    for f in out.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    quantized = [n for n in exported if SMALL.quantizes(n)]
    assert quantized and set(saved) == set(exported) | {n + "_scale_inv" for n in quantized}
    for name, w in exported.items():
        if name in quantized:  # the reference quantizer's bytes, scales fp32 per block
            q_ref, s_ref = reference_quantize(w, SMALL.block)
            assert same_bits(saved[name], q_ref) and same_bits(saved[name + "_scale_inv"], s_ref), name
        else:
            assert same_bits(saved[name], w), name
    kept = config["quantization_config"]["modules_to_not_convert"]
    assert "lm_head" in kept and all(not n.endswith(("mlp.gate.weight",)) or n[:-7] in kept for n in exported)
    for tp in (1, 2):  # the refit lands as a fresh load of the saved checkpoint would, at engine TP 1 and 2
        adapter = Fp8BlockAdapter(DictAdapter(tp_size=tp), SMALL)
        mcore_zoo.refit(model, adapter, bucket_size="16KB")
        assert_same(adapter.inner.tensors, _engine_from_checkpoint(out, SMALL, tp))


def test_block_export_loads_back_as_its_dequantization(mpu, reference_checkpoint, tmp_path):
    _, model = _bf16_model(reference_checkpoint, "DeepseekV3ForCausalLM")  # a reader of FP8 checkpoints
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "fp8", fp8="block")  # 128 x 128 blocks: ragged edges only
    saved = load_file(str(next((tmp_path / "fp8").glob("*.safetensors"))))
    again = mcore_zoo.build_model(tmp_path / "fp8", backend="local", load=tmp_path / "fp8", params_dtype=torch.float32)
    back = dict(mcore_zoo.iter_hf_weights(again))
    name = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(back[name], dequantize_block(saved[name], saved[name + "_scale_inv"], torch.float32))
    with pytest.raises(ValueError, match="fp8='e4m3'"):
        mcore_zoo.save_hf_checkpoint(model, tmp_path / "bad", fp8="e4m3")


def test_refit_plan_refuses_a_shard_inside_a_block(mpu, reference_checkpoint):
    _, model = _bf16_model(reference_checkpoint, "LlamaForCausalLM")
    plan = get_plan(model, target_tp=2)
    with pytest.raises(LayoutError, match="k_proj.*not on a boundary of the \\[32, 32\\] blocks"):
        fp8_refit_plan(plan, Fp8BlockScheme(block=(32, 32)))  # k rows 32 -> 16 per engine rank
    fp8_refit_plan(get_plan(model, target_tp=1), Fp8BlockScheme(block=(32, 32)))  # whole tensors: ragged edges


def test_ragged_edge_blocks_refit_at_engine_tp1_and_are_refused_inside_a_tp2_shard(mpu, reference_checkpoint,
                                                                                     tmp_path):  # fmt: skip
    """16 x 16 blocks on DeepSeek-V3's example: kv_a_proj_with_mqa's 24 rows end in half a block
    (fused_qkv_a_proj = [q_a 32; kv_a 24]: 4 block rows), kv_b_proj's 112 rows split 56 per rank."""
    scheme = Fp8BlockScheme(block=(16, 16))
    _, model = _bf16_model(reference_checkpoint, "DeepseekV3ForCausalLM")
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "fp8", fp8=scheme)
    adapter = Fp8BlockAdapter(DictAdapter(tp_size=1), scheme)
    mcore_zoo.refit(model, adapter)
    got = adapter.inner.tensors[0]
    assert got["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"].shape == (4, 4)
    assert_same(adapter.inner.tensors, _engine_from_checkpoint(tmp_path / "fp8", scheme, 1))
    with pytest.raises(LayoutError, match="kv_b_proj.*\\[0, 56\\) along axis 0"):
        mcore_zoo.refit(model, Fp8BlockAdapter(DictAdapter(tp_size=2), scheme))


def test_hf_names_refit_sends_whole_fp8_tensors_and_their_scales(mpu, reference_checkpoint):
    _, model = _bf16_model(reference_checkpoint, "Qwen3MoeForCausalLM")
    exported = dict(mcore_zoo.iter_hf_weights(model))
    adapter = Fp8BlockAdapter(DictAdapter(engine_format=HF_NAMES))
    mcore_zoo.refit(model, adapter)
    got = adapter.inner.tensors[0]
    q, s = reference_quantize(exported["model.layers.0.mlp.experts.3.up_proj.weight"], (128, 128))
    assert same_bits(got["model.layers.0.mlp.experts.3.up_proj.weight"], q)
    assert same_bits(got["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"], s)
    assert same_bits(got["model.layers.0.mlp.gate.weight"], exported["model.layers.0.mlp.gate.weight"])


# ---------------------------------------------------------------------------- the vLLM worker side

class FakeFp8Worker(ZooFp8WorkerExtension, FakeWorker):
    """A stand-in worker with the FP8 extension (parameters named and shaped as vLLM's FP8 model)."""


def _fp8_workers(reference_checkpoint, tmp_path, arch, tp):
    _, model = _bf16_model(reference_checkpoint, arch)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "fp8", fp8=SMALL)
    want = _engine_from_checkpoint(tmp_path / "fp8", SMALL, tp)
    stale = [{k: torch.zeros_like(v) for k, v in w.items()} for w in want]
    return model, want, [FakeFp8Worker(stale[r], r) for r in range(tp)]


@pytest.mark.parametrize("transport", ["inproc", "ipc"])
def test_vllm_fp8_direct_refit_writes_fp8_parameters_in_place(mpu, reference_checkpoint, tmp_path, transport):
    model, want, workers = _fp8_workers(reference_checkpoint, tmp_path, "DeepseekV3ForCausalLM", 2)
    adapter = VLLMFp8Adapter(FakeLLM(workers), mode="direct", scheme=SMALL, tp_size=2, transport=transport)
    for _ in range(2):  # the plan and its FP8 form are made once
        mcore_zoo.refit(model, adapter, bucket_size="16KB")
    assert_same([{k: p.data for k, p in w.model_runner.model.named_parameters()} for w in workers], want)


def test_vllm_fp8_direct_refit_refuses_kernels_that_change_their_tensors(mpu, reference_checkpoint, tmp_path):
    import enum

    model, _, workers = _fp8_workers(reference_checkpoint, tmp_path, "Qwen3MoeForCausalLM", 1)
    modules = workers[0].model_runner.model
    modules.get_submodule("model.layers.0.self_attn.qkv_proj").quant_method = type(
        "Fp8LinearMethod", (), {"fp8_linear": type("DeepGemmFp8BlockScaledMMKernel", (), {})(), "use_marlin": False})()
    backend = enum.Enum("Fp8MoeBackend", {"FLASHINFER_CUTLASS": "FLASHINFER_CUTLASS"}).FLASHINFER_CUTLASS
    modules.get_submodule("model.layers.0.mlp.experts.routed_experts").quant_method = type(
        "Fp8MoEMethod", (), {"fp8_backend": backend})()
    adapter = VLLMFp8Adapter(FakeLLM(workers), mode="direct", scheme=SMALL, tp_size=1, transport="inproc")
    with pytest.raises(ZooError, match="2 FP8 layer.*DeepGemmFp8BlockScaledMMKernel.*FLASHINFER_CUTLASS.*mode='reload'"):
        mcore_zoo.refit(model, adapter)


def test_vllm_fp8_reload_runs_vllms_layerwise_reload_around_the_loaders(mpu, reference_checkpoint, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    """Mode "reload": whole fp8 tensors and scales under HF names into the model's load_weights,
    between vLLM's initialize_layerwise_reload (begin) and finalize_layerwise_reload (end)."""
    import sys
    import types

    calls = []
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: calls.append("initialize")
    reload.finalize_layerwise_reload = lambda model, config: calls.append(("finalize", config))
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)
    _, model = _bf16_model(reference_checkpoint, "LlamaForCausalLM")
    worker = FakeFp8Worker({}, 0)
    loaded = {}
    worker.model_runner.model.load_weights = lambda weights: (calls.append("load"), loaded.update(weights))
    worker.model_config = "the model config"
    adapter = VLLMFp8Adapter(FakeLLM([worker]), scheme=SMALL, tp_size=1, transport="inproc")
    mcore_zoo.refit(model, adapter, bucket_size="16KB")
    assert calls[0] == "initialize" and calls[-1] == ("finalize", "the model config")
    assert calls.count("load") > 1 and set(calls[1:-1]) == {"load"}
    exported = dict(mcore_zoo.iter_hf_weights(model))
    name = "model.layers.1.self_attn.o_proj.weight"
    q, s = reference_quantize(exported[name], SMALL.block)
    assert same_bits(loaded[name], q) and same_bits(loaded[name + "_scale_inv"], s)
    assert set(loaded) == set(exported) | {n + "_scale_inv" for n in exported if SMALL.quantizes(n)}
    with pytest.raises(ZooError, match="worker_extension_cls='mcore_zoo.rollout.vllm_fp8.ZooFp8WorkerExtension'"):
        VLLMFp8Adapter(FakeLLM([FakeWorker({}, 0)]), tp_size=1)
