"""The one packed forward: every layout (TP (+SP), PP, VPP, CP), THD packs or BSHD batches.

:func:`packed_forward` is the public entry point: it finds the model's handle and runs the
architecture's forward contribution (a plugin may provide its own, see
:data:`mcore_zoo.entry.FORWARD_CONTRACT`); the default is :func:`generic_forward`.

:func:`generic_forward` packs variable-length sequences into micro-batches, gives each
context-parallel rank its load-balanced (zigzag) share of every sequence, runs the model (directly,
or through Megatron-Core's own pipeline schedule, forward-only), then gathers the outputs across
tensor-parallel (vocab), context-parallel (tokens) and - optionally - pipeline ranks and puts them
back into per-sequence order. Contract:

* every rank of one model-parallel group (TP x PP x CP) passes the same sequences (the usual
  Megatron convention); data-parallel replicas pass their own;
* ``model`` is what this rank holds: one ``GPTModel`` (possibly wrapped, e.g. DDP), the list of
  its virtual-pipeline chunks, or the model's handle;
* results are per sequence, in input order, on the last pipeline stage - and on every rank with
  ``broadcast=True`` (default);
* without pipeline or context parallelism the forward is differentiable (the TP vocabulary gather
  is Megatron-Core's autograd-aware one); under PP / CP it runs without gradients;
* context parallelism: each sequence's padded slot is split into ``2 * cp`` chunks, rank ``r``
  keeps chunks ``r`` and ``2 * cp - 1 - r`` (:func:`mcore_zoo.packing.zigzag_index`); token
  positions are the original ones (RoPE is applied per CP chunk by Megatron-Core);
* sequence parallel needs nothing here besides the padding, which
  :func:`mcore_zoo.packing.alignment_for` chooses.

Log-probabilities without logits (``return_logits=False``) are computed where the vocab-parallel
logits live (fp32 max / log-sum-exp / target all-reduces over the TP group, as in Megatron's
cross entropy), so no rank ever holds ``tokens x vocab``; only ``[tokens]`` floats are gathered.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import ZooError
from ..handle import ModelHandle, handle_of
from ..packing import PackedBatch, PackedOutput, alignment_for, next_token_logprobs, pack_sequences
from ..placement import Placement


# ---------------------------------------------------------------------------- micro-batches
@dataclass
class Microbatch:
    """One packed micro-batch as this rank feeds it to the model.

    ``batch`` is the whole pack (every sequence, every CP share); ``input_ids`` / ``position_ids``
    are this CP rank's ``[1, T / cp]`` share; ``labels`` the next token of each of those positions
    (-1 where there is none); ``members`` the indices of its sequences in the caller's list (empty
    for padding micro-batches that only keep an interleaved pipeline schedule legal).
    """

    batch: PackedBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    members: list[int]

    def packed_seq_params(self) -> Any:
        return self.batch.packed_seq_params()


def _shifted_labels(batch: PackedBatch) -> torch.Tensor:
    """``[1, T]``: at each real position j < len - 1 of a sequence, token j + 1; else -1."""
    labels = torch.full_like(batch.input_ids, -1)
    for start, n in zip(batch.cu_seqlens_padded.tolist(), batch.lengths):
        labels[0, start : start + n - 1] = batch.input_ids[0, start + 1 : start + n]
    return labels


def make_microbatch(batch: PackedBatch, layout: Placement, members: list[int]) -> Microbatch:
    """This rank's share of a packed micro-batch."""
    labels = _shifted_labels(batch)
    if layout.cp > 1:
        index = batch.context_parallel_index(layout.cp_rank, layout.cp).to(batch.input_ids.device)
        return Microbatch(batch, batch.input_ids[:, index], batch.position_ids[:, index], labels[:, index], members)
    return Microbatch(batch, batch.input_ids, batch.position_ids, labels, members)


def split_microbatches(lengths: Sequence[int], count: Optional[int], max_tokens: Optional[int]) -> list[list[int]]:
    """Contiguous groups of sequence indices: ``count`` groups balanced by tokens, or as few groups
    as keep each under ``max_tokens`` (a longer sequence gets a group of its own)."""
    n = len(lengths)
    if max_tokens is not None:
        groups: list[list[int]] = [[]]
        used = 0
        for i, length in enumerate(lengths):
            if groups[-1] and used + length > max_tokens:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += length
        return groups
    count = max(1, min(count or 1, n))
    total = sum(lengths)
    groups = []
    current: list[int] = []
    done = 0
    for i, length in enumerate(lengths):
        current.append(i)
        done += length
        remaining_groups = count - len(groups) - 1
        if remaining_groups and (done >= total * (len(groups) + 1) / count or n - i - 1 == remaining_groups):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------------------- collectives
