"""CUDA: Megatron-Core's unfused SwiGLU through Triton (numerics knob ``swiglu_kernel="triton"``)
gives its output and gradients bit for bit (torch's CUDA ``silu`` / ``silu_backward`` with
``expf`` and IEEE divisions) at the built-ins' MLP widths (the ``training`` profile with it:
``tests/gpu/test_exact_kernels_gpu.py``).

CPU counterpart: ``tests/unit/test_swiglu_kernel.py`` (the same kernels under Triton's interpreter,
within torch's distance to float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_zoo.testing.common import same_bits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(8192, 2 * 14336), (4, 512, 2 * 12288), (300, 2 * 768), (17, 2 * 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_and_gradient_bits(shape, dtype):
    from mcore_zoo.kernels.swiglu import swiglu

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=gen, device="cuda") * 4).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    oa = swiglu(xa)
    gate, up = torch.chunk(xb, 2, dim=-1)
    ob = F.silu(gate) * (up + 0.0)
    assert same_bits(oa, ob)
    g = torch.randn(oa.shape, generator=gen, device="cuda").to(dtype)
    oa.backward(g)
    ob.backward(g)
    assert same_bits(xa.grad, xb.grad)
