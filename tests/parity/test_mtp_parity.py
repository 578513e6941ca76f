"""Multi-token prediction (DeepSeek-V3, GLM-4.5) on CPU fp32, one process: the MTP block against an
independent torch reference of DeepSeek-V3's definition built from transformers' own decoder-layer
class (:mod:`.mtp_reference`; transformers has no MTP forward), the main logits unchanged by the
MTP block, the MTP log-probs of the packed forward and the MTP loss of ``train_step``, load /
export round trips, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mcore_zoo

from ..conftest import checkpoint_tensors, export_mismatches, random_sequences
from .mtp_reference import MTPReference, write_layer_swap_checkpoint, write_mtp_checkpoint

ARCHS = ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"]
DROP = {"num_nextn_predict_layers": "not trained here"}


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    """``{arch: (source without MTP, checkpoint with one MTP layer, layer-swapped checkpoint)}``."""
    from mcore_zoo.registry import get_registry
    from mcore_zoo.testing.common import ReferenceCheckpoints, case_config

    refs = ReferenceCheckpoints(lambda name: tmp_path_factory.mktemp(name))
    found = {}
    for arch in ARCHS:
        source = Path(refs(get_registry().get(arch), case_config(arch, {}), seed=0))
        ckpt = write_mtp_checkpoint(source, tmp_path_factory.mktemp(f"{arch}-mtp"))
        found[arch] = (source, ckpt, write_layer_swap_checkpoint(ckpt, tmp_path_factory.mktemp(f"{arch}-swap")))
    return found


def _build(ckpt, **kwargs):
    return mcore_zoo.build_model(str(ckpt), backend="local", numerics="hf-exact", load=str(ckpt),
                                 params_dtype=torch.float32, **kwargs).eval()  # fmt: skip


def _bshd(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)


def _reference(arch, checkpoints, hf_reference):
    source, ckpt, swap = checkpoints[arch]
    return MTPReference(hf_reference(arch, source), hf_reference(arch, swap), ckpt).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_bitwise_against_reference(mpu, mtp_checkpoints, hf_reference, arch):
    """BSHD forward of the model built with MTP: the main logits are transformers' (bitwise), the
    MTP depth's logits the reference's (bitwise); the main logits equal those of the same
    checkpoint built with MTP dropped (bitwise)."""
    _, ckpt, _ = mtp_checkpoints[arch]
    ref = _reference(arch, mtp_checkpoints, hf_reference)
    ids = torch.stack(random_sequences([48, 48], 256, seed=1))
    out = _bshd(_build(ckpt), ids)
    main, mtp = out[:, :48], out[:, 48:]
    with torch.no_grad():
        assert torch.equal(main, ref.hf(ids).logits)
        assert torch.equal(mtp, ref(ids))
    assert torch.equal(_bshd(_build(ckpt, ignore_fields=DROP), ids), main)


def test_mtp_concat_order_matters(mpu, mtp_checkpoints, hf_reference):
    """eh_proj's input columns swapped ([hidden; embedding]) must move the MTP logits: the
    comparison above sees the order."""
    arch = ARCHS[0]
    _, ckpt, _ = mtp_checkpoints[arch]
    ref = _reference(arch, mtp_checkpoints, hf_reference)
    ids = torch.stack(random_sequences([48], 256, seed=1))
    model = _build(ckpt)
    with torch.no_grad():
        weight = model.mtp.layers[0].eh_proj.weight
        weight.copy_(torch.cat(weight.chunk(2, dim=1)[::-1], dim=1))
        assert (_bshd(model, ids)[:, 48:] - ref(ids)).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_mtp_logprobs(mpu, mtp_checkpoints, hf_reference, arch):
    """THD packed forward: main log-probs / logits unchanged by the MTP block (bitwise against the
    model built with MTP dropped), MTP log-probs ``[len - 2]`` per sequence equal to the reference's
    log-softmax at token ``j + 2`` (1e-5: packed THD attention sums in another order than the
    reference's padded batch)."""
    _, ckpt, _ = mtp_checkpoints[arch]
    ref = _reference(arch, mtp_checkpoints, hf_reference)
    seqs = random_sequences([23, 9, 40, 5], 256, seed=2)
    out = mcore_zoo.packed_forward(_build(ckpt), seqs, return_mtp_logprobs=True)
    plain = mcore_zoo.packed_forward(_build(ckpt, ignore_fields=DROP), seqs)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, plain.logits))
    assert all(torch.equal(a, b) for a, b in zip(out.logprobs, plain.logprobs))
    assert len(out.mtp_logprobs) == 1
    worst = 0.0
    with torch.no_grad():
        for s, lp in zip(seqs, out.mtp_logprobs[0]):
            expected = torch.log_softmax(ref(s[None])[0, :-2].float(), -1).gather(-1, s[2:, None])[:, 0]
            assert lp.shape == expected.shape
            worst = max(worst, (lp - expected).abs().max().item() if lp.numel() else 0.0)
    assert worst <= 1e-5, worst
    print(f"{arch}: max |dlogp| of the packed MTP log-probs vs the reference: {worst:.2e}")
    with pytest.raises(mcore_zoo.errors.ZooError, match="return_mtp_logprobs"):
        mcore_zoo.packed_forward(_build(ckpt, ignore_fields=DROP), seqs, return_mtp_logprobs=True)


