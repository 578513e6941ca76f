"""The training step: the packed forward with gradients under every layout, a trainer's loss inside
Megatron-Core's schedule.

:func:`train_step` runs one forward + backward over a batch of variable-length sequences on this
rank's chunks, under any TP (+SP) / PP / VPP / CP layout, and leaves the gradients where the model
keeps them (``param.grad``; ``param.main_grad`` for a model wrapped in Megatron-Core's
``DistributedDataParallel``). It shares the forward's pieces (:mod:`.forward`): THD packs with the
layout's alignment, this context-parallel rank's zigzag share, Megatron-Core's own schedule
(``get_forward_backward_func()``, here with ``forward_only=False``; also at PP = 1, so a wrapped
model's ``no_sync`` and ``finalize_model_grads_func`` work as in Megatron's training loop).

The loss
--------
``loss_fn(tokens: TokenOutputs) -> (loss, metrics)`` is called on the last pipeline stage, once per
micro-batch, inside the schedule's loss function. ``tokens`` holds, for the tokens this rank
computes (its CP share of the micro-batch's pack), fp32 per-token log-probabilities of the next
token and entropy from the vocab-parallel head
(:func:`~mcore_zoo.distributed.vocab_parallel.token_logprobs_and_entropy`: chunked, no
``[T, V]`` fp32 logits) - or values, for a model built with ``head="value"`` - plus where each
token belongs (sequence, position, masks) and the trainer's own per-token data (``token_data``:
old log-probs, advantages, returns, ...), laid out the same way.

Normalisation contract: ``loss`` must be a **sum over the tokens it is given** (additive: the
same tokens split differently into micro-batches or CP shares give the same total). The step
computes the gradient of

    J = (sum over micro-batches and CP shares of loss) / loss_normalizer

on this model replica, whatever the micro-batching and the layout. A token-mean loss over the
batch passes ``loss_normalizer=`` the number of loss tokens; a loss averaged over the global batch
of several data-parallel replicas passes the global count (see below for how replicas combine).
``metrics`` (scalar tensors) are summed the same way (over micro-batches and CP ranks, not
normalised) and returned on every rank.

How the scaling is done: Megatron-Core's schedule multiplies a ``(loss, data)`` loss function's
value by ``cp / num_microbatches`` (its convention for a per-micro-batch mean whose gradients a
DDP wrapper then *averages* over the data-parallel x context-parallel group), and scales the MoE
auxiliary losses (load balancing, z-loss: each CP / TP rank's part of the micro-batch's loss) by
the same ``cp / num_microbatches`` through ``MoEAuxLossAutoScaler``. The step returns
``loss * num_microbatches / loss_normalizer`` to it, so every rank's part of ``J`` (the trainer's
loss and the aux losses alike) reaches the gradients multiplied by ``cp``, which the reduction
below takes out:

* **unwrapped model** (``build_model``'s chunks, no DDP): after the schedule the step averages the
  gradients over the CP group (the sum of the CP ranks' parts; the aux losses' included) and
  does what Megatron's ``finalize_model_grads`` does without DDP -
  sequence-parallel and Q/K-norm weights summed over TP, tied embedding copies summed over the
  first and last pipeline stage. ``param.grad`` is then ``dJ/dparam`` on every rank (its own
  shard). Data-parallel replicas are not combined (each keeps the gradient of its own ``J``),
  except on expert weights under expert parallelism: the replicas of an expert-parallel group
  share those, and their gradient is the mean over the replicas of each one's ``dJ/dparam`` (what
  the DDP wrapper gives; equal to ``dJ/dparam`` when every replica passes the same batch).
  Gradients accumulate: whatever ``.grad`` held before the step is kept and added to (a step
  that raises leaves them as they were before it).
* **DDP-wrapped model** (a trainer's ``get_model`` chunks): the wrapper reduces over data x
  context parallel and, by default, divides by that group's size; with the factor above the
  result is the mean over data-parallel replicas of each replica's ``dJ/dparam`` (CP shares
  summed). Set ``config.finalize_model_grads_func`` / ``no_sync_func`` as Megatron's training loop
  does; the schedule calls them. ``calculate_per_token_loss`` is refused (use
  ``loss_normalizer``).

Micro-batches: sequences are grouped by a token budget (``max_tokens_per_microbatch``, counted in
padded tokens), balanced (longest first into the lightest group), and - with data parallelism and
``sync_microbatches`` - every replica runs the same number of micro-batches (the largest any
needs). Default without a budget: one micro-batch, ``pp`` under pipeline parallelism.

MoE routing replay: ``replay_routes=`` gives the experts of every token per sequence (a rollout
engine's, or a single-process record split per sequence); the step lays them out for this rank's
routers - per micro-batch in schedule order, its CP share, its sequence-parallel slice, its
stage's layers (:func:`~mcore_zoo.routing.microbatch_routes`) - replays them, and raises if any is
left unused (:func:`mcore_zoo.routing.replay`).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import ZooError
from ..families.vision_language.spec import vision_inputs_for
from ..handle import ModelHandle, handle_of
from ..packing import alignment_for
from ..placement import group_size
from .forward import Microbatch, _gather_vocab, _sequences, check_batching, check_moe_training_layout, build_microbatches, run_schedule, two_way_pipeline, uses_vllm_logprob_head
from .microbatches import plan_microbatches
from .vocab_parallel import token_logprobs_and_entropy


@dataclass
class TokenOutputs:
    """One micro-batch's tokens on this rank, as ``loss_fn`` receives them (every tensor ``[n]``,
    ``n`` = this CP rank's share of the packed micro-batch, padding included).

    Attributes:
        logprobs: fp32 ``log softmax(logits / temperature)[next token]``, differentiable; 0 where
            ``mask`` is False. ``None`` for a value-head model.
        entropy: fp32 entropy of ``softmax(logits / temperature)`` at every position (padding
            too: mask it), differentiable; ``None`` unless ``compute_entropy=True``.
        values: fp32 value-head output at every position, differentiable (``head="value"``).
        mask: the position has a next token in its sequence (``j < len - 1``): where ``logprobs``
            are defined and where ``token_data`` of length ``len - 1`` lives.
        real: the position holds a real token (``j < len``); padding is False.
        sequence: index of the position's sequence in the caller's list (-1 for padding).
        position: position ``j`` within its sequence.
        targets: the next token (-1 where ``mask`` is False).
        data: the trainer's ``token_data`` at these positions.
        microbatch: index of the micro-batch.
        mtp_logprobs: a model built with multi-token prediction: per depth ``d + 1``, fp32
            ``log softmax(mtp logits)[token j + d + 2]`` at every position (temperature 1),
            differentiable; 0 where ``mtp_targets[d]`` is -1. Empty without MTP.
        mtp_targets: per depth, the token it predicts at each position (-1 where there is none).
    """

    logprobs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    mask: torch.Tensor
    real: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    targets: torch.Tensor
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    microbatch: int = 0
    mtp_logprobs: list[torch.Tensor] = field(default_factory=list)
    mtp_targets: list[torch.Tensor] = field(default_factory=list)

    def mtp_loss(self) -> torch.Tensor:
        """The MTP cross-entropy summed over these tokens and averaged over the depths:
        ``-(1 / D) * sum_d sum_j mtp_logprobs[d][j]`` (fp32 scalar; 0 without MTP)."""
        if not self.mtp_logprobs:
            return self.mask.new_zeros((), dtype=torch.float32)
        return -torch.stack([lp.sum() for lp in self.mtp_logprobs]).sum() / len(self.mtp_logprobs)


@dataclass
class StepResult:
    """What :func:`train_step` reports on every rank: ``loss`` (fp32 scalar, the objective ``J``
    whose gradient was taken), ``metrics`` (``loss_fn``'s metrics summed over micro-batches and CP
    ranks) and the number of micro-batches run (padding micro-batches included)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    num_microbatches: int


