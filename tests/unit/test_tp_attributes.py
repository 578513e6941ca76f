"""Every parameter of a model built to be loaded (``load=``: no random init) carries Megatron-Core's
tensor-parallel attributes exactly as Megatron-Core's own initialisation sets them. Megatron's
optimizer reads them to count each TP shard once in the gradient norm (the layouts' check of that
norm: ``tests/distributed/test_training.py``)."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")
ARCHS = ["LlamaForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"]


def _attributes(model) -> dict:
    return {n: tuple(getattr(p, a, None) for a in ATTRIBUTES) for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["local", "portable"])
@pytest.mark.parametrize("arch_name", ARCHS)
def test_loaded_model_has_the_stock_tensor_parallel_attributes(mpu, reference_checkpoint, arch_name, backend):
    ckpt = reference_checkpoint(arch_name)
    stock = mcore_zoo.build_model(ckpt, backend=backend, params_dtype=torch.float32)  # Megatron-Core's random init
    for numerics in ("default", "hf-exact"):
        loaded = mcore_zoo.build_model(ckpt, backend=backend, numerics=numerics, params_dtype=torch.float32, load=ckpt)
        want, got = _attributes(stock), _attributes(loaded)
        assert set(got) == set(want)
        wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
        assert not wrong, f"{numerics}: {len(wrong)} parameters differ (loaded, stock): {dict(list(wrong.items())[:4])}"
        assert any(attrs[0] is True for attrs in got.values())  # the check can see a sharded parameter
