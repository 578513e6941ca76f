"""One PPO / GRPO-style update with mcore-zoo: an actor, a frozen reference and a critic.

Runs on a CPU in seconds: a tiny random Llama is written to a temporary directory as an HF
checkpoint, then

1. the actor (LM head), the reference (the same weights, never trained) and the critic (the same
   decoder with a value head, initialised to zeros because a causal-LM checkpoint has none) are
   built and loaded with ``mcore_zoo.build_model``;
2. "rollouts": random prompts and responses (a real trainer samples them from vLLM / SGLang) and a
   reward per sequence; old log-probs, reference log-probs and old values come from
   ``mcore_zoo.packed_forward`` (no gradients, no logits kept);
3. one actor update through ``mcore_zoo.train_step`` with :func:`ppo_actor_loss` (clipped ratio of
   new vs old log-probs, entropy bonus, a KL penalty to the reference) and one critic update with
   :func:`value_loss` (clipped value loss);
4. the weight sync a rollout engine would receive (``mcore_zoo.iter_hf_weights``).

    python examples/rl_step.py

The two loss functions follow ``train_step``'s contract: they return a *sum* over the tokens they
are given and ``train_step`` divides by ``loss_normalizer`` (here: the number of response tokens),
so the update is the same whatever the micro-batching and the parallel layout
(``tests/distributed/test_training.py`` checks exactly these functions under TP, PP, VPP and CP).
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable

import torch

import mcore_zoo


def ppo_actor_loss(clip: float = 0.2, entropy_coef: float = 0.01, kl_coef: float = 0.05) -> Callable[..., Any]:
    """PPO / GRPO actor loss on ``TokenOutputs`` with ``token_data`` keys ``old_logprobs``,
    ``advantages`` (per sequence or per token), ``loss_mask`` (1 on response tokens, per next-token
    prediction) and, when ``kl_coef``, ``ref_logprobs``; a sum over the masked tokens."""

    def loss_fn(t: Any) -> tuple[torch.Tensor, dict]:
        mask = t.mask & (t.data["loss_mask"] > 0)
        ratio = torch.exp(torch.where(mask, t.logprobs - t.data["old_logprobs"], 0.0))
        adv = t.data["advantages"]
        surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        per_token = surrogate
        if t.entropy is not None and entropy_coef:
            per_token = per_token - entropy_coef * t.entropy
        if kl_coef and "ref_logprobs" in t.data:
            log_ratio = t.data["ref_logprobs"] - t.logprobs  # k3 estimator of KL(new || ref)
            per_token = per_token + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
        loss = torch.where(mask, per_token, 0.0).sum()
        clipped = torch.where(mask, ((ratio - 1).abs() > clip).float(), 0.0).sum()
        return loss, {"clipped_tokens": clipped, "tokens": mask.float().sum()}

    return loss_fn


def value_loss(clip: float = 0.2) -> Callable[..., Any]:
    """Clipped value loss on ``TokenOutputs.values`` with ``token_data`` keys ``old_values``,
    ``returns`` and ``loss_mask``; a sum over the masked tokens."""

    def loss_fn(t: Any) -> tuple[torch.Tensor, dict]:
        mask = t.mask & (t.data["loss_mask"] > 0)
        old, ret = t.data["old_values"], t.data["returns"]
        clipped = old + (t.values - old).clamp(-clip, clip)
        per_token = 0.5 * torch.maximum((t.values - ret) ** 2, (clipped - ret) ** 2)
        return torch.where(mask, per_token, 0.0).sum(), {"tokens": mask.float().sum()}

    return loss_fn


def rollout_batch(vocab: int, prompts: int = 2, group: int = 3, seed: int = 0) -> dict[str, Any]:
    """Random prompt + response token sequences (``group`` responses per prompt), a reward per
    sequence and GRPO advantages (rewards normalised within each prompt's group)."""
    gen = torch.Generator().manual_seed(seed)
    sequences, loss_mask, rewards = [], [], []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen)
        for _ in range(group):
            response = torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
            seq = torch.cat([prompt, response])
            sequences.append(seq)
            mask = torch.zeros(seq.numel() - 1)
            mask[prompt.numel() - 1 :] = 1.0  # predictions of response tokens
            loss_mask.append(mask)
            rewards.append(float(torch.rand((), generator=gen)))
    r = torch.tensor(rewards).view(prompts, group)
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
    return {"sequences": sequences, "loss_mask": loss_mask, "rewards": rewards, "advantages": list(advantages)}


def write_tiny_llama(out_dir: str, num_layers: int = 2) -> str:
    """A tiny random Llama HF checkpoint (transformers' own ``save_pretrained``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = mcore_zoo.lookup("LlamaForCausalLM").example_config()
    config.update(num_hidden_layers=num_layers)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    hf.save_pretrained(out_dir)
    return out_dir


def main() -> dict[str, float]:
    mcore_zoo.ensure_model_parallel(mcore_zoo.Parallelism())  # one process; under torchrun pass the layout
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_llama(tmp)
        actor = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt)
        reference = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt).eval()
        critic = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, head="value", value_head_init="zeros")
    vocab = mcore_zoo.handle_of(actor).arch_config.vocab_size
    batch = rollout_batch(vocab)
    seqs = batch["sequences"]

    with torch.no_grad():  # the rollout's numbers, as a trainer recomputes them
        old_logprobs = mcore_zoo.packed_forward(actor, seqs, return_logits=False).logprobs
        ref_logprobs = mcore_zoo.packed_forward(reference, seqs, return_logits=False).logprobs
        old_values = mcore_zoo.packed_forward(critic, seqs).values
    returns = [torch.full((s.numel(),), r) for s, r in zip(seqs, batch["rewards"])]
    tokens = float(sum(m.sum() for m in batch["loss_mask"]))

    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    actor_opt.zero_grad(set_to_none=True)
    actor_step = mcore_zoo.train_step(
        actor, seqs, ppo_actor_loss(),
        token_data={"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
                    "advantages": batch["advantages"], "loss_mask": batch["loss_mask"]},
        loss_normalizer=tokens, compute_entropy=True, max_tokens_per_microbatch=32,
    )  # fmt: skip
    actor_opt.step()

    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    critic_opt.zero_grad(set_to_none=True)
    critic_step = mcore_zoo.train_step(
        critic, seqs, value_loss(),
        token_data={"old_values": old_values, "returns": returns, "loss_mask": batch["loss_mask"]},
        loss_normalizer=tokens, max_tokens_per_microbatch=32,
    )  # fmt: skip
    critic_opt.step()

    with torch.no_grad():
        new_logprobs = mcore_zoo.packed_forward(actor, seqs, return_logits=False).logprobs
    moved = max((a - b).abs().max().item() for a, b in zip(new_logprobs, old_logprobs))
    synced = sum(t.numel() for _, t in mcore_zoo.iter_hf_weights(actor))  # what a rollout engine receives
    summary = {
        "actor_loss": actor_step.loss.item(),
        "clipped_tokens": actor_step.metrics["clipped_tokens"].item(),
        "critic_loss": critic_step.loss.item(),
        "microbatches": actor_step.num_microbatches,
        "max_logprob_change": moved,
        "synced_parameters": synced,
    }
    for key, value in summary.items():
        print(f"{key:>20}: {value:.6g}" if isinstance(value, float) else f"{key:>20}: {value}")
    return summary


if __name__ == "__main__":
    main()