LossFn = Callable[[TokenOutputs], tuple[torch.Tensor, Mapping[str, Any]]]


# ---------------------------------------------------------------------------- per-token data
def check_token_data(token_data: Any, seqs: Sequence[torch.Tensor]) -> None:
    """``token_data`` fits ``seqs``: a mapping of names to one value per sequence, each a number or
    a 0-d tensor (broadcast), or a numeric 1-D tensor / list of ``len - 1`` or ``len`` entries.
    Raises :class:`~mcore_zoo.errors.InputError` naming the entry."""
    from ..errors import InputError

    if token_data is None:
        return
    if not isinstance(token_data, Mapping):
        raise InputError(f"token_data must be a dict {{name: per-sequence values}}, got {type(token_data).__name__}")
    for key, per_seq in token_data.items():
        if isinstance(per_seq, (str, bytes)) or not isinstance(per_seq, (Sequence, torch.Tensor)):
            raise InputError(f"token_data[{key!r}] must hold one value per sequence (a list), got {type(per_seq).__name__}")
        if len(per_seq) != len(seqs):
            raise InputError(f"token_data[{key!r}] has {len(per_seq)} values for {len(seqs)} sequences")
        for i, value in enumerate(per_seq):
            if isinstance(value, bool) or not isinstance(value, (numbers.Number, torch.Tensor, Sequence)) or isinstance(value, (str, bytes)):
                raise InputError(f"token_data[{key!r}][{i}] is a {type(value).__name__}; give a number or a tensor")
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InputError(f"token_data[{key!r}][{i}] is not numeric ({exc})") from None
            n = int(seqs[i].numel())
            if tensor.dim() > 0 and tensor.numel() not in (n, n - 1):
                raise InputError(f"token_data[{key!r}][{i}] has {tensor.numel()} entries; the sequence has {n} tokens"
                                 f" (give {n - 1} per next-token prediction, {n} per token, or a scalar)")  # fmt: skip


