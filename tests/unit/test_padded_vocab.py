"""Padded vocabulary (make_vocab_size_divisible_by): loads and exports exactly; the padding rows
never reach the HF side, and log-probabilities are those of the HF vocabulary."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.handle import handle_of
from mcore_zoo.vocab import PAD_LOGIT, padded_vocab_size


def test_padded_size_follows_megatron():
    assert padded_vocab_size(256, None) == 256
    assert padded_vocab_size(250, 128) == 256 and padded_vocab_size(257, 128, tp=2) == 512
    with pytest.raises(mcore_zoo.ZooError):
        padded_vocab_size(250, 0)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # untied, tied
def test_padded_vocab_loads_and_exports_exactly(mpu, reference_checkpoint, tmp_path, arch):
    ckpt = reference_checkpoint(arch)
    state = load_file(str(ckpt / "model.safetensors"))
    vocab = state["model.embed_tokens.weight"].shape[0]
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, make_vocab_size_divisible_by=100)
    padded = padded_vocab_size(vocab, 100)
    assert padded > vocab and handle_of(model).arch_config.padded_vocab_size == padded
    emb = model.embedding.word_embeddings.weight
    assert emb.shape[0] == padded and torch.equal(emb[:vocab], state["model.embed_tokens.weight"])
    assert not emb[vocab:].any()
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(state) and all(torch.equal(exported[k], state[k]) for k in state)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(again[k], state[k]) for k in state)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == vocab


def test_padded_logprobs_equal_unpadded(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    plain = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    padded = mcore_zoo.build_model(ckpt, backend="local", load=ckpt, make_vocab_size_divisible_by=100)
    seqs = [torch.randint(0, 256, (9,)), torch.randint(0, 256, (5,))]
    a = mcore_zoo.packed_forward(plain, seqs, seq_format="bshd")
    b = mcore_zoo.packed_forward(padded, seqs, seq_format="bshd", return_logits=True)
    vocab = a.logits[0].shape[-1] if a.logits else 256
    assert all((l[:, vocab:] == PAD_LOGIT).all() and l.isfinite().all() for l in b.logits)
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # the vocab-parallel head (finite logits required): same log-probs and entropy as unpadded
    from mcore_zoo.distributed import token_logprobs_and_entropy

    full = mcore_zoo.packed_forward(plain, seqs, seq_format="bshd", return_logits=True)
    for unpadded, padded_logits, seq in zip(full.logits, b.logits, seqs):
        targets = torch.cat([seq[1:], seq.new_full((1,), -100)])
        lp_a, h_a = token_logprobs_and_entropy(unpadded, targets)
        lp_b, h_b = token_logprobs_and_entropy(padded_logits, targets)
        assert h_b.isfinite().all()
        torch.testing.assert_close(lp_a, lp_b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h_a, h_b, rtol=1e-6, atol=1e-6)


def test_convert_round_trip_with_padding(mpu, reference_checkpoint, tmp_path):
    from mcore_zoo.cli import main

    ckpt = reference_checkpoint("LlamaForCausalLM")
    assert main(["-q", "convert", "--hf", str(ckpt), "--out", str(tmp_path / "m"), "--make-vocab-size-divisible-by", "100"]) == 0
    assert json.loads((tmp_path / "m" / "mcore_zoo.json").read_text())["make_vocab_size_divisible_by"] == 100
    assert main(["-q", "convert", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "h" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_token_ids_past_the_hf_vocabulary_are_refused(mpu, reference_checkpoint):
    """Ids in the padding rows (>= the HF vocab_size, < the padded size) and out-of-range ids are
    refused by packed_forward and train_step, naming the sequence and the position; so are a
    pad_token_id out of range and sequences of the wrong kind."""
    from mcore_zoo.errors import InputError

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32,
                                  make_vocab_size_divisible_by=128)  # fmt: skip
    vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
    good = torch.arange(5)
    loss = lambda t: (-(t.logprobs * t.mask).sum(), {})  # noqa: E731
    for bad, where in ((torch.tensor([1, 2, vocab]), "sequences[1][2]"), (torch.tensor([3, -1]), "sequences[1][1]")):
        with pytest.raises(InputError, match=re.escape(where)):
            mcore_zoo.packed_forward(model, [good, bad])
        with pytest.raises(InputError, match=re.escape(where)):
            mcore_zoo.train_step(model, [good, bad], loss)
    with pytest.raises(InputError, match="pad_token_id"):
        mcore_zoo.packed_forward(model, [good], pad_token_id=vocab + 1)
    with pytest.raises(InputError, match="integers"):
        mcore_zoo.packed_forward(model, [good.float()])
    with pytest.raises(InputError, match="list of 1-D token tensors"):
        mcore_zoo.train_step(model, "hello", loss)
