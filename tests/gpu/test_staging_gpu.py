"""CUDA: device destinations read through the pinned staging ring (``mcore_zoo.weights.staging``)
equal the reference path's reads bitwise - every chunk, destination layout and dtype of the CPU
test (``tests/unit/test_staging.py``), with pinned buffers, ``non_blocking`` copies on the side
stream and events guarding buffer reuse - and a model on the GPU loads the same parameters through
the ring as through the mapping path."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.weights.staging import MappingPath, StagingRing

from ..unit.test_staging import check_staged_reads

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("raw_copies", [True, False], ids=["raw-copies", "torch-copies"])
def test_device_destinations_through_small_pinned_buffers(tmp_path, monkeypatch, raw_copies):
    from mcore_zoo.weights import staging

    monkeypatch.setattr(staging, "RAW_COPIES", raw_copies)
    check_staged_reads(tmp_path, "cuda", StagingRing(3, 4096))


def test_device_destinations_through_the_default_ring(tmp_path):
    check_staged_reads(tmp_path, "cuda", StagingRing())


def test_raw_copies_on_the_device(tmp_path, monkeypatch):
    """``RAW_COPIES`` (the default): contiguous destinations of the file's dtype copied by ``cudaMemcpyAsync``
    through ctypes (the libcudart torch loaded), the others as before - the same bits, and raw
    copies were made. Fails where this process maps no libcudart (the option would then copy as
    before, silently)."""
    from mcore_zoo.weights import staging

    memcpy = staging._cuda_memcpy_async()
    assert memcpy is not None, "no libcudart mapped in this process"
    copied = []
    monkeypatch.setattr(staging, "RAW_COPIES", True)
    monkeypatch.setattr(staging, "_cuda_memcpy_async", lambda: lambda *args: copied.append(args[2]) or memcpy(*args))
    check_staged_reads(tmp_path, "cuda", StagingRing(3, 4096))
    (tmp_path / "default").mkdir()
    check_staged_reads(tmp_path / "default", "cuda", StagingRing())
    assert len(copied) > 10 and all(n > 0 for n in copied)


def test_a_load_onto_the_gpu_equals_the_mapping_path(mpu, reference_checkpoint):
    import mcore_zoo
    from mcore_zoo.weights.io import HFCheckpoint

    ckpt = reference_checkpoint("LlamaForCausalLM")
    staged = mcore_zoo.build_model(ckpt, backend="local")
    mapped = mcore_zoo.build_model(ckpt, backend="local")
    assert next(staged.parameters()).is_cuda
    ring = StagingRing(3, 8192)
    with HFCheckpoint(ckpt, staging=ring) as source:
        mcore_zoo.load_hf_weights(staged, source)
    refusing = MappingPath()  # refuses every chunk: the mapping path
    with HFCheckpoint(ckpt, staging=refusing) as source:
        mcore_zoo.load_hf_weights(mapped, source)
    assert ring.bytes_staged > 0 and refusing.bytes_staged == 0
    want = dict(mapped.named_parameters())
    for name, param in staged.named_parameters():
        assert torch.equal(param.detach().view(torch.uint8), want[name].detach().view(torch.uint8)), name
