"""CUDA: Megatron-Core's unfused RoPE through Triton (numerics knob ``rope_kernel="triton"``) gives
its output and gradients bit for bit at the built-ins' head widths, and the ``training`` profile
with it (and with ``norm_kernel="triton"``) keeps its logits and gradients.

CPU counterpart: ``tests/unit/test_rope_kernel.py`` (the same kernels under Triton's interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mcore_zoo

pytestmark = pytest.mark.gpu


def _bits(a):
    return a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16)


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
    assert torch.equal(_bits(oa), _bits(ob))
    assert torch.equal(_bits(rope(base[..., d : 2 * d], freqs)), _bits(ob))  # a strided input
    g = torch.randn(oa.shape, generator=gen, device="cuda").to(dtype)
    oa.backward(g)
    ob.backward(g)
    assert torch.equal(_bits(ta.grad), _bits(tb.grad))


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed")
def test_the_training_profile_with_both_kernels_keeps_its_logits_and_gradients(tmp_path):
    """``training`` on ``te`` with ``rope_kernel="triton"``: logits and every parameter's gradient
    bitwise the ``training`` profile's; with ``norm_kernel="triton"`` (alone or with it): the logits
    bitwise (that kernel's gradients are not autograd's bits)."""
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
    runs = {}
    for name, knobs in (("torch", {}), ("rope", {"rope_kernel": "triton"}), ("norm", {"norm_kernel": "triton"}),
                        ("both", {"rope_kernel": "triton", "norm_kernel": "triton"})):  # fmt: skip
        numerics = mcore_zoo.get_profile("training").with_knobs(**knobs)
        model = mcore_zoo.build_model(path, backend="te", numerics=numerics, params_dtype=torch.bfloat16, load=path)
        logits = mcore_zoo.packed_forward(model, seqs).logits
        sum(x.float().sum() for x in logits).backward()
        runs[name] = ([x.detach() for x in logits], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        del model
    (lt, gt), (lr, gr) = runs["torch"], runs["rope"]
    assert all(torch.equal(a, b) for a, b in zip(lt, lr))
    assert gt.keys() == gr.keys() and all(torch.equal(_bits(gt[n]), _bits(gr[n])) for n in gt)
    for name in ("norm", "both"):
        assert all(torch.equal(a, b) for a, b in zip(lt, runs[name][0])), name