def _gather_vocab(logits: torch.Tensor, layout: Placement) -> torch.Tensor:
    """Vocab-parallel logits ``[..., V / tp]`` -> ``[..., V]`` (autograd-aware)."""
    if layout.tp == 1:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, layout: Placement) -> torch.Tensor:
    """``log_softmax(logits)[label]`` in fp32 where ``logits [..., V / tp]`` is this TP rank's vocab
    slice; positions with ``label < 0`` give 0. TP ranks must call it together."""
    logits = logits.float()
    valid = labels >= 0
    labels = labels.clamp(min=0)
    if layout.tp == 1:
        out = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return out.masked_fill(~valid, 0.0)
    group = layout.groups.tp
    vmax = logits.max(dim=-1).values
    dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - vmax.unsqueeze(-1)
    sumexp = shifted.exp().sum(dim=-1)
    dist.all_reduce(sumexp, group=group)
    width = logits.shape[-1]
    start = layout.tp_rank * width
    local = (labels >= start) & (labels < start + width)
    picked = shifted.gather(-1, (labels - start).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(local, picked, torch.zeros_like(picked))
    dist.all_reduce(picked, group=group)
    return (picked - sumexp.log()).masked_fill(~valid, 0.0)


def _gather_cp(local: torch.Tensor, mb: Microbatch, layout: Placement) -> torch.Tensor:
    """This CP rank's ``[T / cp, ...]`` -> the whole pack ``[T, ...]`` in pack order."""
    if layout.cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.cp)]
    dist.all_gather(parts, local.contiguous(), group=layout.groups.cp)
    return mb.batch.merge_context_parallel(parts)


def _collect(mb: Microbatch, output: torch.Tensor, layout: Placement, want_logits: bool, want_logprobs: bool,
             bshd: bool = False) -> dict:  # fmt: skip
    """Last stage: model output ``[1, T / cp, V / tp]`` (BSHD: ``[B, S, V / tp]``) -> per-sequence
    logits / log-probs."""
    if bshd:
        logits = [row[:n] for row, n in zip(_gather_vocab(output, layout), mb.batch.lengths)]
        tokens = mb.batch.unpack(mb.batch.input_ids)
        result = {"logits": logits} if want_logits else {}
        if want_logprobs:
            result["logprobs"] = [next_token_logprobs(l, t) for l, t in zip(logits, tokens)]
        return result
    local = output[0]
    result: dict[str, list[torch.Tensor]] = {}
    if want_logits:
        logits = mb.batch.unpack(_gather_cp(_gather_vocab(local, layout), mb, layout))
        result["logits"] = logits
        if want_logprobs:
            tokens = mb.batch.unpack(mb.batch.input_ids)
            result["logprobs"] = [next_token_logprobs(l, t) for l, t in zip(logits, tokens)]
    elif want_logprobs:
        lp = vocab_parallel_logprobs(local, mb.labels[0].to(local.device), layout)
        result["logprobs"] = [x[: max(n - 1, 0)] for x, n in zip(mb.batch.unpack(_gather_cp(lp, mb, layout)), mb.batch.lengths)]
    return result