def _pack_token_data(token_data: Mapping[str, Sequence[Any]], mb: Microbatch, device: torch.device) -> dict[str, torch.Tensor]:
    """Lay each sequence's data out like the pack (entry ``j`` at the sequence's position ``j``),
    then keep this rank's share. Per sequence: a tensor of ``len - 1`` (per next-token
    prediction, like log-probs) or ``len`` entries (per token), or a scalar (broadcast); checked
    by :func:`check_token_data` before the step."""
    out = {}
    starts = mb.batch.cu_seqlens_padded.tolist()
    for key, per_seq in token_data.items():
        first = per_seq[mb.members[0]] if mb.members else 0.0
        dtype = torch.as_tensor(first).dtype
        dtype = torch.float32 if dtype == torch.float64 else dtype
        packed = torch.zeros(mb.batch.total, dtype=dtype, device=device)
        for k, member in enumerate(mb.members):
            value = per_seq[member]
            n = mb.batch.lengths[k]
            if isinstance(value, numbers.Number) or torch.as_tensor(value).dim() == 0:
                packed[starts[k] : starts[k] + n] = torch.as_tensor(value, dtype=dtype)
                continue
            value = torch.as_tensor(value).reshape(-1)  # n or n - 1 entries (check_token_data)
            packed[starts[k] : starts[k] + value.numel()] = value.to(device=device, dtype=dtype)
        out[key] = mb.local(packed)
    return out


def _token_layout(mb: Microbatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence index, real-token mask)`` of this rank's positions."""
    seq = torch.full((mb.batch.total,), -1, dtype=torch.long)
    for k, (start, n) in enumerate(zip(mb.batch.cu_seqlens_padded.tolist(), mb.batch.lengths)):
        seq[start : start + n] = mb.members[k] if k < len(mb.members) else -1
    seq = mb.local(seq).to(device)
    return seq, seq >= 0


