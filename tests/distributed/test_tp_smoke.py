"""Tensor parallel on real gloo process groups (2 ranks): chunked loading, packed forward and
export agree with transformers / the source checkpoint."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.distributed import launch


def _tp2_run(ckpt: str) -> dict:
    import mcore_zoo
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel(Parallelism(tp=2))
    numerics = mcore_zoo.get_profile("default").with_knobs(attention="eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=numerics, load=ckpt).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (23, 9, 40)]
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs)
    exported = dict(mcore_zoo.iter_hf_weights(model))
    return {"logits": out.logits, "seqs": seqs, "exported": exported}


@pytest.mark.slow
def test_tp2_matches_transformers_and_exports_bitwise(reference_checkpoint, hf_reference):
    from safetensors.torch import load_file

    ckpt = reference_checkpoint("Qwen2ForCausalLM")
    rank0, rank1 = launch(_tp2_run, 2, str(ckpt))
    hf = hf_reference("Qwen2ForCausalLM", ckpt)
    source = load_file(str(ckpt / "model.safetensors"))
    for rank in (rank0, rank1):
        assert set(rank["exported"]) == set(source)
        assert all(torch.equal(rank["exported"][k], source[k]) for k in source)
    with torch.no_grad():
        for seq, logits in zip(rank0["seqs"], rank0["logits"]):
            ref = hf(seq[None]).logits[0]
            # row-parallel layers sum partial products across ranks: another summation order
            assert (logits - ref).abs().max() <= 1e-5


def _world_size_and_store() -> tuple[int, str]:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return dist.get_world_size(), type(store).__name__


def test_launch_does_not_depend_on_its_rendezvous_port_staying_free(monkeypatch):
    """The ranks meet through a file store, not a TCP port: a port found free and then taken by
    another process before rank 0 listens on it (here: held open, listening) does not fail the
    run with ``EADDRINUSE``."""
    import importlib
    import socket

    launch_module = importlib.import_module("mcore_zoo.distributed.launch")  # the package exports its function

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(launch_module, "_free_port", lambda: port)
        results = launch(_world_size_and_store, 2)
    assert [world for world, _ in results] == [2, 2]
    assert all("FileStore" in store for _, store in results), results