# ---------------------------------------------------------------------------- forward
@contextlib.contextmanager
def _variable_seq_lengths(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Micro-batches of different packed lengths: let the schedule communicate shapes."""
    configs = {id(c.config): c.config for c in chunks}
    saved = {k: cfg.variable_seq_lengths for k, cfg in configs.items()}
    for cfg in configs.values():
        cfg.variable_seq_lengths = True
    try:
        yield
    finally:
        for k, cfg in configs.items():
            cfg.variable_seq_lengths = saved[k]


def _run_pipeline(given: list[Any], micro: list[Microbatch], layout: Placement, step: Any) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    iterators = [iter(micro) for _ in given]
    longest = max(mb.batch.total for mb in micro)
    with _variable_seq_lengths(given):
        return fb(
            forward_step_func=step,
            data_iterator=iterators if layout.vpp > 1 else iterators[0],
            model=given if layout.vpp > 1 else given[0],
            num_microbatches=len(micro),
            seq_length=longest,
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )


def packed_forward(
    model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]],
    sequences: Union[Sequence[torch.Tensor], torch.Tensor, PackedBatch],
    attention_mask: Optional[torch.Tensor] = None,
    **options: Any,
) -> PackedOutput:
    """Run a zoo-built model on variable-length sequences, through its architecture's forward.

    ``model``: this rank's ``GPTModel`` (wrapped or not), its list of virtual-pipeline chunks, or
    its handle. ``options`` are those of :func:`generic_forward` (the default forward; a plugin's
    own forward takes the same, see :data:`mcore_zoo.entry.FORWARD_CONTRACT`).
    """
    handle = handle_of(model)
    out = handle.architecture.forward(handle, sequences, attention_mask, **options)
    if not isinstance(out, PackedOutput):
        raise ZooError(f"{handle.architecture.provider_of('forward')}: forward returned {type(out).__name__}, expected PackedOutput")
    return out


def _sequences(sequences: Union[Sequence[torch.Tensor], torch.Tensor], attention_mask: Optional[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
        rows = pack_sequences(sequences, attention_mask)
        return rows.unpack(rows.input_ids)
    if attention_mask is not None:
        raise ZooError("attention_mask goes with a padded [B, S] batch")
    return [torch.as_tensor(s).reshape(-1) for s in sequences]


def generic_forward(
    handle: ModelHandle,
    sequences: Union[Sequence[torch.Tensor], torch.Tensor, PackedBatch],
    attention_mask: Optional[torch.Tensor] = None,
    *,
    seq_format: str = "thd",
    return_logits: bool = True,
    return_logprobs: bool = True,
    align: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    max_tokens_per_microbatch: Optional[int] = None,
    broadcast: bool = True,
    pad_token_id: int = 0,
) -> PackedOutput:
    """Packed forward of this rank's model chunks under the model's placement.

    Args:
        handle: the model's handle.
        sequences: 1-D token tensors (or a padded ``[B, S]`` batch with ``attention_mask``), the
            same on every rank of the model-parallel group; without PP / CP also a ready
            :class:`~mcore_zoo.packing.PackedBatch` (run as one micro-batch).
        seq_format: ``"thd"`` (packed rows, ``PackedSeqParams``) or ``"bshd"`` (one right-padded
            batch with a causal mask; every backend supports it; no PP / CP).
        return_logits: per-sequence ``[len_i, vocab]`` logits (gathered over TP and CP: costs
            ``tokens x vocab`` memory on every rank that receives them).
        return_logprobs: per-sequence ``[len_i - 1]`` fp32 next-token log-probabilities.
        align: per-sequence padding multiple (default and minimum: what the layout needs).
        num_microbatches: split into this many micro-batches (balanced by tokens). Default: 1
            without pipeline parallelism, else ``min(len(sequences), pp)``.
        max_tokens_per_microbatch: alternatively, a token budget per micro-batch.
        broadcast: send the results from the last pipeline stage to every stage.

    Returns:
        :class:`~mcore_zoo.packing.PackedOutput`; on non-last pipeline stages with
        ``broadcast=False`` its fields are ``None``.
    """
    handle.check_current()
    layout = handle.placement
    chunks = handle.chunks
    if seq_format not in ("thd", "bshd"):
        raise ZooError(f"unknown seq_format {seq_format!r}; use 'thd' or 'bshd'")
    staged = layout.pp > 1 or layout.cp > 1
    if staged and (seq_format != "thd" or isinstance(sequences, PackedBatch)):
        raise ZooError("pipeline / context-parallel models run THD packs built from the sequences;"
                       " pass the sequences (no seq_format='bshd' or PackedBatch)")  # fmt: skip
    if seq_format == "thd" and handle.backend == "local" and handle.numerics.attention == "backend":
        raise ZooError(
            "backend 'local' cannot run THD: Megatron-Core's DotProductAttention rejects packed"
            " input. Use backend='portable' or 'te', a numerics profile with a zoo attention"
            " kernel (e.g. 'hf-exact'), or seq_format='bshd'."
        )
    device = handle.device
    needed = alignment_for(layout.tp, layout.cp, layout.sequence_parallel)
    if align is not None and align % needed:
        raise ZooError(f"align={align} is not a multiple of {needed}, which this layout needs")
    align = align or needed
    if isinstance(sequences, PackedBatch):
        batch = sequences.to(device)
        micro = [make_microbatch(batch, layout, list(range(len(batch.lengths))))]
        lengths = list(batch.lengths)
    else:
        seqs = _sequences(sequences, attention_mask)
        if not seqs:
            raise ZooError("nothing to run")
        lengths = [int(s.numel()) for s in seqs]
        if num_microbatches is None and max_tokens_per_microbatch is None:
            num_microbatches = 1 if layout.pp == 1 else min(len(seqs), layout.pp)
        groups = split_microbatches(lengths, num_microbatches, max_tokens_per_microbatch)
        micro = [
            make_microbatch(pack_sequences([seqs[i] for i in g], align=align, pad_token_id=pad_token_id).to(device), layout, g)
            for g in groups
        ]
    if layout.vpp > 1:  # the interleaved schedule wants a multiple of pp micro-batches (at least pp)
        target = max(layout.pp, -(-len(micro) // layout.pp) * layout.pp)
        filler = torch.full((align,), pad_token_id, dtype=torch.long)
        while len(micro) < target:
            micro.append(make_microbatch(pack_sequences([filler], align=align).to(device), layout, []))
    collect = functools.partial(_collect, layout=layout, want_logits=return_logits, want_logprobs=return_logprobs)
    if not staged:  # one stage, whole sequences on this rank: differentiable
        run = _run_bshd if seq_format == "bshd" else _run_thd
        stored = [collect(mb, run(chunks[0], mb, layout), bshd=seq_format == "bshd") for mb in micro]
        out = PackedOutput()
        _assemble(out, stored, micro, len(lengths), return_logits, return_logprobs)
        return out

    def step(data_iterator: Iterator[Microbatch], chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        out = chunk(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> dict:
            return collect(mb, output)

        return out, loss_func

    with torch.no_grad():
        stored = _run_pipeline(chunks, micro, layout, step) if layout.pp > 1 else [
            collect(mb, _run_thd(chunks[0], mb, layout)) for mb in micro
        ]  # fmt: skip
        out = PackedOutput()
        if layout.last_stage:
            _assemble(out, stored, micro, len(lengths), return_logits, return_logprobs)
        if broadcast and layout.pp > 1:
            _broadcast_from_last_stage(out, lengths, handle, return_logits, return_logprobs, device)
    return out


def _run_thd(chunk: torch.nn.Module, mb: Microbatch, layout: Placement) -> torch.Tensor:
    return chunk(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())


def _run_bshd(chunk: torch.nn.Module, mb: Microbatch, layout: Placement) -> torch.Tensor:
    """The micro-batch's sequences as one right-padded ``[B, S]`` batch; returns ``[B, S, V / tp]``."""
    batch = mb.batch
    seqs = batch.unpack(batch.input_ids)
    width = max(batch.lengths)
    if layout.sequence_parallel:
        width = -(-width // layout.tp) * layout.tp
    ids = torch.zeros((len(seqs), width), dtype=torch.long, device=batch.input_ids.device)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
    positions = torch.arange(width, device=ids.device).unsqueeze(0).expand(len(seqs), -1)
    return chunk(ids, positions, None)


def _assemble(out: PackedOutput, stored: list[dict], micro: list[Microbatch], n: int, want_logits: bool, want_logprobs: bool) -> None:
    if len(stored) != len(micro):
        raise ZooError(f"pipeline schedule returned {len(stored)} results for {len(micro)} micro-batches")
    for key, wanted in (("logits", want_logits), ("logprobs", want_logprobs)):
        if not wanted:
            continue
        per_seq: list[Optional[torch.Tensor]] = [None] * n
        for mb, data in zip(micro, stored):
            for i, value in zip(mb.members, data[key]):
                per_seq[i] = value
        setattr(out, key, per_seq)


def _broadcast_from_last_stage(out: PackedOutput, lengths: list[int], handle: ModelHandle, want_logits: bool, want_logprobs: bool, device: torch.device) -> None:
    """Send the last stage's per-sequence results to the other stages of its pipeline group."""
    layout = handle.placement
    group = layout.groups.pp
    src = dist.get_process_group_ranks(group)[-1]
    vocab = handle.arch_config.padded_vocab_size or handle.arch_config.vocab_size
    if want_logits:
        dtype = handle.params_dtype
        flat = (
            torch.cat([t.to(dtype) for t in out.logits])
            if layout.last_stage
            else torch.empty((sum(lengths), vocab), dtype=dtype, device=device)
        )
        dist.broadcast(flat, src=src, group=group)
        out.logits = list(torch.split(flat, lengths))
    if want_logprobs:
        sizes = [max(n - 1, 0) for n in lengths]
        flat = (
            torch.cat(out.logprobs)
            if layout.last_stage
            else torch.empty((sum(sizes),), dtype=torch.float32, device=device)
        )
        dist.broadcast(flat, src=src, group=group)
        out.logprobs = list(torch.split(flat, sizes))


__all__ = ["packed_forward", "generic_forward", "Microbatch", "make_microbatch", "split_microbatches", "vocab_parallel_logprobs"]
