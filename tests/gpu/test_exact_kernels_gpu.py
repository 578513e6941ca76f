"""CUDA: the ``training`` profile with its exact Triton kernels (numerics knobs ``norm_kernel``,
``rope_kernel``, ``swiglu_kernel`` = ``"triton"``) keeps the ``training`` profile's logits bit for
bit on a mixed THD pack, and with the RoPE and SwiGLU kernels its parameter gradients too (the
norm kernel's gradients are not autograd's bits), with torch's deterministic algorithms on (the
plain profile's own gradients differ run to run without). Kernel-level tests:
``tests/gpu/test_hf_rmsnorm_gpu.py``, ``test_rope_kernel_gpu.py``, ``test_swiglu_kernel_gpu.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mcore_zoo

from mcore_zoo.testing.common import same_bits

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed")
def test_the_training_profile_with_the_triton_kernels_keeps_its_logits_and_gradients(tmp_path, monkeypatch):
    # torch's own gradients are not reproducible run to run otherwise (sdpa's flash backward accumulates
    # dQ with atomics: two runs of the plain training profile differed in 4 parameter gradients on an H100)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _check_the_training_profile_with_the_triton_kernels(tmp_path)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _check_the_training_profile_with_the_triton_kernels(tmp_path):
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.registry import get_registry
    from mcore_zoo.testing.common import ReferenceCheckpoints, case_config

    ensure_model_parallel()
    arch = "Qwen3ForCausalLM"
    path = ReferenceCheckpoints(lambda name: tmp_path / name)(
        get_registry().get(arch), case_config(arch, {"hidden_size": 1024, "intermediate_size": 2816,
                                                     "num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "head_dim": 128, "num_hidden_layers": 2}))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).cuda() for n in (512, 300, 100, 37, 1)]
    variants = {"torch": {}, "rope": {"rope_kernel": "triton"}, "swiglu": {"swiglu_kernel": "triton"},
                "rope+swiglu": {"rope_kernel": "triton", "swiglu_kernel": "triton"}, "norm": {"norm_kernel": "triton"},
                "all": {"rope_kernel": "triton", "swiglu_kernel": "triton", "norm_kernel": "triton"}}  # fmt: skip
    runs = {}
    for name, knobs in variants.items():
        numerics = mcore_zoo.get_profile("training").with_knobs(**knobs)
        model = mcore_zoo.build_model(path, backend="te", numerics=numerics, params_dtype=torch.bfloat16, load=path)
        logits = mcore_zoo.packed_forward(model, seqs).logits
        sum(x.float().sum() for x in logits).backward()
        runs[name] = ([x.detach() for x in logits], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        del model
    want_logits, want_grads = runs["torch"]
    for name, (logits, grads) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(want_logits, logits)), name
        if "norm_kernel" not in variants[name] and name != "torch":
            assert grads.keys() == want_grads.keys(), name
            assert all(same_bits(want_grads[n], grads[n]) for n in grads), name