def token_outputs(handle: ModelHandle, mb: Microbatch, output: torch.Tensor, *, temperature: float = 1.0,
                  compute_entropy: bool = False, chunk_tokens: Optional[int] = None,
                  token_data: Optional[Mapping[str, Sequence[Any]]] = None, index: int = 0) -> TokenOutputs:  # fmt: skip
    """The last stage's model output for ``mb`` (``[1, n, V / tp]`` logits or ``[1, n, 1]`` values;
    with MTP, the depths' logits after them) -> :class:`TokenOutputs` (log-probs / entropy through
    the vocab-parallel head)."""
    from ..families.mtp.spec import split_mtp_output

    layout = handle.placement
    output, parts = split_mtp_output(output, handle.arch_config.mtp_num_layers)
    local = output[0]
    device = local.device
    targets = mb.labels[0].to(device)
    sequence, real = _token_layout(mb, device)
    logprobs = entropy = values = None
    if getattr(handle.options, "head", "lm") == "value":
        values = local[:, 0].float()
    else:
        runner = uses_vllm_logprob_head(handle)
        if runner:  # vllm-exact: vLLM's log-prob kernel on the gathered logits
            from ..kernels import vllm_ops

            logprobs, entropy = vllm_ops.token_logprobs_and_entropy(_gather_vocab(local, layout), targets,
                                                                    temperature=temperature,
                                                                    compute_entropy=compute_entropy,
                                                                    runner=runner)  # fmt: skip
        else:
            logprobs, entropy = token_logprobs_and_entropy(
                local, targets, tp_group=layout.groups.tp if layout.tp > 1 else None, temperature=temperature,
                chunk_tokens=chunk_tokens, compute_entropy=compute_entropy, inplace_backward=not parts,
            )  # fmt: skip
    data = _pack_token_data(token_data, mb, device) if token_data else {}
    mtp_targets = [mb.mtp_labels(d + 1).to(device) for d in range(len(parts))]
    # not in place: the depths' logits are views of one output tensor
    mtp_logprobs = [
        token_logprobs_and_entropy(part[0], t, tp_group=layout.groups.tp if layout.tp > 1 else None,
                                   chunk_tokens=chunk_tokens, compute_entropy=False, inplace_backward=False)[0]
        for part, t in zip(parts, mtp_targets)
    ]  # fmt: skip
    return TokenOutputs(logprobs, entropy, values, targets >= 0, real, sequence, mb.position_ids[0].to(device),
                        targets, data, index, mtp_logprobs, mtp_targets)  # fmt: skip


# ---------------------------------------------------------------------------- gradients
def _all_reduce_flat(grads: list[torch.Tensor], group: Any) -> None:
    if not grads:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _finalize_unwrapped(handle: ModelHandle) -> None:
    """What Megatron's ``finalize_model_grads`` does for a model without a DDP wrapper, on
    ``param.grad``: CP shares averaged (each carries the schedule's factor ``cp``, so this is
    their sum without it); sequence-parallel and Q/K-norm weights summed over TP (each TP
    rank saw a part of the tokens / heads); tied embedding copies (the output layer's, the MTP
    block's on the last stage) summed over the embedding group; expert weights averaged over the
    data-parallel replicas (:func:`_finalize_experts`)."""
    layout = handle.placement
    config = handle.transformer_config
    chunks = handle.chunks
    named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    experts = [p.grad for _, p in named if not getattr(p, "allreduce", True)]  # Megatron-Core's mark
    named = [(n, p) for n, p in named if getattr(p, "allreduce", True)]
    _finalize_experts(experts, layout)
    if layout.cp > 1:  # each CP rank's part carries the schedule's factor cp: their mean is their sum
        grads = [p.grad for _, p in named]
        _all_reduce_flat(grads, layout.groups.cp)
        for g in grads:
            g.div_(layout.cp)
    if layout.tp > 1:
        # Q/K norms over heads see this rank's heads only: summed. MLA's latent norms see the whole
        # latent on every rank (same gradient everywhere); under sequence parallel they see part of
        # the tokens and carry the sequence_parallel mark instead
        per_head_qk_norm = config.qk_layernorm and not getattr(config, "multi_latent_attention", False)
        summed = [
            p.grad for n, p in named
            if (config.sequence_parallel and getattr(p, "sequence_parallel", False))
            or (per_head_qk_norm and ("q_layernorm" in n or "k_layernorm" in n))
        ]  # fmt: skip
        _all_reduce_flat(summed, layout.groups.tp)
        averaged = [p.grad for _, p in named if getattr(p, "average_gradients_across_tp_domain", False)]
        _all_reduce_flat(averaged, layout.groups.tp)
        for g in averaged:
            g.div_(layout.tp)
    group = layout.groups.embedding  # None on middle stages (they hold no embedding copy)
    if layout.pp > 1 and (layout.first_stage or layout.last_stage) and group is not None and group_size(group) > 1:
        chunk = chunks[0] if layout.first_stage else chunks[-1]
        # tied output layer, or the MTP block's copy of the embedding on the last stage
        if chunk.share_embeddings_and_output_weights or getattr(config, "mtp_num_layers", None):
            weight = chunk.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=group)