def test_train_step_mtp_loss(mpu, mtp_checkpoints, hf_reference):
    """``train_step`` adds ``mtp_loss_scale * (MTP cross-entropy)`` to the trainer's loss and reports
    it (``metrics["mtp_loss"]``, equal to the reference's cross-entropy); the MTP layers get
    gradients from it, none without it, and the main loss is the trainer's."""
    from mcore_zoo.distributed.train import train_step

    arch = ARCHS[0]
    _, ckpt, _ = mtp_checkpoints[arch]
    ref = _reference(arch, mtp_checkpoints, hf_reference)
    seqs = random_sequences([23, 9, 40], 256, seed=3)
    with torch.no_grad():
        ce = sum(-torch.log_softmax(ref(s[None])[0, :-2].float(), -1).gather(-1, s[2:, None]).sum() for s in seqs)
        main = sum(-torch.log_softmax(ref.hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).sum()
                   for s in seqs)  # fmt: skip
    tokens = sum(len(s) - 1 for s in seqs)

    def loss_fn(t):
        return -(t.logprobs * t.mask).sum(), {}

    results = {}
    for scale in (0.3, 0.0):
        model = _build(ckpt)
        model.train()
        result = train_step(model, seqs, loss_fn, loss_normalizer=tokens, mtp_loss_scale=scale)
        results[scale] = (result, model.mtp.layers[0].eh_proj.weight.grad)
    (with_mtp, grad), (without, zero) = results[0.3], results[0.0]
    assert abs(with_mtp.metrics["mtp_loss"].item() - ce.item() / tokens) <= 1e-5
    assert abs(without.loss.item() - main.item() / tokens) <= 1e-5
    assert abs(with_mtp.loss.item() - (main.item() + 0.3 * ce.item()) / tokens) <= 1e-5
    assert grad.abs().sum() > 0 and zero.abs().sum() == 0
    model = _build(ckpt, ignore_fields=DROP)
    with pytest.raises(mcore_zoo.errors.ZooError, match="mtp_loss_scale"):
        train_step(model, seqs, loss_fn, mtp_loss_scale=0.1)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_export_round_trip(mpu, mtp_checkpoints, tmp_path, arch):
    """Export writes the MTP layer back under its HF names, the embed_tokens / shared_head.head
    copies included: bitwise the source (iter_hf_weights and save_hf_checkpoint)."""
    _, ckpt, _ = mtp_checkpoints[arch]
    source = checkpoint_tensors(str(ckpt))
    model = _build(ckpt)
    assert export_mismatches(dict(mcore_zoo.iter_hf_weights(model)), source) == []
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    assert export_mismatches(checkpoint_tensors(str(tmp_path / "out")), source) == []


def test_mtp_copies_optional_and_checked(mpu, mtp_checkpoints, tmp_path):
    """A checkpoint without the MTP layer's embedding / head copies loads (export writes them); one
    whose copy differs is refused, naming both tensors."""
    from safetensors.torch import save_file

    from mcore_zoo.weights.tied import CopyMismatchError

    arch = ARCHS[0]
    source, ckpt, _ = mtp_checkpoints[arch]
    bare = write_mtp_checkpoint(source, tmp_path / "bare", copies=False)
    model = _build(bare)
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert torch.equal(exported["model.layers.3.embed_tokens.weight"], exported["model.embed_tokens.weight"])
    tensors = checkpoint_tensors(str(ckpt))
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"] * 2
    save_file(tensors, str(ckpt.parent / "changed.safetensors"))
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_text((ckpt / "config.json").read_text())
    (ckpt.parent / "changed.safetensors").rename(changed / "model.safetensors")
    with pytest.raises(CopyMismatchError, match=r"model\.layers\.3\.shared_head\.head\.weight.*lm_head\.weight"):
        _build(changed)


def test_mtp_refusals_and_drop(mpu, mtp_checkpoints):
    """More than one MTP layer is refused naming the field; dropping them stays explicit
    (ignore_fields): no MTP block, the checkpoint's MTP tensors ignored by name."""
    from mcore_zoo.errors import UnsupportedConfigError
    from mcore_zoo.registry import get_registry

    for arch_name in ARCHS:
        arch = get_registry().get(arch_name)
        config = dict(arch.entry.example_config, num_nextn_predict_layers=2)
        with pytest.raises(UnsupportedConfigError, match="num_nextn_predict_layers"):
            arch.config_from_hf(config)
        dropped = arch.config_from_hf(config, ignore_fields=DROP)
        assert dropped.mtp_num_layers == 0 and dropped.fields["num_nextn_predict_layers"].kind == "ignored"
        built = arch.config_from_hf(dict(config, num_nextn_predict_layers=1))
        assert built.mtp_num_layers == 1 and built.fields["num_nextn_predict_layers"].kind == "mapped"
        wmap = arch.weight_map(dropped)
        assert wmap.is_ignored("model.layers.3.eh_proj.weight") and not wmap.is_ignored("model.layers.2.mlp.gate.weight")
    _, ckpt, _ = mtp_checkpoints[ARCHS[0]]
    model = _build(ckpt, ignore_fields=DROP)
    assert not hasattr(model, "mtp")


def test_mtp_layouts_refused(mpu):
    """Context parallelism is refused with MTP, before anything is built; so is a value head."""
    from mcore_zoo.build import prepare
    from mcore_zoo.errors import LayoutError, ZooError
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.registry import get_registry

    config = dict(get_registry().get(ARCHS[0]).entry.example_config, num_nextn_predict_layers=1)
    with pytest.raises(LayoutError, match="multi-token prediction"):
        prepare(config, parallel=Parallelism(cp=2), backend="portable")
    with pytest.raises(ZooError, match="value head"):
        prepare(config, head="value", value_head_init="zeros", backend="portable")
