"""DeepSeek-V3 / V2 (MLA + DeepSeek MoE) on real gloo process groups: TP2, EP2, PP2 in one
two-rank launch. Per layout, on every rank: the packed forward against the single-process model and
transformers (``layout_bound``), the gathered export and the checkpoint written by ``save_hf_checkpoint``
against the source checkpoint (bitwise); TP2 also one ``train_step`` without sequence parallelism,
every gradient but the routed experts' against the single-process step (``layout_bound``; TP2 with sequence
parallelism trains in ``test_mtp_layouts``). An FP8 block-quantized V3 checkpoint: loaded sharded, the
same logits as the single-process model of its reference dequantization; exported back to FP8
(fp32 fresh scales, bf16 source scales) with the identical tensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import mcore_zoo
from mcore_zoo.placement import Parallelism
from mcore_zoo.testing.common import layout_bound

from ..conftest import SharedLaunch, checkpoint_tensors, export_mismatches, random_sequences

LENGTHS = [23, 9, 40, 5]
TOL = 1e-5  # the fp8 check (relative to its logits' scale)
#: PP2: two layers per stage, the first dense; V3 with q_lora_rank, V2 without (its example)
CASES = {
    "DeepseekV3ForCausalLM": {"num_hidden_layers": 4},
    "DeepseekV32ForCausalLM": {"num_hidden_layers": 4},  # DSA: 23 and 40 tokens > index_topk 8
    "GlmMoeDsaForCausalLM": {"num_hidden_layers": 4},
    "DeepseekV2ForCausalLM": {"num_hidden_layers": 4, "topk_method": "group_limited_greedy", "n_group": 4,
                              "topk_group": 2},  # fmt: skip
}
LAYOUTS = [("tp2", Parallelism(tp=2)), ("ep2", Parallelism(ep=2)), ("pp2", Parallelism(pp=2))]
#: the layout whose training step is compared: TP2 without sequence parallelism, where each rank
#: sees every token and the k_rope gradient of the kv down projection is summed over the heads of
#: both ranks by the zoo (mcore_zoo.families.mla.spec). Megatron-Core refuses to train MoE layers under TP
#: without sequence parallelism, so they run in eval mode (no dropout either way) and the routed
#: experts' gradients are not compared; everything else is
TRAINED = "tp2"


def _loss(tokens):
    return -(tokens.logprobs * tokens.mask).sum(), {}


def train_grads(model) -> dict:
    """One ``train_step`` (MoE layers in eval mode, see ``TRAINED``); the HF-named gradients but
    the routed experts'."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_zoo.distributed.train import train_step

    model.train()
    for chunk in getattr(model, "chunks", [model]):
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.eval()
    train_step(model, random_sequences(LENGTHS, 256), _loss, loss_normalizer=float(sum(LENGTHS)))
    return {k: v.clone() for k, v in mcore_zoo.iter_hf_weights(model, grads=True) if ".mlp.experts." not in k}


def _run(ckpts: dict, out_dir: str, fp8_ckpt: str = "") -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel

    seqs = random_sequences(LENGTHS, 256)
    found: dict = {}
    for arch, ckpt in ckpts.items():
        source = checkpoint_tensors(ckpt)
        for name, parallel in LAYOUTS:
            ensure_model_parallel(parallel)
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", parallel=parallel, load=ckpt)
            model.eval()
            with torch.no_grad():
                logits = mcore_zoo.packed_forward(model, seqs).logits
            export = export_mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
            mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, arch, name), max_shard_size="200KB")
            found[(arch, name)] = {"logits": logits, "export": export}
            if name == TRAINED:
                found[(arch, name)]["grads"] = train_grads(model)
            ps.destroy_model_parallel()
    if fp8_ckpt:
        for name, parallel in LAYOUTS:
            for dtype, scales in ((torch.float32, "fresh"), (torch.bfloat16, "source")):
                ensure_model_parallel(parallel)
                model = mcore_zoo.build_model(fp8_ckpt, backend="portable", numerics="hf-exact", parallel=parallel,
                                              load=fp8_ckpt, params_dtype=dtype).eval()  # fmt: skip
                if dtype == torch.float32:
                    with torch.no_grad():
                        found[("fp8", name)] = {"logits": mcore_zoo.packed_forward(model, seqs).logits}
                mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, "fp8", f"{name}-{scales}"), fp8=True,
                                             fp8_scales=scales, max_shard_size="200KB")  # fmt: skip
                ps.destroy_model_parallel()
    return found


def _checkpoints(reference_checkpoint) -> dict:
    return {arch: str(reference_checkpoint(arch, overrides)) for arch, overrides in CASES.items()}