def _finalize_experts(grads: list[torch.Tensor], layout: Any) -> None:
    """Expert-weight gradients -> the mean over data-parallel replicas of each replica's ``dJ/dW``.

    Under expert parallelism the token dispatcher gathers the tokens of every rank of the
    expert-parallel group - ranks of several data-parallel replicas (and CP shares) - so an expert's
    gradient already sums the losses of those replicas: it cannot be "this replica's ``dJ/dW``"
    like a dense weight's. It is made what Megatron-Core's DDP wrapper gives: summed over the
    expert data-parallel group (the other ranks holding the same experts), then divided by the size
    of the data x context-parallel group (every contribution carries the schedule's factor ``cp``;
    ``dp`` replicas are averaged). With the same batch on every replica this equals the
    single-process gradient. Experts split over fewer tensor-parallel ranks than the dense layers
    (``etp < tp``: gpt-oss's experts with biases at ``etp=1``) see only their TP rank's share of
    the tokens (sequence parallelism): the expert data-parallel group holds those TP peers, and the
    sum over it adds the shares even with one replica."""
    if not grads:
        return
    dp_cp = layout.groups.dp_cp
    replicas = group_size(dp_cp) if dp_cp is not None else 1
    expert_dp = layout.groups.expert_dp
    if expert_dp is not None and group_size(expert_dp) > 1:
        _all_reduce_flat(grads, expert_dp)
    if replicas == 1:
        return
    scale = 1.0 / replicas  # 1 / (dp * cp)
    for g in grads:
        g.mul_(scale)


class _KeptGrads:
    """Gradients from before the step, set aside while the step's own are reduced (a sum over CP /
    TP / stages must see only this step's), then added back."""

    def __init__(self, handle: ModelHandle) -> None:
        self.params = [p for c in handle.chunks for p in c.parameters()]
        self.kept = []
        for p in self.params:
            if p.grad is not None:
                self.kept.append((p, p.grad))
                p.grad = None

    def restore(self) -> None:
        for p, g in self.kept:
            p.grad = g if p.grad is None else p.grad.add_(g)

    def revert(self) -> None:
        """A step that failed: drop what it accumulated, leave the gradients from before it."""
        for p in self.params:
            p.grad = None
        for p, g in self.kept:
            p.grad = g


# ---------------------------------------------------------------------------- the step
def _given_chunks(model: Any, handle: ModelHandle) -> list[Any]:
    if isinstance(model, ModelHandle):
        return handle.chunks
    return list(model) if isinstance(model, (list, tuple)) else [model]


