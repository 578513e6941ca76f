"""Grouped experts (Megatron-Core's real ``TEGroupedMLP`` and the zoo's ``HFOrderTEGroupedMLP``) on
the CPU, for every MoE family, with the stand-in grouped linears of ``tests/te_grouped_standin.py``.

The stand-ins multiply each expert's rows exactly as the sequential experts' linears do, so the
grouped model must equal the sequential one bit for bit (and transformers, where the sequential
``hf-exact`` build does): that checks the weight rules (expert ``i`` of the grouped parameters is
HF expert ``i``, gate before up), ``TEGroupedMLP``'s activation, the HF-order weighting after
``linear_fc2``, loading and export. Transformer Engine's grouped GEMM kernels are not run here
(``tests/gpu/test_grouped_experts_gpu.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.profiles import get_profile

from ..conftest import checkpoint_tensors, export_mismatches, random_sequences, require_current_deepseek_v2_reference
from ..te_grouped_standin import expert_gradients, installed

FAMILIES = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
            "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]  # fmt: skip


def _profiles(router: str):
    sequential = get_profile("hf-exact").with_knobs(router=router)
    return sequential, dataclasses.replace(sequential, name=f"standin-grouped-{router}", grouped_experts=True)


def _pair(ckpt, router: str, dtype: torch.dtype):
    sequential, grouped = _profiles(router)
    seq = mcore_zoo.build_model(ckpt, backend="local", numerics=sequential, load=ckpt, params_dtype=dtype).eval()
    with installed():
        grp = mcore_zoo.build_model(ckpt, backend="local", numerics=grouped, load=ckpt, params_dtype=dtype).eval()
    return seq, grp


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)


def _expert_classes(model) -> set[str]:
    return {type(layer.mlp.experts).__name__ for layer in model.decoder.layers if hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize("arch_name", FAMILIES)
def test_grouped_equals_sequential_and_hf_and_exports_the_checkpoint(mpu, reference_checkpoint, hf_reference, arch_name):
    """fp32, router="hf": grouped == sequential == transformers eager, bit for bit; the export
    of the grouped model is the checkpoint, bit for bit."""
    if arch_name == "DeepseekV2ForCausalLM":
        require_current_deepseek_v2_reference()
    ckpt = reference_checkpoint(arch_name)
    seq, grp = _pair(ckpt, "hf", torch.float32)
    assert _expert_classes(grp) == {"HFOrderTEGroupedMLP"} and _expert_classes(seq) == {"HFOrderSequentialMLP"}
    ids = torch.stack(random_sequences([37, 37, 37], 256, seed=3))
    ours = _logits(grp, ids)
    assert torch.equal(ours, _logits(seq, ids)), (ours - _logits(seq, ids)).abs().max()
    with torch.no_grad():
        ref = hf_reference(arch_name, ckpt)(ids).logits
    assert torch.equal(ours, ref), (ours - ref).abs().max()
    assert export_mismatches(dict(mcore_zoo.iter_hf_weights(grp)), checkpoint_tensors(str(ckpt))) == []


@pytest.mark.parametrize("arch_name", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_grouped_equals_sequential_in_bf16_and_with_the_stock_router(mpu, reference_checkpoint, arch_name):
    """bf16 with HF's order (the weight applied after ``linear_fc2`` rounds differently from
    before it), and fp32 with Megatron-Core's stock router and experts (``TEGroupedMLP`` as is)."""
    ckpt = reference_checkpoint(arch_name)
    ids = torch.stack(random_sequences([29, 29], 256, seed=4))
    seq, grp = _pair(ckpt, "hf", torch.bfloat16)
    assert torch.equal(_logits(grp, ids), _logits(seq, ids))
    seq, grp = _pair(ckpt, "mcore", torch.float32)
    assert _expert_classes(grp) == {"TEGroupedMLP"} and _expert_classes(seq) == {"SequentialMLP"}
    assert torch.equal(_logits(grp, ids), _logits(seq, ids))


@pytest.mark.parametrize("router", ["hf", "mcore"])
def test_grouped_gradients_equal_sequential(mpu, reference_checkpoint, router):
    """Backward through the grouped experts (bf16): every expert weight's gradient equals the
    sequential expert's bit for bit, and so does the router's."""
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM")
    ids = torch.stack(random_sequences([40, 40], 256, seed=6))
    grads, router_grads = [], []
    for model in _pair(ckpt, router, torch.bfloat16):
        logits = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        grads.append(expert_gradients(model))
        router_grads.append([layer.mlp.router.weight.grad for layer in model.decoder.layers if hasattr(layer.mlp, "router")])
    grouped, sequential = grads[1], grads[0]
    assert set(grouped) == set(sequential) and len(grouped) > 0
    assert all(g is not None and torch.equal(g, sequential[k]) for k, g in grouped.items())
    assert all(torch.equal(a, b) for a, b in zip(*router_grads)) and router_grads[0]


def test_the_comparison_sees_where_the_routing_weight_is_applied(mpu, reference_checkpoint, monkeypatch):
    """Stock ``TEGroupedMLP`` (weight applied before ``linear_fc2``) under the HF router and combine
    is not bitwise equal to the sequential HF-order model: the equality above is not vacuous."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from mcore_zoo.families.moe import spec as moe_specs

    ckpt = reference_checkpoint("MixtralForCausalLM")
    ids = torch.stack(random_sequences([29, 29], 256, seed=4))
    seq, _ = _pair(ckpt, "hf", torch.bfloat16)
    monkeypatch.setattr(moe_specs, "hf_grouped_experts_class", lambda experts: TEGroupedMLP)
    _, stock = _pair(ckpt, "hf", torch.bfloat16)
    assert _expert_classes(stock) == {"TEGroupedMLP"}
    assert not torch.equal(_logits(stock, ids), _logits(seq, ids))


def test_grouped_mtp_layer_loads_and_exports(mpu, reference_checkpoint, tmp_path):
    """DeepSeek-V3 with a multi-token-prediction layer: its MoE experts are grouped too (the MTP
    layer's own names), loaded and exported bit for bit, and the logits of both (main and MTP
    depth, BSHD) equal the sequential model's."""
    from .mtp_reference import write_mtp_checkpoint

    ckpt = write_mtp_checkpoint(reference_checkpoint("DeepseekV3ForCausalLM"), tmp_path / "mtp")
    seq, grp = _pair(ckpt, "hf", torch.float32)
    mtp = [n for n, _ in grp.named_parameters() if n.startswith("mtp.") and ".mlp.experts." in n]
    assert mtp and all(".mlp.experts.linear_fc" in n for n in mtp), mtp[:4]
    assert export_mismatches(dict(mcore_zoo.iter_hf_weights(grp)), checkpoint_tensors(str(ckpt))) == []
    ids = torch.stack(random_sequences([30, 30], 256, seed=5))
    ours = _logits(grp, ids)
    assert ours.shape[1] == 2 * ids.shape[1]  # the main logits, then the MTP depth's
    assert torch.equal(ours, _logits(seq, ids))
