"""CUDA: Megatron-Core's unfused RoPE through Triton (numerics knob ``rope_kernel="triton"``) gives
its output and gradients bit for bit at the built-ins' head widths (the ``training`` profile with
it: ``tests/gpu/test_exact_kernels_gpu.py``).

CPU counterpart: ``tests/unit/test_rope_kernel.py`` (the same kernels under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.testing.common import same_bits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(2048, 4, 32, 128, 128), (512, 1, 8, 128, 128), (8192, 1, 40, 128, 64), (300, 1, 16, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_and_gradient_bits(shape, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as reference

    from mcore_zoo.kernels.rope import rope

    s, b, h, d, rot = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(s, b, h, 3 * d, generator=gen, device="cuda").to(dtype)
    freqs = (torch.arange(s, device="cuda").float()[:, None] * torch.rand(rot // 2, generator=gen, device="cuda"))
    freqs = freqs.repeat(1, 2).reshape(s, 1, 1, rot)
    ta, tb = base[..., d : 2 * d].clone().requires_grad_(), base[..., d : 2 * d].clone().requires_grad_()
    oa, ob = rope(ta, freqs), reference(tb, freqs)
    assert same_bits(oa, ob)
    assert same_bits(rope(base[..., d : 2 * d], freqs), ob)  # a strided input
    g = torch.randn(oa.shape, generator=gen, device="cuda").to(dtype)
    oa.backward(g)
    ob.backward(g)
    assert same_bits(ta.grad, tb.grad)
