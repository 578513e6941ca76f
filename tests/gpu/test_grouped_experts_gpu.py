"""Grouped-GEMM experts on the GPU: the numerics knob ``grouped_experts`` on the ``te`` backend in
bf16 builds Megatron-Core's ``TEGroupedMLP`` on Transformer Engine's real ``GroupedLinear``
(``HFOrderTEGroupedMLP`` under the default ``router="hf"``) for Qwen3-MoE and Mixtral.

Per architecture and profile (``default``, ``training``):

* the routed experts are ``TEGroupedMLP`` subclasses whose projections are TE ``GroupedLinear``
  modules with parameters ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}`` and nothing else;
  the config says ``moe_grouped_gemm=True``;
* a random bf16 HF checkpoint loads (every parameter covered) and the export is the checkpoint,
  bit for bit;
* logits: TE's grouped GEMM may round differently from one GEMM per expert, so the grouped model
  is not compared bitwise. Both it and the sequential-experts model of the same profile are
  compared with transformers eager (bf16, same checkpoint, BSHD ``[4, 256]``) by mean |dlogp|
  over the full vocabulary; the grouped model must be as close as the sequential one:
  ``grouped <= 1.1 * sequential + 1e-4``. That this comparison can fail is checked by swapping
  two experts' ``linear_fc1`` in the first MoE layer, which must move the grouped model at least
  twice as far from transformers as the sequential model is;
* backward (``training`` profile): every grouped expert weight gets a finite gradient, and the
  gradients of all expert weights, flattened, have cosine similarity >= 0.98 with the sequential
  model's (same loss, same tokens; bf16 rounding and the odd routing flip move them a little);
* a distributed checkpoint written from the HF checkpoint by ``hf_to_mcore`` (sequential-expert
  keys, which Megatron-Core's ``TEGroupedMLP.sharded_state_dict`` shares) loads into the grouped
  model, whose export is then the HF checkpoint bit for bit.

Needs CUDA and Transformer Engine (skipped otherwise). Passed on an H100 (megatron-core 0.19.2,
Transformer Engine 2.20.2, 2026-11-23).
"""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.metrics import Predictions, logprob_metrics
from mcore_zoo.parity.reference import load_reference

from ..conftest import checkpoint_tensors, export_mismatches
from ..te_grouped_standin import expert_gradients
from .conftest import bf16_checkpoints

pytestmark = pytest.mark.gpu

SIZE = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
            max_position_embeddings=4096)  # fmt: skip
EXTRA = {
    "Qwen3MoeForCausalLM": dict(head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                                mlp_only_layers=[], decoder_sparse_step=1),  # fmt: skip
    "MixtralForCausalLM": dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024),
}
RATIO, FLOOR = 1.1, 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformer_engine.pytorch")  # before any CUDA op of transformers (two cuDNNs)
    return bf16_checkpoints(tmp_path_factory, SIZE, EXTRA)


def _mean_dlogp(logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> float:
    tokens = [row.cpu() for row in ids]
    metrics = logprob_metrics(Predictions(tokens, logits=[r.float().cpu() for r in ref]),
                              Predictions(tokens, logits=[x.float().cpu() for x in logits]))  # fmt: skip
    return float(metrics["mean_abs_dlogp"])


def _logits(model, ids):
    ids = ids.cuda()
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1], device="cuda").expand(ids.shape[0], -1), None)


