"""CUDA: the Triton kernel behind ``mcore_zoo.kernels.copy_runs`` writes large and strided runs
bitwise and nothing else. CPU counterpart: ``tests/unit/test_copy_runs.py`` (the same tables,
executed with ``memmove``)."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.kernels.copy_runs import RunTable, byte_runs

pytestmark = pytest.mark.gpu


def test_the_kernel_copies_large_and_strided_runs_on_the_gpu():
    from mcore_zoo.kernels.copy_runs import supported

    if not supported(torch.device("cuda")):
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    fused = torch.randn(8 * 768, 4096, generator=g, device="cuda").to(torch.bfloat16)
    engine = torch.zeros(8 * 768 + 1, 4096, device="cuda", dtype=torch.bfloat16)
    groups = fused.view(8, 768, 4096)
    parts = [(engine[: 8 * 512].view(8, 512, 4096), groups[:, :512]),
             (engine[8 * 512 : 8 * 640].view(8, 128, 4096), groups[:, 512:640]),
             (engine[8 * 640 : 8 * 768].view(8, 128, 4096), groups[:, 640:])]  # fmt: skip
    runs = [r for dst, src in parts for r in byte_runs(dst, src)]
    RunTable(runs, engine.device).launch()
    torch.cuda.synchronize()
    want = torch.cat([groups[:, :512].reshape(-1, 4096), groups[:, 512:640].reshape(-1, 4096),
                      groups[:, 640:].reshape(-1, 4096)])  # fmt: skip
    assert torch.equal(engine[:-1], want)
    assert not engine[-1].any()  # nothing past the regions written
