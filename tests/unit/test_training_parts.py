"""The training step and the value head in one process: micro-batch partitioning, gradients
against the naive full-logits formula, accumulation, the value head against transformers'
token classifier (load, values, export round trip), fail-closed loading of a head-less checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

import mcore_zoo
from mcore_zoo.distributed.forward import partition_by_tokens
from mcore_zoo.errors import MissingTensorsError, ZooError
from mcore_zoo.testing.common import load_safetensors_dir

from ..conftest import random_sequences

LENGTHS = [7, 12, 5, 9, 3]


def test_partition_by_tokens_keeps_the_budget_and_balances():
    lengths = [40, 9, 23, 5, 17, 12, 30, 2]
    groups = partition_by_tokens(lengths, max_tokens=48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) <= 48 and len(groups) <= -(-sum(lengths) // 48) + 1  # greedy, not optimal
    assert max(loads) - min(loads) <= max(lengths)
    assert len(partition_by_tokens(lengths, count=3, multiple_of=2)) == 4
    assert partition_by_tokens([100, 3], max_tokens=10) == [[0], [1]]  # a long sequence alone
    assert len(partition_by_tokens([5, 5], count=4)) == 2  # never more groups than sequences


def _naive_loss(model, seqs, temperature, coef):
    out = mcore_zoo.packed_forward(model, seqs)
    total = 0.0
    for logits, s in zip(out.logits, seqs):
        logp = torch.log_softmax(logits[:-1].float() / temperature, -1)
        picked = logp.gather(-1, s[1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        total = total - picked.sum() - coef * entropy.sum()
    return total


def test_train_step_gradients_equal_the_naive_formula_and_accumulate(mpu):
    from mcore_zoo.testing.common import case_config

    config = case_config("LlamaForCausalLM", {"num_hidden_layers": 2})
    model = mcore_zoo.build_model(config, backend="portable", numerics="hf-exact")
    seqs = random_sequences(LENGTHS, config["vocab_size"])

    def loss_fn(t):
        per_token = -t.logprobs - 0.1 * t.entropy
        return torch.where(t.mask, per_token, 0.0).sum(), {"tokens": t.mask.sum()}

    result = mcore_zoo.train_step(model, seqs, loss_fn, temperature=0.7, compute_entropy=True,
                                  loss_normalizer=4.0, max_tokens_per_microbatch=14, chunk_tokens=5)  # fmt: skip
    assert result.num_microbatches == 3
    assert result.metrics["tokens"].item() == sum(n - 1 for n in LENGTHS)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want_loss = _naive_loss(model, seqs, 0.7, 0.1) / 4.0
    want_loss.backward()
    assert abs(result.loss.item() - want_loss.item()) <= 1e-5
    for name, p in model.named_parameters():
        assert (got[name] - p.grad).abs().max() <= 1e-5, name
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    mcore_zoo.train_step(model, seqs, loss_fn, temperature=0.7, compute_entropy=True, loss_normalizer=4.0)
    for name, p in model.named_parameters():  # gradients accumulate like loss.backward()
        assert (p.grad - before[name] - got[name]).abs().max() <= 1e-5, name


def test_packed_forward_log_probs_at_a_temperature(mpu):
    from mcore_zoo.testing.common import case_config

    config = case_config("LlamaForCausalLM", {"num_hidden_layers": 1})
    model = mcore_zoo.build_model(config, backend="portable")
    seqs = random_sequences(LENGTHS, config["vocab_size"])
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, seqs, temperature=0.6)
        cheap = mcore_zoo.packed_forward(model, seqs, temperature=0.6, return_logits=False).logprobs
    for logits, s, lp, lp2 in zip(out.logits, seqs, out.logprobs, cheap):
        want = torch.log_softmax(logits[:-1].float() / 0.6, -1).gather(-1, s[1:, None]).squeeze(-1)
        assert torch.equal(lp, want) and (lp2 - want).abs().max() <= 1e-5


def test_train_step_refuses_malformed_token_data_and_losses(mpu):
    from mcore_zoo.testing.common import case_config

    config = case_config("LlamaForCausalLM", {"num_hidden_layers": 1})
    model = mcore_zoo.build_model(config, backend="portable")
    seqs = random_sequences([6, 4], config["vocab_size"])
    loss_fn = lambda t: ((t.logprobs * t.data["w"]).sum(), {})  # noqa: E731
    with pytest.raises(ZooError, match=r"token_data\['w'\]\[1\] has 7 entries"):
        mcore_zoo.train_step(model, seqs, loss_fn, token_data={"w": [torch.ones(5), torch.ones(7)]})
    with pytest.raises(ZooError, match="scalar tensor"):
        mcore_zoo.train_step(model, seqs, lambda t: (t.logprobs, {}))


# ---------------------------------------------------------------------------- value head
@pytest.fixture(scope="module")
def critic_checkpoint(tmp_path_factory):
    """transformers' LlamaForTokenClassification (one label) saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    from mcore_zoo.testing.common import case_config

    config = case_config("LlamaForCausalLM", {"num_hidden_layers": 2})
    config.pop("architectures")
    torch.manual_seed(0)
    hf = LlamaForTokenClassification(LlamaConfig(**config, num_labels=1))
    with torch.no_grad():
        hf.score.bias.fill_(0.3)
    out = tmp_path_factory.mktemp("critic")
    hf.save_pretrained(out)
    return out


