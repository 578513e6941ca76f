"""DeepSeek-V3 / V2 (MLA + DeepSeek MoE) on real gloo process groups: TP2, EP2, PP2 in one
two-rank launch. Per layout, on every rank: the packed forward against the single-process model and
transformers (1e-5), the gathered export and the checkpoint written by ``save_hf_checkpoint``
against the source checkpoint (bitwise)."""

from __future__ import annotations

import os

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed import launch
from mcore_zoo.placement import Parallelism

from ..conftest import random_sequences
from .test_moe_layouts import _mismatches, _source

LENGTHS = [23, 9, 40, 5]
TOL = 1e-5
#: PP2: two layers per stage, the first dense; V3 with q_lora_rank, V2 without (its example)
CASES = {
    "DeepseekV3ForCausalLM": {"num_hidden_layers": 4},
    "DeepseekV2ForCausalLM": {"num_hidden_layers": 4, "topk_method": "group_limited_greedy", "n_group": 4,
                              "topk_group": 2},  # fmt: skip
}
LAYOUTS = [("tp2", Parallelism(tp=2)), ("ep2", Parallelism(ep=2)), ("pp2", Parallelism(pp=2))]


def _run(ckpts: dict, out_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel

    seqs = random_sequences(LENGTHS, 256)
    found: dict = {}
    for arch, ckpt in ckpts.items():
        source = _source(ckpt)
        for name, parallel in LAYOUTS:
            ensure_model_parallel(parallel)
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", parallel=parallel, load=ckpt)
            model.eval()
            with torch.no_grad():
                logits = mcore_zoo.packed_forward(model, seqs).logits
            export = _mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
            mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, arch, name), max_shard_size="200KB")
            found[(arch, name)] = {"logits": logits, "export": export}
            ps.destroy_model_parallel()
    return found


@pytest.mark.slow
def test_two_ranks_tp2_ep2_pp2(reference_checkpoint, hf_reference, mpu, tmp_path):
    ckpts = {arch: str(reference_checkpoint(arch, overrides)) for arch, overrides in CASES.items()}
    found = launch(_run, 2, ckpts, str(tmp_path))
    seqs = random_sequences(LENGTHS, 256)
    worst = {}
    for arch, ckpt in ckpts.items():
        single = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
        hf = hf_reference(arch, ckpt)
        with torch.no_grad():
            ref = mcore_zoo.packed_forward(single, seqs).logits
            hf_logits = [hf(s[None]).logits[0] for s in seqs]
        source = _source(ckpt)
        for name, _ in LAYOUTS:
            for rank, ranks in enumerate(found):
                r = ranks[(arch, name)]
                where = f"{arch} {name} rank {rank}"
                diff = max((a - b).abs().max().item() for a, b in zip(r["logits"], ref))
                diff_hf = max((a - b).abs().max().item() for a, b in zip(r["logits"], hf_logits))
                assert diff <= TOL and diff_hf <= TOL, f"{where}: logits differ by {diff} (single) / {diff_hf} (HF)"
                assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
                worst[(arch, name)] = max(worst.get((arch, name), 0.0), diff)
            assert _mismatches(_source(str(tmp_path / arch / name)), source) == [], f"{arch} {name}: save_hf_checkpoint"
    print("max |dlogit| vs the single-process model:", worst)
