"""An actor, a reference and a critic at three parallel layouts in one job: one PPO step.

Four ranks (``torchrun --nproc-per-node 4 examples/rl_layouts.py``; without ``torchrun`` the
script starts four CPU processes on gloo itself and runs in about a minute):

* the actor at TP2 x PP2 - the first model built, so its layout becomes the job's parallel state;
* the reference at TP1 x DP4 and the critic (value head) at PP2 x DP2, each on process groups of
  its own (``mcore_zoo.model_groups``): nothing in the actor's parallel state changes;
* the actor and the critic wrapped for training with Megatron-Core's DDP and distributed
  optimizer on their own groups (``mcore_zoo.wrap_for_training``);
* the rollout's numbers (old log-probs, reference log-probs, values) from ``packed_forward``;
  the reference offloaded to host memory during the update (``mcore_zoo.offload``);
* one PPO update of the actor and of the critic (``train_step`` + ``optimizer.step()``, clipped);
* the actor's new weights copied into the reference at its other layout (``mcore_zoo.copy_weights``,
  as for an old-policy copy) and sent to rank 0 for a rollout engine at TP 2, pre-split per engine
  rank (``mcore_zoo.iter_hf_shards``; ``mcore_zoo.refit`` does the same into a vLLM / SGLang adapter).

The losses are ``examples/rl_step.py``'s (a sum over the tokens, divided by ``loss_normalizer``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import mcore_zoo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step import ppo_actor_loss, rollout_batch, value_loss, write_tiny_llama  # noqa: E402

ACTOR, REFERENCE, CRITIC = mcore_zoo.Parallelism(tp=2, pp=2), mcore_zoo.Parallelism(), mcore_zoo.Parallelism(pp=2)


def optimizer_config() -> Any:
    from megatron.core.optimizer import OptimizerConfig

    bf16 = torch.cuda.is_available()
    return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=True,
                           bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)  # fmt: skip


def ppo_step(ckpt: str) -> dict[str, Any]:
    """One PPO step on this rank (every rank of the job runs it)."""
    build = {"backend": "portable", "numerics": "hf-exact"}
    actor = mcore_zoo.build_model(ckpt, parallel=ACTOR, load=ckpt, **build)
    reference = mcore_zoo.build_model(ckpt, parallel=REFERENCE, load=ckpt, **build).eval()
    critic = mcore_zoo.build_model(ckpt, parallel=CRITIC, load=ckpt, head="value", value_head_init="zeros", **build)
    actor_train = mcore_zoo.wrap_for_training(actor, optimizer_config())
    critic_train = mcore_zoo.wrap_for_training(critic, optimizer_config())

    batch = rollout_batch(mcore_zoo.handle_of(actor).arch_config.vocab_size)  # the same on every rank
    seqs = batch["sequences"]
    with torch.no_grad():
        old_logprobs = mcore_zoo.packed_forward(actor_train.model, seqs, return_logits=False).logprobs
        ref_logprobs = mcore_zoo.packed_forward(reference, seqs, return_logits=False).logprobs
        old_values = mcore_zoo.packed_forward(critic_train.model, seqs).values
    returns = [torch.full((s.numel(),), r) for s, r in zip(seqs, batch["rewards"])]
    tokens = float(sum(m.sum() for m in batch["loss_mask"]))

    parked = mcore_zoo.offload(reference)  # not needed during the update
    actor_train.zero_grad()
    actor_step = mcore_zoo.train_step(
        actor_train.model, seqs, ppo_actor_loss(),
        token_data={"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
                    "advantages": batch["advantages"], "loss_mask": batch["loss_mask"]},
        loss_normalizer=tokens, compute_entropy=True, max_tokens_per_microbatch=32,
    )  # fmt: skip
    _, actor_norm, _ = actor_train.optimizer.step()
    critic_train.zero_grad()
    critic_step = mcore_zoo.train_step(
        critic_train.model, seqs, value_loss(),
        token_data={"old_values": old_values, "returns": returns, "loss_mask": batch["loss_mask"]},
        loss_normalizer=tokens, max_tokens_per_microbatch=32,
    )  # fmt: skip
    _, critic_norm, _ = critic_train.optimizer.step()
    parked.restore()

    copied = mcore_zoo.copy_weights(actor_train.model, reference, bucket_size="1MB")
    with torch.no_grad():
        new_logprobs = mcore_zoo.packed_forward(actor_train.model, seqs, return_logits=False).logprobs
        copy_logprobs = mcore_zoo.packed_forward(reference, seqs, return_logits=False).logprobs
    # the rollout engine's side (vLLM / SGLang at TP 2 on rank 0): each tensor pre-split for its two ranks
    engine = dict(mcore_zoo.iter_hf_shards(actor_train.model, target_tp=2, ranks=[0], bucket_size="1MB"))
    return {
        "actor_loss": actor_step.loss.item(),
        "actor_grad_norm": actor_norm,
        "critic_loss": critic_step.loss.item(),
        "critic_grad_norm": critic_norm,
        "max_logprob_change": max((a - b).abs().max().item() for a, b in zip(new_logprobs, old_logprobs)),
        "reference_vs_actor": max((a - b).abs().max().item() for a, b in zip(copy_logprobs, new_logprobs)),
        "copied_mb": copied.bytes_received / 1e6,
        "copy_seconds": copied.seconds,
        "offloaded_mb": parked.nbytes / 1e6,
        "synced_tensors": len(engine) if mcore_zoo.handle_of(actor).placement.rank == 0 else 0,
    }


def _run(ckpt: str) -> dict[str, Any]:
    """``ppo_step`` under the launcher (one process per rank, gloo on a CPU)."""
    return ppo_step(ckpt)


def main() -> dict[str, Any]:
    if "RANK" in os.environ:  # under torchrun: this process is one rank (the first build joins the job)
        ckpt = os.environ.get("CHECKPOINT") or sys.exit("set CHECKPOINT to an HF checkpoint directory")
        summary = ppo_step(ckpt)
        rank = int(os.environ["RANK"])
    else:  # four processes of our own, gloo on a CPU
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_tiny_llama(tmp, num_layers=4)
            summary = mcore_zoo.launch(_run, 4, ckpt)[0]
        rank = 0
    if rank == 0:
        for key, value in summary.items():
            print(f"{key:>20}: {value:.6g}" if isinstance(value, float) else f"{key:>20}: {value}")
    return summary


if __name__ == "__main__":
    main()