def test_value_head_matches_transformers_and_exports_bitwise(critic_checkpoint, mpu, tmp_path):
    from transformers import AutoModelForTokenClassification

    from mcore_zoo.parity.reference import own_aligned_storage

    critic = mcore_zoo.build_model(critic_checkpoint, backend="portable", numerics="hf-exact", head="value")
    report = mcore_zoo.load_hf_weights(critic, critic_checkpoint)
    assert report.absent == {}
    hf = own_aligned_storage(AutoModelForTokenClassification.from_pretrained(critic_checkpoint)).eval()
    seqs = random_sequences(LENGTHS, 256)
    with torch.no_grad():
        values = mcore_zoo.packed_forward(critic, seqs).values
        for v, s in zip(values, seqs):
            assert (v - hf(s[None]).logits[0, :, 0]).abs().max() <= 1e-5
    source = load_safetensors_dir(critic_checkpoint)
    exported = dict(mcore_zoo.iter_hf_weights(critic))
    assert set(exported) == set(source) and all(torch.equal(exported[k], source[k]) for k in source)
    mcore_zoo.save_hf_checkpoint(critic, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForTokenClassification"] and len(saved["id2label"]) == 1
    # both transformers models in allocator-aligned storage (own_aligned_storage: CPU GEMMs may round by alignment)
    again = own_aligned_storage(AutoModelForTokenClassification.from_pretrained(tmp_path / "out")).eval()
    with torch.no_grad():
        assert torch.equal(again(seqs[0][None]).logits, hf(seqs[0][None]).logits)


def test_value_head_from_a_causal_lm_checkpoint_needs_an_explicit_init(reference_checkpoint, mpu):
    ckpt = reference_checkpoint("LlamaForCausalLM", {"num_hidden_layers": 2})
    with pytest.raises(MissingTensorsError, match="score.weight"):
        mcore_zoo.build_model(ckpt, backend="portable", head="value", load=ckpt)
    critic = mcore_zoo.build_model(ckpt, backend="portable", head="value", value_head_init="zeros")
    report = mcore_zoo.load_hf_weights(critic, ckpt)
    assert report.ignored["lm_head.weight"] == "value head: the LM head is not used"
    assert set(report.absent) == {"score.weight", "score.bias"}
    assert torch.count_nonzero(critic.output_layer.weight) == 0
    with pytest.raises(ZooError, match="value_head_init"):
        mcore_zoo.build_model(ckpt, backend="portable", value_head_init="zeros")


def test_the_training_profile_keeps_the_backend_gemms():
    """``training`` = ``default`` with HF-order norms, RoPE, SwiGLU, biases and HF's sdpa attention
    calls (docs/numerics.md: the GPU distance and speed that chose these knobs)."""
    from mcore_zoo.numerics.profiles import get_profile

    default, training = get_profile("default").knobs(), get_profile("training").knobs()
    changed = {k: v for k, v in training.items() if default[k] != v}
    assert changed == {"norm": "hf", "fuse_norm_into_linear": False, "rope_fusion": False,
                       "bias_activation_fusion": False, "attention": "sdpa", "linear_bias": "fused",
                       "linear_attention_pack": "each", "linear_attention_kernel": "torch"}  # fmt: skip
