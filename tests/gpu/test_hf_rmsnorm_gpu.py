"""CUDA: RMSNorm in transformers' op order through Triton (numerics knob ``norm_kernel="triton"``)
gives transformers' output bit for bit at the widths the built-ins use, its gradients are as close
to a float64 gradient as autograd's, and the ``training`` profile with it keeps transformers' sdpa
logits bit for bit.

CPU counterpart: ``tests/unit/test_hf_rmsnorm.py`` (the same kernels under Triton's interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mcore_zoo

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(8192, 4096), (4, 2048, 4096), (8192, 32, 128), (512, 7168), (300, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_bitwise_and_gradients_against_float64(shape, dtype):
    from mcore_zoo.testing.rmsnorm import check_hf_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=gen, device="cuda") * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device="cuda")).to(dtype)
    print(shape, dtype, check_hf_rms_norm(x, w, 1e-6))


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed")
def test_the_training_profile_with_the_triton_norm_keeps_its_logits(tmp_path):
    """``training`` on ``te`` with ``norm_kernel="triton"``: its logits equal the ``training``
    profile's (the torch ops) bit for bit, on a mixed THD pack with a one-token sequence."""
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
    seqs = [torch.randint(0, 1000, (n,), generator=gen).cuda() for n in (512, 300, 100, 37, 1)]
    out = {}
    for kernel in ("torch", "triton"):
        numerics = mcore_zoo.get_profile("training").with_knobs(norm_kernel=kernel)
        model = mcore_zoo.build_model(path, backend="te", numerics=numerics, params_dtype=torch.bfloat16, load=path).eval()
        with torch.no_grad():
            out[kernel] = mcore_zoo.packed_forward(model, seqs).logits
        del model
    assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["triton"]))
