"""A padded vocabulary under tensor parallelism (2 gloo ranks): the last rank holds real and
padding rows; loading, the packed forward and the export agree with the unpadded model."""

from __future__ import annotations

import pytest
import torch

from ..conftest import SharedLaunch


def _run(ckpt: str) -> dict:
    import mcore_zoo
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel(Parallelism(tp=2))
    numerics = mcore_zoo.get_profile("default").with_knobs(attention="eager")
    model = mcore_zoo.build_model(ckpt, backend="portable", numerics=numerics, load=ckpt,
                                  make_vocab_size_divisible_by=100).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (23, 9)]
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs)
    rows = model.embedding.word_embeddings.weight.shape[0]
    return {"logprobs": out.logprobs, "seqs": seqs, "exported": dict(mcore_zoo.iter_hf_weights(model)), "rows": rows}


ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint) -> SharedLaunch:
    """One two-rank launch running every architecture of ``ARCHS``."""
    return SharedLaunch(2, lambda: {arch: (_run, str(reference_checkpoint(arch))) for arch in ARCHS})


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_padded_vocab_tp2(reference_checkpoint, hf_reference, two_rank_runs, arch):
    from safetensors.torch import load_file

    from mcore_zoo.packing import next_token_logprobs

    ckpt = reference_checkpoint(arch)
    rank0, rank1 = two_rank_runs[arch]
    source = load_file(str(ckpt / "model.safetensors"))
    assert rank0["rows"] == rank1["rows"] == 200  # 400 padded rows (256 real) over 2 ranks
    for rank in (rank0, rank1):
        assert set(rank["exported"]) == set(source)
        assert all(torch.equal(rank["exported"][k], source[k]) for k in source)
    hf = hf_reference(arch, ckpt)
    with torch.no_grad():
        for seq, lp in zip(rank0["seqs"], rank0["logprobs"]):
            ref = next_token_logprobs(hf(seq[None]).logits[0], seq)
            assert (lp - ref).abs().max() <= 1e-5
