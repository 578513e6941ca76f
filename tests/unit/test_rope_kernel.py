"""Megatron-Core's unfused RoPE through Triton (``mcore_zoo.kernels.rope``, numerics knob
``rope_kernel="triton"``): the same output and gradient bits as Megatron-Core's torch ops. The
kernels run here under Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``; skipped
where Triton is not installed); ``tests/gpu/test_rope_kernel_gpu.py`` runs them compiled."""

from __future__ import annotations


import pytest
import torch

_INTERPRETED = r"""
import pathlib, tempfile
import torch
import mcore_zoo
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as reference
from mcore_zoo.kernels.rope import rope

from mcore_zoo.testing.common import same_bits

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for s, b, h, d, rot, mscale in [(7, 1, 3, 64, 64, 1.0), (5, 2, 4, 48, 32, 1.0), (6, 1, 2, 128, 128, 1.3), (3, 1, 1, 40, 40, 1.0)]:
        base = torch.randn(s, b, h, 3 * d, generator=gen).to(dtype)
        freqs = (torch.randn(s, 1, 1, rot // 2, generator=gen) * 3).repeat(1, 1, 1, 2)
        ta, tb = base[..., d:2 * d].clone().requires_grad_(), base[..., d:2 * d].clone().requires_grad_()
        strided = base[..., d:2 * d]  # a view with a unit last stride (as q / k split from a fused projection)
        assert same_bits(rope(strided, freqs, mscale), reference(strided, freqs, mscale=mscale))
        oa, ob = rope(ta, freqs, mscale), reference(tb, freqs, mscale=mscale)
        assert oa.dtype == ob.dtype and same_bits(oa, ob), (dtype, s, b, h, d, rot)
        g = torch.randn(oa.shape, generator=gen).to(dtype)
        g[0, 0, 0, :4] = 0
        oa.backward(g)
        ob.backward(g)
        assert same_bits(ta.grad, tb.grad), (dtype, s, b, h, d, rot, "grad")

# the knob in a model: logits and every parameter's gradient bitwise those of the torch ops, on a THD pack
from mcore_zoo.parallel import ensure_model_parallel
from mcore_zoo.registry import get_registry
from mcore_zoo.testing.common import ReferenceCheckpoints, case_config
ensure_model_parallel()
with tempfile.TemporaryDirectory() as tmp:
    arch = "Qwen3ForCausalLM"
    path = ReferenceCheckpoints(lambda name: pathlib.Path(tmp) / name)(get_registry().get(arch), case_config(arch, {}))
    seqs = [torch.randint(0, 100, (n,), generator=gen) for n in (12, 5, 1)]
    results = {}
    for kernel in ("torch", "triton"):
        numerics = mcore_zoo.get_profile("hf-exact").with_knobs(rope_kernel=kernel)
        model = mcore_zoo.build_model(path, backend="local", numerics=numerics, load=path, params_dtype=torch.bfloat16)
        assert getattr(model.config, "zoo_rope_kernel", "torch") == kernel
        out = mcore_zoo.packed_forward(model, seqs).logits
        sum(o.float().sum() for o in out).backward()
        results[kernel] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (lt, gt), (lx, gx) = results["torch"], results["triton"]
    assert all(torch.equal(a, b) for a, b in zip(lt, lx))
    assert gt.keys() == gx.keys() and all(same_bits(gt[n], gx[n]) for n in gt), [n for n in gt if not torch.equal(gt[n], gx[n])]
print("ok")
"""


def test_forward_and_gradient_bits_under_the_interpreter():
    """Output and gradient equal Megatron-Core's unfused RoPE bit for bit (bf16, fp16, fp32; partial
    rotary; ``mscale``; a strided input; zeros in the gradient), and a Qwen3 model built with the
    knob gives the torch ops' logits and parameter gradients bit for bit on a THD pack."""
    from mcore_zoo.testing.common import run_under_triton_interpreter

    run_under_triton_interpreter(_INTERPRETED)


def test_the_knob_is_refused_where_it_cannot_run(monkeypatch, reference_checkpoint):
    import mcore_zoo
    from mcore_zoo.errors import ZooError
    from mcore_zoo.kernels import rope
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.specs.rope_dispatch import triton_rope

    with pytest.raises(ZooError, match="needs rope_fusion=False"):
        mcore_zoo.get_profile("default").with_knobs(rope_kernel="triton")
    ensure_model_parallel()
    numerics = mcore_zoo.get_profile("hf-exact").with_knobs(rope_kernel="triton")
    monkeypatch.setattr(rope, "available", lambda: False)
    with pytest.raises(ZooError, match="rope_kernel='triton' needs Triton"):
        mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local", numerics=numerics)
    monkeypatch.setattr(rope, "available", lambda: True)
    with pytest.raises(ZooError, match="interleaved, multimodal or MLA"):
        mcore_zoo.build_model(reference_checkpoint("DeepseekV3ForCausalLM"), backend="local", numerics=numerics)

    class Config:
        apply_rope_fusion = rotary_interleaved = multi_latent_attention = False

    class Group:
        def __init__(self, size):
            self.size = lambda: size

    t, freqs = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ZooError, match="on CUDA"):  # a CPU tensor without the interpreter
        triton_rope(t, freqs, Config(), cp_group=Group(1))
    for group in (None, Group(2)):
        with pytest.raises(ZooError, match="context-parallel"):
            triton_rope(t, freqs, Config(), cp_group=group)
    Config.rotary_interleaved = True
    with pytest.raises(ZooError, match="non-interleaved"):
        triton_rope(t, freqs, Config(), cp_group=Group(1))
