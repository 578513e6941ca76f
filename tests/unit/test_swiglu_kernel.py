"""Megatron-Core's unfused SwiGLU through Triton (``mcore_zoo.kernels.swiglu``, numerics knob
``swiglu_kernel="triton"``). Under Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``;
skipped where Triton is not installed) the kernels take numpy's ``exp``, not the GPU's ``expf``, so
the output and gradients are held to torch's own distance from a float64 SwiGLU rather than to its
bits (and 16-bit outputs to >= 99% of torch's bits); ``tests/gpu/test_swiglu_kernel_gpu.py`` checks the bits, compiled."""

from __future__ import annotations


import pytest
import torch

_INTERPRETED = r"""
import pathlib, tempfile
import torch
import torch.nn.functional as F
import mcore_zoo
from mcore_zoo.kernels.swiglu import swiglu

def torch_swiglu(x, offset):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + offset)

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for shape, offset in (((37, 2 * 700), 0.0), ((2, 3, 2 * 64), 0.0), ((5, 2 * 33), 1.0)):
        x = (torch.randn(shape, generator=gen) * 4).to(dtype)
        g = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype)
        grads = {}
        for name, fn, inp in (("ours", swiglu, x), ("torch", torch_swiglu, x), ("f64", torch_swiglu, x.double())):
            leaf = inp.clone().requires_grad_()
            out = fn(leaf, offset)
            out.backward(g.to(out.dtype))
            grads[name] = (out.detach(), leaf.grad)
        for k in (0, 1):
            truth = grads["f64"][k]
            ours = (grads["ours"][k].double() - truth).abs().max().item()
            theirs = (grads["torch"][k].double() - truth).abs().max().item()
            assert grads["ours"][k].dtype == dtype and grads["ours"][k].shape == grads["torch"][k].shape
            assert ours <= 2 * theirs + 1e-6 * truth.abs().max().item(), (dtype, shape, k, ours, theirs)
        if dtype != torch.float32:  # each op rounded as torch rounds it: the 16-bit outputs agree but where
            # numpy's and torch's exp differ by an ulp of float32 and that flips a rounding (rare)
            same = (grads["ours"][0] == grads["torch"][0]).float().mean().item()
            assert same >= 0.99, (dtype, shape, same)

# the knob in a model (float32): the MLP is the Triton one, logits as the torch ops' to float32 rounding
from mcore_zoo.parallel import ensure_model_parallel
from mcore_zoo.registry import get_registry
from mcore_zoo.testing.common import ReferenceCheckpoints, case_config
ensure_model_parallel()
with tempfile.TemporaryDirectory() as tmp:
    arch = "LlamaForCausalLM"
    path = ReferenceCheckpoints(lambda name: pathlib.Path(tmp) / name)(get_registry().get(arch), case_config(arch, {}))
    seqs = [torch.randint(0, 100, (n,), generator=gen) for n in (12, 5, 1)]
    logits = {}
    for kernel in ("torch", "triton"):
        model = mcore_zoo.build_model(path, backend="local", load=path,
                                      numerics=mcore_zoo.get_profile("hf-exact").with_knobs(swiglu_kernel=kernel))
        kinds = {type(m).__name__ for m in model.modules()}
        assert ("TritonSwiGLUMLP" in kinds) == (kernel == "triton"), kinds
        logits[kernel] = mcore_zoo.packed_forward(model, seqs).logits
    for a, b in zip(logits["torch"], logits["triton"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
print("ok")
"""


def test_output_and_gradients_under_the_interpreter():
    from mcore_zoo.testing.common import run_under_triton_interpreter

    run_under_triton_interpreter(_INTERPRETED)


def test_the_knob_is_refused_where_it_cannot_run(monkeypatch, reference_checkpoint):
    import mcore_zoo
    from mcore_zoo.errors import ZooError
    from mcore_zoo.kernels import swiglu
    from mcore_zoo.parallel import ensure_model_parallel

    with pytest.raises(ZooError, match="needs bias_activation_fusion=False"):
        mcore_zoo.get_profile("default").with_knobs(swiglu_kernel="triton")
    for knob in ("swiglu_kernel", "rope_kernel"):  # vllm-exact runs vLLM's kernels for these ops
        with pytest.raises(ZooError, match="kernels='vllm' both replace"):
            mcore_zoo.get_profile("vllm-exact").with_knobs(**{knob: "triton"})
    ensure_model_parallel()
    numerics = mcore_zoo.get_profile("hf-exact").with_knobs(swiglu_kernel="triton")
    monkeypatch.setattr(swiglu, "available", lambda: False)
    with pytest.raises(ZooError, match="swiglu_kernel='triton' needs Triton"):
        mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local", numerics=numerics)
    monkeypatch.setattr(swiglu, "available", lambda: True)
    with pytest.raises(ZooError, match="MoE experts"):
        mcore_zoo.build_model(reference_checkpoint("Qwen3MoeForCausalLM"), backend="local", numerics=numerics)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local", numerics=numerics)
    with pytest.raises(ZooError, match="runs on CUDA tensors"):
        mcore_zoo.packed_forward(model, [torch.tensor([1, 2, 3])])
