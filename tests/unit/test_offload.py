"""Offload to host memory and back (``mcore_zoo.offload``): a model wrapped in Megatron-Core's DDP
with its distributed optimizer, after one training step, has every parameter, gradient buffer and
optimizer-state storage emptied by ``offload`` and the same bits in all of them after
``restore``; the next forward gives the same log-probs bit for bit. An unwrapped model without
an optimizer (a frozen reference) moves its parameters alone."""

from __future__ import annotations

import torch

import mcore_zoo
from mcore_zoo.offload import offload

from ..conftest import random_sequences


def _state(setup) -> dict[str, torch.Tensor]:
    """Every tensor offload moves, cloned, by a name."""
    out = {}
    for i, chunk in enumerate(setup.chunks):
        for n, p in chunk.named_parameters():
            out[f"{i}.{n}"] = p.detach().clone()
            if getattr(p, "main_grad", None) is not None:
                out[f"{i}.{n}.main_grad"] = p.main_grad.clone()
    inner = setup.optimizer.optimizer
    for j, state in enumerate(inner.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"opt{j}.{k}"] = v.clone()
    return out


def test_offload_round_trip_is_bitwise(mpu, reference_checkpoint):
    from megatron.core.optimizer import OptimizerConfig

    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 2})
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True, bf16=False,
                             fp16=False, params_dtype=torch.float32)  # fmt: skip
    setup = mcore_zoo.wrap_for_training(model, config)
    seqs = random_sequences([9, 14, 5], mcore_zoo.handle_of(model).arch_config.vocab_size, seed=1)
    setup.zero_grad()
    mcore_zoo.train_step(setup.model, seqs, lambda t: (t.logprobs.sum(), {}), loss_normalizer=25.0)
    assert setup.optimizer.step()[0]
    before = _state(setup)
    assert any(k.startswith("opt") for k in before) and any(k.endswith("main_grad") for k in before)
    with torch.no_grad():
        logprobs = mcore_zoo.packed_forward(setup.model, seqs, return_logits=False).logprobs

    moved = offload(setup.model, setup.optimizer)
    params = [p for c in setup.chunks for p in c.parameters()]
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the device memory is released
    assert moved.nbytes >= 3 * sum(p.numel() * 4 for p in params)  # parameters, gradients, two moments
    moved.restore()

    after = _state(setup)
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before), [k for k in before if not torch.equal(after[k], before[k])]
    with torch.no_grad():
        again = mcore_zoo.packed_forward(setup.model, seqs, return_logits=False).logprobs
    assert all(torch.equal(a, b) for a, b in zip(again, logprobs))
    print(f"offload {moved.nbytes / 1e6:.1f} MB; restored in {moved.seconds * 1e3:.1f} ms")


def test_offload_of_an_unwrapped_model_without_optimizer(mpu, reference_checkpoint):
    """A frozen reference as ``build_model`` returns it: its parameters go and come back."""
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 2})
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = offload(model)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert moved.nbytes == sum(p.numel() * p.element_size() for p in before.values())
    moved.restore()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
