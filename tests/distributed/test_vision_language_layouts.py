"""Vision-language models (Qwen2.5-VL, Qwen3-VL with deepstack features, Qwen3.5 on its hybrid
gated DeltaNet decoder) on real gloo process groups: TP2 (the tower replicated on both ranks) and
PP2 (the tower and the deepstack layers on the first stage), in one launch of two ranks.

Per layout, on every rank: the packed forward of three samples with two, zero and one images
against the single-process model computed at the ranks' thread count (``at_rank_threads``): PP2
bitwise equal to it, TP2 within ``layout_bound``; the gathered export and the checkpoint
written by ``save_hf_checkpoint`` against the source checkpoint (bitwise). At TP2, ``train_step``
on the same pack: every parameter's gradient under its HF name (gathered, the tower's included)
within 1e-5 of the single-process update's.
"""

from __future__ import annotations

import os

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed import launch
from mcore_zoo.placement import Parallelism
from mcore_zoo.testing.common import at_rank_threads, layout_bound

from ..conftest import checkpoint_tensors, export_mismatches
from ..parity.vision_samples import image_sample

ARCHS = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration")
#: Qwen3-VL with four decoder layers: at PP2 the first stage holds both deepstack layers (a stage
#: after the first that holds one is refused by name)
LAYERS = {"Qwen3VLForConditionalGeneration": 4}
LAYOUTS = [("tp2", Parallelism(tp=2)), ("pp2", Parallelism(pp=2))]
#: the layouts whose ``train_step`` gradients are compared with one process's
TRAINED = ("tp2",)
GRAD_TOL = 1e-5


def _samples() -> tuple[list, list]:
    """Three samples (two images, none, one), their vision inputs (random pixels)."""
    samples = [image_sample(1, [(1, 6, 4), (1, 4, 4)]), image_sample(2, []), image_sample(3, [(1, 8, 8)])]
    return [ids for ids, _ in samples], [vision or None for _, vision in samples]


def _overrides(arch: str) -> dict:
    if arch not in LAYERS:
        return {}
    text = mcore_zoo.lookup(arch).example_config()["text_config"]
    return {"text_config": {**text, "num_hidden_layers": LAYERS[arch]}}


def _loss(tokens):
    """The pack's mean next-token negative log-likelihood (normalised by the pack's predicted
    tokens, as the RL losses of ``test_training.py`` are)."""
    predicted = sum(ids.numel() - 1 for ids in _samples()[0])
    return -(tokens.logprobs * tokens.mask).sum() / predicted, {}


def _gradients(model) -> dict[str, torch.Tensor]:
    """``train_step``'s gradients of the three-sample pack under HF names (gathered over TP)."""
    seqs, inputs = _samples()
    model.train()
    model.zero_grad(set_to_none=True)
    mcore_zoo.train_step(model, seqs, _loss, vision_inputs=inputs)
    return {name: grad.clone() for name, grad in mcore_zoo.iter_hf_weights(model, grads=True)}


def _run(ckpts: dict, out_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel

    seqs, inputs = _samples()
    found: dict = {}
    for arch, ckpt in ckpts.items():
        source = checkpoint_tensors(ckpt)
        for name, parallel in LAYOUTS:
            ensure_model_parallel(parallel)
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", parallel=parallel, load=ckpt)
            model.eval()
            with torch.no_grad():
                logits = mcore_zoo.packed_forward(model, seqs, vision_inputs=inputs).logits
            export = export_mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
            mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, arch, name), max_shard_size="200KB")
            found[(arch, name)] = {"logits": logits, "export": export}
            if name in TRAINED:
                found[(arch, name)]["grads"] = _gradients(model)
            ps.destroy_model_parallel()
    return found


@pytest.mark.slow
def test_tp2_and_pp2_equal_one_process_and_export_bitwise_and_tp2_gradients(reference_checkpoint, mpu, tmp_path):
    ckpts = {arch: str(reference_checkpoint(arch, _overrides(arch))) for arch in ARCHS}
    found = launch(_run, 2, ckpts, str(tmp_path))
    seqs, inputs = _samples()
    worst, bounds = {}, {}
    for arch, ckpt in ckpts.items():
        single = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
        with at_rank_threads(len(found)):
            with torch.no_grad():
                ref = mcore_zoo.packed_forward(single, seqs, vision_inputs=inputs).logits
            grads = _gradients(single)
        source, bound = checkpoint_tensors(ckpt), layout_bound(ref)
        tower = [n for n in grads if "visual." in n]
        assert tower and all(grads[n].abs().sum() > 0 for n in tower), f"{arch}: the tower takes no gradient"
        bounds[arch] = bound
        for name, parallel in LAYOUTS:
            limit = 0.0 if parallel.tp == 1 else bound  # a pipeline alone: the same GEMMs on the same shapes
            for rank, ranks in enumerate(found):
                r, where = ranks[(arch, name)], f"{arch} {name} rank {rank}"
                diff = max((a - b).abs().max().item() for a, b in zip(r["logits"], ref))
                assert diff <= limit, f"{where}: logits differ from one process by {diff}, bound {limit:.2e}"
                assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
                worst[(arch, name)] = max(worst.get((arch, name), 0.0), diff)
                if name in TRAINED:
                    assert r["grads"].keys() == grads.keys(), f"{where}: gradient names differ"
                    for key, want in grads.items():
                        gap = (r["grads"][key] - want).abs().max().item()
                        assert gap <= GRAD_TOL, f"{where}: gradient of {key} differs from one process by {gap}"
                    worst[(arch, "train_step")] = max(worst.get((arch, "train_step"), 0.0),
                                                      *((r["grads"][k] - g).abs().max().item() for k, g in grads.items()))
            saved = checkpoint_tensors(os.path.join(str(tmp_path), arch, name))
            assert export_mismatches(saved, source) == [], f"{arch} {name}: save_hf_checkpoint"
    print("max |dlogit| (and |dgrad| of train_step) vs the single-process model:", worst, "bounds:", bounds)


def test_layouts_the_family_is_not_built_for_are_refused_by_name():
    from mcore_zoo.config.transformer import validate_layout

    example = mcore_zoo.lookup(ARCHS[1]).example_config()
    arch = mcore_zoo.lookup(ARCHS[1]).config_from_hf({**example, **_overrides(ARCHS[1])})
    for parallel, what in ((Parallelism(cp=2), "context parallelism"), (Parallelism(tp=2, sequence_parallel=True),
                           "sequence parallelism"), (Parallelism(pp=2, vpp=2), "virtual pipeline")):  # fmt: skip
        with pytest.raises(mcore_zoo.UnsupportedLayoutError, match=what):
            validate_layout(arch, parallel)
