"""RMSNorm in transformers' op order through Triton (``mcore_zoo.kernels.hf_rmsnorm``, numerics knob
``norm_kernel="triton"``): the same forward bits as transformers' ops, gradients as close to a
float64 gradient as autograd's through those ops. The kernels run here under Triton's CPU
interpreter (a subprocess with ``TRITON_INTERPRET=1``; skipped where Triton is not installed - the
CPU wheel of torch does not ship it); ``tests/gpu/test_hf_rmsnorm_gpu.py`` runs them compiled."""

from __future__ import annotations


import pytest
import torch

_INTERPRETED = r"""
import torch
import mcore_zoo
from mcore_zoo.kernels.hf_rmsnorm import hf_rms_norm
from mcore_zoo.testing.rmsnorm import check_hf_rms_norm, transformers_rms_norm as hf

gen = torch.Generator().manual_seed(0)
worst = 0.0
cases = [(torch.bfloat16, torch.bfloat16, (3, 5, 64)), (torch.bfloat16, torch.bfloat16, (70, 100)),
         (torch.float16, torch.float16, (9, 48)), (torch.float32, torch.float32, (9, 48)),
         (torch.bfloat16, torch.float32, (9, 48)), (torch.float32, torch.bfloat16, (4, 33)),
         (torch.bfloat16, torch.bfloat16, (130, 16))]
for dtype, wdtype, shape in cases:
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    x[0, ..., :2] = 0  # a row with zeros
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(wdtype)
    worst = max([worst, *check_hf_rms_norm(x, w, 1e-6).values()])
# a strided input: transformers' ops as they are (same bits, autograd's gradient)
x = torch.randn(8, 64, generator=gen).bfloat16().t()
w = torch.randn(8, generator=gen).bfloat16()
assert torch.equal(hf_rms_norm(x, w, 1e-5), hf(x, w, 1e-5))

# the knob in a model: logits bitwise those of the torch ops (hf-exact, local backend, CPU)
from mcore_zoo.testing.common import ReferenceCheckpoints, case_config
from mcore_zoo.registry import get_registry
from mcore_zoo.parallel import ensure_model_parallel
import tempfile, pathlib
ensure_model_parallel()
with tempfile.TemporaryDirectory() as tmp:
    arch = "Qwen3ForCausalLM"  # input, pre-MLP, q / k and final norms
    path = ReferenceCheckpoints(lambda name: pathlib.Path(tmp) / name)(get_registry().get(arch), case_config(arch, {}))
    tokens = torch.randint(0, 100, (1, 12), generator=gen)
    logits = {}
    for kernel in ("torch", "triton"):
        numerics = mcore_zoo.get_profile("hf-exact").with_knobs(norm_kernel=kernel)
        model = mcore_zoo.build_model(path, backend="local", numerics=numerics, load=path, params_dtype=torch.bfloat16)
        kinds = {type(m).__name__ for m in model.modules()}
        assert ("HFRMSNormTriton" in kinds) == (kernel == "triton"), kinds
        logits[kernel] = mcore_zoo.packed_forward(model, [tokens[0], tokens[0, :5]]).logits
    assert all(torch.equal(a, b) for a, b in zip(logits["torch"], logits["triton"]))
print("ok", worst)
"""


def test_forward_bits_and_gradients_under_the_interpreter():
    """The kernels' output equals transformers' ops bit for bit (bf16, fp16, fp32 inputs; bf16 /
    fp32 weights; widths that are not powers of two; a row of zeros), their gradients are within
    1.5x autograd's distance to a float64 gradient, and a model built with the knob gives the
    torch ops' logits bit for bit."""
    from mcore_zoo.testing.common import run_under_triton_interpreter

    run_under_triton_interpreter(_INTERPRETED)


def test_the_knob_is_refused_where_it_cannot_run(monkeypatch):
    """``norm_kernel="triton"`` needs ``norm="hf"``, Triton, an RMSNorm with ``x * weight`` and
    tensors its kernels take; each refusal names the knob."""
    import mcore_zoo
    from mcore_zoo.errors import ZooError
    from mcore_zoo.kernels import hf_rmsnorm
    from mcore_zoo.specs.norms import HFRMSNormTriton

    with pytest.raises(ZooError, match="norm_kernel='triton' is a kernel for norm='hf'"):
        mcore_zoo.get_profile("default").with_knobs(norm_kernel="triton")
    with pytest.raises(ZooError, match="norm_kernel"):
        mcore_zoo.get_profile("hf-exact").with_knobs(norm_kernel="cuda")
    assert mcore_zoo.get_profile("hf-exact").with_knobs(norm_kernel="triton").norm_kernel == "triton"

    class Config:
        normalization, use_cpu_initialization, params_dtype, sequence_parallel = "RMSNorm", True, torch.float32, False

    norm = HFRMSNormTriton(Config(), 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ZooError, match="norm_kernel='triton' runs on CUDA tensors"):
        norm(torch.randn(2, 16))
    assert not hf_rmsnorm.runs_on(torch.randn(2))


def test_a_build_with_the_knob_is_refused_without_triton_or_for_zero_centred_norms(monkeypatch, reference_checkpoint):
    import mcore_zoo
    from mcore_zoo.errors import ZooError
    from mcore_zoo.kernels import hf_rmsnorm
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel()
    numerics = mcore_zoo.get_profile("hf-exact").with_knobs(norm_kernel="triton")
    monkeypatch.setattr(hf_rmsnorm, "available", lambda: False)
    with pytest.raises(ZooError, match="norm_kernel='triton' needs Triton"):
        mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local", numerics=numerics)
    monkeypatch.setattr(hf_rmsnorm, "available", lambda: True)
    with pytest.raises(ZooError, match="zero-centred"):
        mcore_zoo.build_model(reference_checkpoint("Qwen3NextForCausalLM"), backend="local", numerics=numerics)