@pytest.fixture(scope="module")
def fp8_checkpoints(reference_checkpoint, tmp_path_factory) -> tuple:
    """``write_fp8_checkpoints`` of the DeepSeek-V3 case: (fp8 directory, dequantized directory,
    the fp8 tensors)."""
    from ..parity.test_mla_fp8 import write_fp8_checkpoints

    source = reference_checkpoint("DeepseekV3ForCausalLM", CASES["DeepseekV3ForCausalLM"])
    return write_fp8_checkpoints(source, tmp_path_factory.mktemp("fp8-source"), tmp_path_factory.mktemp("dequantized"))


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint, fp8_checkpoints, mpu, tmp_path_factory) -> SharedLaunch:
    """One two-rank launch for this module's tests: every case at ``LAYOUTS``, then the fp8
    checkpoint at ``LAYOUTS``."""
    return SharedLaunch(2, lambda: {
        "layouts": (_run, _checkpoints(reference_checkpoint), str(tmp_path_factory.mktemp("layouts"))),
        "fp8": (_run, {}, str(tmp_path_factory.mktemp("out")), str(fp8_checkpoints[0])),
    })  # fmt: skip


@pytest.mark.slow
def test_two_ranks_tp2_ep2_pp2(reference_checkpoint, hf_reference, two_rank_runs):
    ckpts = _checkpoints(reference_checkpoint)
    found = two_rank_runs["layouts"]
    out_dir = Path(two_rank_runs.cases["layouts"][2])
    seqs = random_sequences(LENGTHS, 256)
    worst = {}
    for arch, ckpt in ckpts.items():
        single = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
        hf = hf_reference(arch, ckpt)
        with torch.no_grad():
            ref = mcore_zoo.packed_forward(single, seqs).logits
            hf_logits = [hf(s[None]).logits[0] for s in seqs]
        source = checkpoint_tensors(ckpt)
        single_grads = train_grads(single)
        for name, _ in LAYOUTS:
            for rank, ranks in enumerate(found):
                r = ranks[(arch, name)]
                where = f"{arch} {name} rank {rank}"
                diff = max((a - b).abs().max().item() for a, b in zip(r["logits"], ref))
                diff_hf = max((a - b).abs().max().item() for a, b in zip(r["logits"], hf_logits))
                bound = layout_bound(ref)
                assert diff <= bound and diff_hf <= bound, f"{where}: logits differ by {diff} (single) / {diff_hf} (HF), bound {bound:.2e}"
                assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
                worst[(arch, name)] = max(worst.get((arch, name), 0.0), diff)
                if name == TRAINED:
                    grads = r["grads"]
                    assert set(grads) == set(single_grads), f"{where}: {sorted(set(grads) ^ set(single_grads))[:5]}"
                    per = {k: (grads[k] - single_grads[k]).abs().max().item() for k in grads}
                    bad = sorted((k for k in per if per[k] > layout_bound(single_grads[k])), key=per.get, reverse=True)
                    assert not bad, f"{where}: gradients differ: {[(k, per[k]) for k in bad[:6]]}"
                    worst[(arch, "grads")] = max(worst.get((arch, "grads"), 0.0), max(per.values()))
            assert export_mismatches(checkpoint_tensors(str(out_dir / arch / name)), source) == [], f"{arch} {name}: save_hf_checkpoint"
    print("max |dlogit| (and |dgrad|) vs the single-process model:", worst)


@pytest.mark.slow
def test_two_ranks_fp8_checkpoint(fp8_checkpoints, two_rank_runs):
    _, deq_dir, fp8 = fp8_checkpoints
    found = two_rank_runs["fp8"]
    out_dir = Path(two_rank_runs.cases["fp8"][2])
    seqs = random_sequences(LENGTHS, 256)
    single = mcore_zoo.build_model(deq_dir, backend="portable", numerics="hf-exact", load=deq_dir).eval()
    with torch.no_grad():
        ref = mcore_zoo.packed_forward(single, seqs).logits
    scale = max(1.0, max(r.abs().max().item() for r in ref))
    for name, _ in LAYOUTS:
        for rank, ranks in enumerate(found):
            diff = max((a - b).abs().max().item() for a, b in zip(ranks[("fp8", name)]["logits"], ref))
            # TP2 sums row-parallel partial products in another order: relative to the logits' scale
            assert diff <= TOL * scale, f"fp8 {name} rank {rank}: logits differ by {diff} (scale {scale})"
        for scales in ("fresh", "source"):
            out = checkpoint_tensors(str(out_dir / "fp8" / f"{name}-{scales}"))
            assert set(out) == set(fp8), f"fp8 {name} {scales}: {sorted(set(out) ^ set(fp8))[:5]}"
            for key, tensor in fp8.items():
                if tensor.dtype == torch.float8_e4m3fn or key.endswith("_scale_inv"):
                    assert torch.equal(out[key].view(torch.uint8), tensor.view(torch.uint8)), f"fp8 {name} {scales}: {key}"