def train_step(
    model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]],
    sequences: Union[Sequence[torch.Tensor], torch.Tensor],
    loss_fn: LossFn,
    *,
    token_data: Optional[Mapping[str, Sequence[Any]]] = None,
    loss_normalizer: float = 1.0,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    max_tokens_per_microbatch: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    sync_microbatches: bool = True,
    chunk_tokens: Optional[int] = None,
    pad_token_id: int = 0,
    mtp_loss_scale: Optional[float] = None,
    replay_routes: Optional[Sequence[torch.Tensor]] = None,
    vision_inputs: Optional[Sequence[Any]] = None,
) -> StepResult:
    """One forward + backward of ``loss_fn`` over ``sequences`` (see the module docstring).

    Args:
        model: this rank's chunks as the trainer holds them (one ``GPTModel``, possibly wrapped in
            DDP, or the list of virtual-pipeline chunks) or the model's handle.
        sequences: 1-D token tensors, the same on every rank of the model-parallel group.
        loss_fn: ``(TokenOutputs) -> (loss, metrics)``; ``loss`` a scalar sum over the tokens given,
            ``metrics`` a dict of scalars (summed over micro-batches and CP ranks).
        token_data: ``{name: per-sequence values}`` handed to ``loss_fn`` at the same positions as
            the tokens (``len - 1`` entries per sequence aligned with the log-probs, ``len`` per
            token, or a scalar per sequence).
        loss_normalizer: ``J`` is the summed loss divided by this (e.g. the number of loss tokens).
        temperature: the logits are divided by it before the log-softmax.
        compute_entropy: also compute the entropy (``TokenOutputs.entropy``).
        max_tokens_per_microbatch: token budget per micro-batch (padded tokens).
        num_microbatches: at least this many micro-batches (default 1, ``pp`` with pipelining).
        sync_microbatches: make every data-parallel replica run the same number of micro-batches.
        chunk_tokens: tokens per chunk of the log-prob head (default: its memory budget).
        mtp_loss_scale: a model built with multi-token prediction: the step adds
            ``mtp_loss_scale * tokens.mtp_loss()`` (the MTP cross-entropy summed over the tokens,
            averaged over the depths) to each micro-batch's ``loss_fn`` loss, as Megatron-Core's
            ``GPTModel`` adds its MTP loss, and reports ``metrics["mtp_loss"]`` (that cross-entropy
            / ``loss_normalizer``, unscaled). Default: the ``TransformerConfig``'s
            ``mtp_loss_scaling_factor`` (Megatron-Core's default 0.1); 0 when ``loss_fn`` adds an
            MTP term itself (from ``TokenOutputs.mtp_logprobs``). Refused for a model without MTP.
        replay_routes: routing replay (:mod:`mcore_zoo.routing`; a model built with
            ``overrides={"moe_enable_routing_replay": True}``): per sequence, ``[moe_layers, len_i,
            top_k]`` expert indices for every MoE layer of the model - all pipeline stages', in
            layer order (:func:`~mcore_zoo.routing.moe_layer_numbers`) - as a rollout engine reports
            them or :func:`~mcore_zoo.routing.unpack_routes` splits a single-process record. Every
            token goes to those experts, whatever the layout and the micro-batching: the step lays
            the routes out for this rank (per micro-batch, in the order the schedule runs them: its
            context-parallel share, its sequence-parallel slice, its stage's layers;
            :func:`~mcore_zoo.routing.microbatch_routes`) and raises
            :class:`~mcore_zoo.errors.ZooError` if they do not fit the sequences or are not all
            consumed.

        vision_inputs: a vision-language model: one entry per sequence, its images / videos
            (``None``, a dict or :class:`~mcore_zoo.families.vision_language.spec.SequenceVisionInputs`;
            docs/vision-language.md), as ``packed_forward`` takes them.

    Returns:
        :class:`StepResult`, the same on every rank of the model-parallel group.
    """
    handle = handle_of(model)
    handle.check_current()
    layout = handle.placement
    config = handle.transformer_config
    if getattr(config, "calculate_per_token_loss", False):
        raise ZooError("train_step normalises by loss_normalizer; switch off config.calculate_per_token_loss")
    if not loss_normalizer > 0:
        raise ZooError(f"loss_normalizer must be > 0, got {loss_normalizer}")
    depths = handle.arch_config.mtp_num_layers
    if mtp_loss_scale is not None and not depths:
        raise ZooError(f"{handle.arch_config.architecture}: mtp_loss_scale needs a model built with multi-token"
                       " prediction (num_nextn_predict_layers > 0)")  # fmt: skip
    if depths and mtp_loss_scale is None:
        mtp_loss_scale = float(getattr(config, "mtp_loss_scaling_factor", None) or 0.0)
    given = _given_chunks(model, handle)
    wrapped = any(hasattr(c, "finish_grad_sync") for c in given)
    check_moe_training_layout(handle)
    check_batching(num_microbatches, max_tokens_per_microbatch)
    seqs = _sequences(sequences, None, handle.arch_config.vocab_size, pad_token_id)
    if not seqs:
        raise ZooError("nothing to train on")
    check_token_data(token_data, seqs)
    if vision_inputs is not None and len(vision_inputs) != len(seqs):
        raise ZooError(f"vision_inputs has {len(vision_inputs)} entries for {len(seqs)} sequences (one per sequence)")
    align = alignment_for(layout.tp, layout.cp, layout.sequence_parallel)
    padded = [-(-int(s.numel()) // align) * align for s in seqs]
    interleaved = layout.vpp > 1
    count = num_microbatches or (1 if layout.pp == 1 else min(len(seqs), layout.pp))
    multiple_of = layout.pp if interleaved else 1
    groups = plan_microbatches(padded, count=count, max_tokens=max_tokens_per_microbatch, multiple_of=multiple_of)
    want = len(groups)
    dp_group = layout.groups.dp_cp
    if sync_microbatches and dp_group is not None and group_size(dp_group) > 1:
        n = torch.tensor([want], dtype=torch.long, device=handle.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=dp_group)
        want = int(n.item())
        if want > len(groups):
            groups = plan_microbatches(padded, count=want, max_tokens=max_tokens_per_microbatch, multiple_of=multiple_of)
    device = handle.device
    # a replica with fewer sequences than another gets padding micro-batches (at_least=want)
    micro = build_microbatches(layout, seqs, groups, align=align, pad_token_id=pad_token_id, device=device,
                               at_least=want, same_length=two_way_pipeline(layout, forward_only=False))  # fmt: skip
    # the schedule multiplies by cp / num_microbatches (and scales the MoE aux losses by the same):
    # every rank's part of J then carries a factor cp, which the DDP wrapper's mean over data x
    # context parallel, or _finalize_unwrapped's, takes out again
    factor = len(micro) / float(loss_normalizer)

    def loss_func(mb: Microbatch, index: int, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if not mb.members:  # padding micro-batch: no loss, but a graph for the schedule's backward
            return output.float().sum() * 0.0, {}
        tokens = token_outputs(handle, mb, output, temperature=temperature, compute_entropy=compute_entropy,
                               chunk_tokens=chunk_tokens, token_data=token_data, index=index)  # fmt: skip
        result = loss_fn(tokens)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ZooError("loss_fn must return (loss, metrics)")
        loss, metrics = result
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ZooError(f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__}")
        report = {k: torch.as_tensor(v).detach().float().reshape(()) for k, v in dict(metrics or {}).items()}
        loss = loss.reshape(())
        if depths:  # multi-token prediction: its cross-entropy, scaled, joins the trainer's loss
            mtp = tokens.mtp_loss()
            report["mtp_loss"] = mtp.detach().float() / float(loss_normalizer)
            if mtp_loss_scale:
                loss = loss + mtp_loss_scale * mtp
        report["loss"] = loss.detach().float().reshape(()) / float(loss_normalizer)
        return loss * factor, report

    order = {id(mb): i for i, mb in enumerate(micro)}

    def step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        with vision_inputs_for(chunk, mb.members, vision_inputs):
            output = chunk(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
        return output, functools.partial(loss_func, mb, order[id(mb)])

    replaying = contextlib.nullcontext()
    if replay_routes is not None:
        from ..routing import replay

        replaying = replay(handle, _replay_rows(handle, replay_routes, seqs, micro))
    kept = None if wrapped else _KeptGrads(handle)
    try:
        with replaying:  # checks the routes on entry, that they were all used on exit
            stored = run_schedule(given, micro, layout, step, forward_only=False)
    except BaseException:
        if kept is not None:
            kept.revert()
        raise
    if not wrapped:
        _finalize_unwrapped(handle)
        kept.restore()
    return _report(stored, handle, len(micro), device)


def _replay_rows(handle: ModelHandle, routes: Sequence[torch.Tensor], seqs: Sequence[torch.Tensor],
                 micro: Sequence[Microbatch]) -> list[torch.Tensor]:  # fmt: skip
    """``train_step``'s per-sequence ``replay_routes`` -> per MoE layer of this rank, the rows its
    router routes over the micro-batches ``micro`` (in schedule order; every chunk's router sees
    its micro-batches in that order)."""
    from ..routing import microbatch_routes, moe_layer_numbers, moe_routers

    layout = handle.placement
    moe_layers = moe_layer_numbers(handle)
    if len(routes) != len(seqs):
        raise ZooError(f"replay_routes for {len(routes)} sequences; {len(seqs)} sequences given")
    for i, (r, s) in enumerate(zip(routes, seqs)):
        if r.dim() != 3 or r.shape[0] != len(moe_layers) or r.shape[1] != s.numel():
            raise ZooError(f"replay_routes[{i}] has shape {tuple(r.shape)}; expected [{len(moe_layers)},"
                           f" {s.numel()}, top_k] ({len(moe_layers)} MoE layers in the model, {s.numel()} tokens"
                           f" in sequence {i})")  # fmt: skip
    layers = [moe_layers.index(int(r.layer_number)) for r in moe_routers(handle)]
    sp = layout.sequence_parallel and layout.tp > 1  # each TP rank routes its slice of the CP share
    packs = [(mb.members, mb.batch.cu_seqlens_padded) for mb in micro]
    return microbatch_routes(routes, packs, layers=layers, rank=layout.tp_rank if sp else 0,
                             size=layout.tp if sp else 1, cp_rank=layout.cp_rank, cp_size=layout.cp)  # fmt: skip


def _report(stored: list[Any], handle: ModelHandle, count: int, device: torch.device) -> StepResult:
    """Sum the loss functions' reports over micro-batches (last stage) and CP ranks; send them to
    every pipeline stage."""
    layout = handle.placement
    names: list[str] = []
    if layout.last_stage:
        for data in stored:
            names += [k for k in (data or {}) if k not in names]
    if layout.pp > 1:
        holder = [names]
        src = dist.get_process_group_ranks(layout.groups.pp)[-1]
        dist.broadcast_object_list(holder, src=src, group=layout.groups.pp)
        names = holder[0]
    if "loss" not in names:
        names = ["loss", *names]
    totals = torch.zeros(len(names), dtype=torch.float32, device=device)
    if layout.last_stage:
        for data in stored:
            for k, v in (data or {}).items():
                totals[names.index(k)] += v.to(device)
    if layout.cp > 1:
        dist.all_reduce(totals, group=layout.groups.cp)
    if layout.pp > 1:
        dist.broadcast(totals, src=dist.get_process_group_ranks(layout.groups.pp)[-1], group=layout.groups.pp)
    values = dict(zip(names, totals))
    loss = values.pop("loss")
    return StepResult(loss, values, count)


__all__ = ["train_step", "TokenOutputs", "StepResult", "token_outputs"]
