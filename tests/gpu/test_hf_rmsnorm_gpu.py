"""CUDA: RMSNorm in transformers' op order through Triton (numerics knob ``norm_kernel="triton"``)
gives transformers' output bit for bit at the widths the built-ins use, and its gradients are as
close to a float64 gradient as autograd's (the ``training`` profile with it, logits bitwise:
``tests/gpu/test_rope_kernel_gpu.py``).

CPU counterpart: ``tests/unit/test_hf_rmsnorm.py`` (the same kernels under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(8192, 4096), (4, 2048, 4096), (8192, 32, 128), (512, 7168), (300, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_bitwise_and_gradients_against_float64(shape, dtype):
    from mcore_zoo.testing.rmsnorm import check_hf_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=gen, device="cuda") * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device="cuda")).to(dtype)
    print(shape, dtype, check_hf_rms_norm(x, w, 1e-6))