@pytest.mark.parametrize("name", list(EXTRA))
@pytest.mark.parametrize("profile", ["default", "training"])
def test_grouped_experts_load_export_and_logits(mpu, checkpoints, name, profile):
    import transformer_engine.pytorch as te
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    ckpt = checkpoints[name]
    base = mcore_zoo.get_profile(profile)
    grouped = mcore_zoo.build_model(ckpt, backend="te", numerics=base.with_knobs(grouped_experts=True),
                                    params_dtype=torch.bfloat16, load=ckpt).eval()  # fmt: skip
    assert grouped.config.moe_grouped_gemm is True
    moe_layers = [layer for layer in grouped.decoder.layers if hasattr(layer.mlp, "experts")]
    assert moe_layers
    for layer in moe_layers:
        experts = layer.mlp.experts
        assert isinstance(experts, TEGroupedMLP) and type(experts).__name__ == "HFOrderTEGroupedMLP"
        for fc in (experts.linear_fc1, experts.linear_fc2):
            assert isinstance(fc, te.GroupedLinear)
            assert sorted(n for n, _ in fc.named_parameters()) == sorted(f"weight{i}" for i in range(fc.num_gemms))
    source = checkpoint_tensors(str(ckpt))
    assert export_mismatches(dict(mcore_zoo.iter_hf_weights(grouped)), source) == []

    sequential = mcore_zoo.build_model(ckpt, backend="te", numerics=base, params_dtype=torch.bfloat16, load=ckpt).eval()
    assert not isinstance(sequential.decoder.layers[-1].mlp.experts, TEGroupedMLP)
    hf = load_reference(mcore_zoo.lookup(name), ckpt, dtype=torch.bfloat16, attn_implementation="eager", device="cuda")
    ids = torch.randint(0, hf.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits
    d_grouped = _mean_dlogp(_logits(grouped, ids), ref, ids)
    d_sequential = _mean_dlogp(_logits(sequential, ids), ref, ids)
    d_between = _mean_dlogp(_logits(grouped, ids), _logits(sequential, ids), ids)
    print(f"{name} {profile}: mean|dlogp| vs HF eager: grouped {d_grouped:.4g}, sequential {d_sequential:.4g};"
          f" grouped vs sequential {d_between:.4g}")  # fmt: skip
    assert d_grouped <= RATIO * d_sequential + FLOOR, (d_grouped, d_sequential)

    with torch.no_grad():  # the comparison sees a wrong expert mapping
        fc1 = moe_layers[0].mlp.experts.linear_fc1
        w0, w1 = fc1.weight0.clone(), fc1.weight1.clone()
        fc1.weight0.copy_(w1)
        fc1.weight1.copy_(w0)
    d_swapped = _mean_dlogp(_logits(grouped, ids), ref, ids)
    assert d_swapped > 2 * d_sequential, (d_swapped, d_sequential)


def _build(ckpt, profile: str, grouped: bool, load=True):
    numerics = mcore_zoo.get_profile(profile).with_knobs(grouped_experts=grouped)
    return mcore_zoo.build_model(ckpt, backend="te", numerics=numerics, params_dtype=torch.bfloat16,
                                 load=ckpt if load else None)  # fmt: skip


@pytest.mark.parametrize("name", list(EXTRA))
def test_grouped_experts_backward_matches_sequential(mpu, checkpoints, name):
    ckpt = checkpoints[name]
    ids = torch.randint(0, SIZE["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
    grads = {}
    for grouped in (True, False):
        model = _build(ckpt, "training", grouped).eval()
        logits = model(ids, torch.arange(ids.shape[1], device="cuda").expand(ids.shape[0], -1), None)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        grads[grouped] = expert_gradients(model)
    assert set(grads[True]) == set(grads[False]) and grads[True]
    for key, grad in grads[True].items():
        assert grad is not None and torch.isfinite(grad).all(), key
    a = torch.cat([grads[True][k].float().flatten() for k in sorted(grads[True])])
    # a sequential expert that received no token may have no gradient at all: zeros
    b = torch.cat([(grads[False][k] if grads[False][k] is not None else torch.zeros_like(grads[True][k])).float().flatten()
                   for k in sorted(grads[True])])  # fmt: skip
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    print(f"{name}: expert-gradient cosine similarity grouped vs sequential {cosine:.6f}")
    assert cosine >= 0.98, cosine


def test_grouped_experts_load_a_distributed_checkpoint(mpu, checkpoints, tmp_path):
    from mcore_zoo.dist_checkpoint import hf_to_mcore, load_mcore_checkpoint

    ckpt = checkpoints["Qwen3MoeForCausalLM"]
    hf_to_mcore(ckpt, tmp_path / "mcore")
    model = _build(ckpt, "training", True, load=False)
    load_mcore_checkpoint(model, tmp_path / "mcore")
    assert export_mismatches(dict(mcore_zoo.iter_hf_weights(model)), checkpoint_tensors(str(ckpt))) == []
