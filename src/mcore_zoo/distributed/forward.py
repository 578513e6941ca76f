"""The one packed forward: every layout (TP (+SP), PP, VPP, CP), THD packs or BSHD batches.

:func:`packed_forward` is the public entry point: it finds the model's handle and runs the
architecture's forward contribution (a plugin may provide its own, see
:data:`mcore_zoo.entry.FORWARD_CONTRACT`); the default is :func:`generic_forward`.

:func:`generic_forward` packs variable-length sequences into micro-batches (planned in input order
by :func:`~mcore_zoo.distributed.microbatches.plan_microbatches`, the planner the training step
uses too), gives each
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
logits live, by the chunked head of :mod:`.vocab_parallel` (per-token max / sum all-reduces over
the TP group), so no rank ever holds ``tokens x vocab`` in fp32; only ``[tokens]`` floats are
gathered.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import ZooError
from ..families.vision_language.spec import vision_inputs_for
from ..handle import ModelHandle, handle_of, unwrap
from ..packing import PackedBatch, PackedOutput, alignment_for, next_token_logprobs, pack_sequences
from ..placement import Placement
from .microbatches import plan_microbatches


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
    index: Optional[torch.Tensor] = None  # pack positions of this CP rank's tokens (None: all, in order)

    def packed_seq_params(self) -> Any:
        return self.batch.packed_seq_params()

    def local(self, packed: torch.Tensor) -> torch.Tensor:
        """This rank's share of a ``[T, ...]`` tensor laid out like the whole pack."""
        return packed if self.index is None else packed[self.index.to(packed.device)]

    def mtp_labels(self, depth: int) -> torch.Tensor:
        """``[T / cp]``: the token MTP depth ``depth`` (1-based) predicts at each of this rank's
        positions, ``depth + 1`` ahead (-1 where there is none)."""
        return self.local(pack_labels(self.batch, self.members, depth + 1)[0])


def _shifted_labels(batch: PackedBatch, shift: int = 1) -> torch.Tensor:
    """``[1, T]``: at each real position j < len - shift of a sequence, token j + shift; else -1."""
    labels = torch.full_like(batch.input_ids, -1)
    for start, n in zip(batch.cu_seqlens_padded.tolist(), batch.lengths):
        labels[0, start : start + n - shift] = batch.input_ids[0, start + shift : start + n]
    return labels


def pack_labels(batch: PackedBatch, members: Sequence[int], shift: int = 1) -> torch.Tensor:
    """``[1, T]`` labels of the whole pack, ``shift`` tokens ahead (1: the next token; ``d + 2``:
    what multi-token-prediction depth ``d + 1`` predicts); segments after the ``members`` (padding
    added to fill a micro-batch) predict nothing (-1)."""
    labels = _shifted_labels(batch, shift)
    if len(batch.lengths) > len(members):
        labels[0, int(batch.cu_seqlens_padded[len(members)]) :] = -1
    return labels


def make_microbatch(batch: PackedBatch, layout: Placement, members: list[int]) -> Microbatch:
    """This rank's share of a packed micro-batch. Segments after the ``members`` (padding added to
    fill a micro-batch) predict nothing: their labels are -1."""
    labels = pack_labels(batch, members)
    if layout.cp > 1:
        index = batch.context_parallel_index(layout.cp_rank, layout.cp).to(batch.input_ids.device)
        return Microbatch(batch, batch.input_ids[:, index], batch.position_ids[:, index], labels[:, index], members, index)
    return Microbatch(batch, batch.input_ids, batch.position_ids, labels, members)


def split_microbatches(lengths: Sequence[int], count: Optional[int], max_tokens: Optional[int]) -> list[list[int]]:
    """:func:`~mcore_zoo.distributed.microbatches.plan_microbatches` in input order (the forward's
    groups): contiguous runs of sequence indices."""
    return plan_microbatches(lengths, count=count, max_tokens=max_tokens, keep_order=True)


def partition_by_tokens(lengths: Sequence[int], max_tokens: Optional[int] = None, count: Optional[int] = None,
                        multiple_of: int = 1) -> list[list[int]]:  # fmt: skip
    """:func:`~mcore_zoo.distributed.microbatches.plan_microbatches`, balanced (the training
    step's groups; also spreads a batch over data-parallel ranks with ``count=dp``): each group's
    indices ascending, groups ordered by their first index."""
    return plan_microbatches(lengths, count=count, max_tokens=max_tokens, multiple_of=multiple_of)


def build_microbatches(layout: Placement, seqs: Sequence[torch.Tensor], groups: Sequence[Sequence[int]], *,
                       align: int, pad_token_id: int, device: torch.device, at_least: int = 0,
                       same_length: bool = False) -> list[Microbatch]:  # fmt: skip
    """One packed micro-batch per group of sequence indices (this rank's CP share), plus padding
    micro-batches up to ``at_least`` and to what the interleaved pipeline schedule accepts (a
    multiple of ``pp``, at least ``pp``). ``same_length``: every pack padded to the longest with
    a trailing padding segment (not a member; its labels are -1)."""
    groups = [list(g) for g in groups]
    target = max(at_least, len(groups))
    if layout.vpp > 1:
        target = max(layout.pp, -(-target // layout.pp) * layout.pp)
    groups += [[] for _ in range(target - len(groups))]
    padded = [sum(-(-int(seqs[i].numel()) // align) * align for i in g) or align for g in groups]
    longest = max(padded)
    micro = []
    for g, total in zip(groups, padded):
        parts = [seqs[i] for i in g] or [torch.full((align,), pad_token_id, dtype=torch.long)]
        if same_length and total < longest:
            parts = [*parts, torch.full((longest - total,), pad_token_id, dtype=torch.long)]
        pack = pack_sequences(parts, align=align, pad_token_id=pad_token_id).to(device)
        micro.append(make_microbatch(pack, layout, g))
    return micro


# ---------------------------------------------------------------------------- collectives
def _gather_vocab(logits: torch.Tensor, layout: Placement) -> torch.Tensor:
    """Vocab-parallel logits ``[..., V / tp]`` -> ``[..., V]`` (autograd-aware)."""
    if layout.tp == 1:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def uses_vllm_logprob_head(handle: ModelHandle) -> Optional[str]:
    """For a model that computes log-probs as vLLM's engine does, on the whole vocabulary (a
    ``vllm-exact`` build: numerics with ``kernels == "vllm"``), the engine's model runner whose
    log-prob kernel it follows (``"v1"`` / ``"v2"``, :func:`~mcore_zoo.kernels.vllm_ops.engine_model_runner`);
    ``None`` for any other model. The forward and the training step read it from the handle and pass
    it down (``vllm_head=``)."""
    if getattr(handle.numerics, "kernels", None) != "vllm":
        return None
    from ..kernels import vllm_ops

    arch = handle.arch_config
    return vllm_ops.engine_model_runner(arch.architecture, arch.moe is not None)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, layout: Placement, temperature: float = 1.0, *,
                            vllm_head: Optional[str] = None) -> torch.Tensor:  # fmt: skip
    """``log_softmax(logits / temperature)[label]`` in fp32 where ``logits [..., V / tp]`` is this TP
    rank's vocab slice; positions with ``label < 0`` give 0. TP ranks must call it together.

    Computed by :func:`~mcore_zoo.distributed.vocab_parallel.token_logprobs_and_entropy` (chunked:
    no ``[T, V]`` fp32 copy of the logits; within ``1e-6 + 2 ulp`` of ``torch.log_softmax``), or with
    ``vllm_head`` (:func:`uses_vllm_logprob_head`) by vLLM's log-prob kernel on the gathered vocabulary."""
    from .vocab_parallel import token_logprobs_and_entropy

    if vllm_head:
        from ..kernels import vllm_ops

        whole = _gather_vocab(logits, layout)
        return vllm_ops.token_logprobs_and_entropy(whole, labels, temperature=temperature, compute_entropy=False,
                                                   runner=vllm_head)[0]  # fmt: skip
    group = layout.groups.tp if layout.tp > 1 else None
    logprobs, _ = token_logprobs_and_entropy(logits, labels, tp_group=group, temperature=temperature, compute_entropy=False)
    return logprobs


def _gather_cp(local: torch.Tensor, mb: Microbatch, layout: Placement) -> torch.Tensor:
    """This CP rank's ``[T / cp, ...]`` -> the whole pack ``[T, ...]`` in pack order."""
    if layout.cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.cp)]
    dist.all_gather(parts, local.contiguous(), group=layout.groups.cp)
    return mb.batch.merge_context_parallel(parts)


def _mtp_logprobs(mb: Microbatch, parts: Sequence[torch.Tensor], layout: Placement, bshd: bool,
                  vllm_head: Optional[str] = None) -> list[list[torch.Tensor]]:  # fmt: skip
    """Per MTP depth ``d + 1``, per sequence: ``[len - 2 - d]`` fp32 log-probs of token ``j + d + 2``
    (temperature 1: the MTP training signal) from that depth's vocab-parallel logits."""
    result = []
    for d, part in enumerate(parts):
        shift = d + 2
        if bshd:
            seqs = mb.batch.unpack(mb.batch.input_ids)
            rows = []
            for row, tokens in zip(part, seqs):
                labels = torch.full((row.shape[0],), -1, dtype=torch.long, device=row.device)
                labels[: max(tokens.numel() - shift, 0)] = tokens[shift:].to(row.device)
                rows.append(vocab_parallel_logprobs(row, labels, layout, vllm_head=vllm_head)[: max(tokens.numel() - shift, 0)])
            result.append(rows)
            continue
        lp = vocab_parallel_logprobs(part[0], mb.mtp_labels(d + 1).to(part.device), layout, vllm_head=vllm_head)
        packed = mb.batch.unpack(_gather_cp(lp, mb, layout))
        result.append([x[: max(n - shift, 0)] for x, n in zip(packed, mb.batch.lengths)])
    return result


def _collect(mb: Microbatch, output: torch.Tensor, layout: Placement, want_logits: bool, want_logprobs: bool,
             bshd: bool = False, want_values: bool = False, temperature: float = 1.0, mtp_depths: int = 0,
             want_mtp: bool = False, vllm_head: Optional[str] = None) -> dict:  # fmt: skip
    """Last stage: model output ``[1, T / cp, V / tp]`` (BSHD: ``[B, S, V / tp]``) -> per-sequence
    logits / log-probs; a value head's ``[1, T / cp, 1]`` -> per-sequence values. A model with
    ``mtp_depths`` MTP depths outputs those depths' logits after the main ones
    (:func:`~mcore_zoo.families.mtp.spec.split_mtp_output`); ``want_mtp``: their log-probs too.
    ``vllm_head``: log-probs through vLLM's log-softmax (:func:`uses_vllm_logprob_head`)."""
    from ..families.mtp.spec import split_mtp_output

    output, parts = split_mtp_output(output, mtp_depths)
    extra = {"mtp_logprobs": _mtp_logprobs(mb, parts, layout, bshd, vllm_head)} if want_mtp else {}
    return {**_collect_main(mb, output, layout, want_logits, want_logprobs, bshd, want_values, temperature, vllm_head), **extra}


def _collect_main(mb: Microbatch, output: torch.Tensor, layout: Placement, want_logits: bool, want_logprobs: bool,
                  bshd: bool, want_values: bool, temperature: float, vllm_head: Optional[str]) -> dict:  # fmt: skip
    """:func:`_collect` of the main model's output."""
    if want_values:
        if bshd:
            return {"values": [row[:n, 0].float() for row, n in zip(output, mb.batch.lengths)]}
        return {"values": [v[:, 0].float() for v in mb.batch.unpack(_gather_cp(output[0], mb, layout))]}
    if bshd:
        logits = [row[:n] for row, n in zip(_gather_vocab(output, layout), mb.batch.lengths)]
        tokens = mb.batch.unpack(mb.batch.input_ids)
        result = {"logits": logits} if want_logits else {}
        if want_logprobs:
            result["logprobs"] = [_next_token_logprobs(l, t, temperature, vllm_head) for l, t in zip(logits, tokens)]
        return result
    local = output[0]
    result: dict[str, list[torch.Tensor]] = {}
    if want_logits:
        logits = mb.batch.unpack(_gather_cp(_gather_vocab(local, layout), mb, layout))
        result["logits"] = logits
        if want_logprobs:
            tokens = mb.batch.unpack(mb.batch.input_ids)
            result["logprobs"] = [_next_token_logprobs(l, t, temperature, vllm_head) for l, t in zip(logits, tokens)]
    elif want_logprobs:
        lp = vocab_parallel_logprobs(local, mb.labels[0].to(local.device), layout, temperature, vllm_head=vllm_head)
        result["logprobs"] = [x[: max(n - 1, 0)] for x, n in zip(mb.batch.unpack(_gather_cp(lp, mb, layout)), mb.batch.lengths)]
    return result


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits.float() / temperature


def _next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                         vllm_head: Optional[str] = None) -> torch.Tensor:
    """One sequence's ``[len - 1]`` next-token log-probs from its full-vocabulary logits (vLLM's
    log-softmax with ``vllm_head``, else ``log_softmax`` in fp32)."""
    if vllm_head:
        from ..kernels import vllm_ops

        targets = tokens[1:].to(logits.device)
        return vllm_ops.token_logprobs_and_entropy(logits[:-1], targets, temperature=temperature, compute_entropy=False,
                                                   runner=vllm_head)[0]  # fmt: skip
    return next_token_logprobs(_tempered(logits, temperature), tokens)


# ---------------------------------------------------------------------------- forward
@contextlib.contextmanager
def _p2p_settings(configs_of: Sequence[Any], **settings: Any) -> Iterator[None]:
    """Set ``TransformerConfig`` fields (``variable_seq_lengths``, ``batch_p2p_comm``) for one
    schedule run, then restore them."""
    configs = {id(c): c for c in configs_of}
    saved = {k: {name: getattr(cfg, name) for name in settings} for k, cfg in configs.items()}
    for cfg in configs.values():
        for name, value in settings.items():
            setattr(cfg, name, value)
    try:
        yield
    finally:
        for k, cfg in configs.items():
            for name, value in saved[k].items():
                setattr(cfg, name, value)


def two_way_pipeline(layout: Placement, forward_only: bool) -> bool:
    """Whether the schedule sends to and receives from one peer in both directions at once: the
    interleaved schedule's steady state with two stages (the next stage is also the previous one).

    Megatron-Core then exchanges activations and gradients with the same rank in one batch of
    point-to-point operations whose order differs on the two sides (shapes always, tensors with
    ``batch_p2p_comm``): messages pair up wrongly (a hang, or swapped tensors when the shapes
    agree). Such a run uses packs of one length (no shape exchange) and unbatched operations
    (ordered by rank parity)."""
    return layout.vpp > 1 and layout.pp == 2 and not forward_only


def _clear_aux_loss_scales() -> None:
    """Forget the aux-loss backward scales a previous backward left behind. Megatron-Core's schedule
    sets the MoE aux-loss scale with ``copy_`` of a ``[1]`` tensor into the stored one (forward-only
    runs too), but a backward outside a schedule (``packed_forward`` + ``backward``) stores a 0-d
    tensor there, and the copy then fails; with nothing stored the schedule stores its own."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    except ImportError:  # pragma: no cover - a Megatron-Core without MTP
        return
    MTPLossAutoScaler.main_loss_backward_scale = None


def run_schedule(given: Sequence[Any], micro: list[Microbatch], layout: Placement, step: Any, *,
                 forward_only: bool = True) -> list[Any]:  # fmt: skip
    """Megatron-Core's schedule for this layout (``get_forward_backward_func()``: no pipelining,
    1F1B or interleaved) over ``micro``; ``given`` are this rank's chunks as the caller holds them
    (wrappers such as DDP included). Forward-only runs collect ``step``'s non-loss data; training
    runs (``forward_only=False``) return what the loss functions reported. Every rank of the
    pipeline group runs the same number of micro-batches of the same packed lengths (all of one
    length where :func:`two_way_pipeline`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func(pp_size=layout.pp, vp_size=layout.parallel.vpp)
    iterators = [iter(micro) for _ in given]
    longest = max(mb.batch.total for mb in micro)
    settings: dict[str, Any] = {"variable_seq_lengths": True}
    if two_way_pipeline(layout, forward_only):
        if any(mb.batch.total != longest for mb in micro):
            raise ZooError("an interleaved two-stage training schedule needs micro-batches of one packed length")
        settings = {"variable_seq_lengths": False, "batch_p2p_comm": False}
    _clear_aux_loss_scales()
    configs = [unwrap(c).config for c in given]
    with _p2p_settings(configs, **settings):
        return fb(
            forward_step_func=step,
            data_iterator=iterators if layout.vpp > 1 else iterators[0],
            model=list(given) if layout.vpp > 1 else given[0],
            num_microbatches=len(micro),
            seq_length=longest,
            micro_batch_size=1,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
            **schedule_groups(layout, configs[0]),
        )


def schedule_groups(layout: Placement, config: Any) -> dict[str, Any]:
    """The process-group arguments of Megatron-Core's schedule for a model on its own groups
    (``pg_collection`` and, pipelined, a ``P2PCommunicator`` over the model's pipeline group);
    none for a model on ``parallel_state`` (the schedule's default)."""
    if not layout.own_groups:
        return {}
    if layout.pp == 1:
        return {"pg_collection": layout.pg_collection}
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return {"pg_collection": layout.pg_collection, "p2p_communicator": P2PCommunicator(pp_group=layout.groups.pp, config=config)}


def _run_pipeline(given: list[Any], micro: list[Microbatch], layout: Placement, step: Any) -> list[dict]:
    return run_schedule(given, micro, layout, step, forward_only=True)


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


def check_batching(num_microbatches: Any, max_tokens_per_microbatch: Any) -> None:
    """Micro-batching options, when given, are positive integers (:class:`InputError` otherwise)."""
    from ..errors import InputError

    for name, value in (("num_microbatches", num_microbatches), ("max_tokens_per_microbatch", max_tokens_per_microbatch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{name}={value!r}: give a positive integer (or leave it out)")


def check_moe_training_layout(handle: ModelHandle) -> None:
    """Megatron-Core's MoE layer refuses to run in training mode under tensor parallelism without
    sequence parallelism (a raw ``ValueError`` from inside the forward, also under ``no_grad``):
    say so before the forward, with the two ways out. A layer whose forward is its own and says so
    (``trains_at_tp_without_sequence_parallel``: the ``vllm-exact`` MoE block) is let through."""
    moe = handle.arch_config.moe
    if moe is None or handle.placement.tp == 1 or handle.placement.sequence_parallel:
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if any(m.training and not getattr(m, "trains_at_tp_without_sequence_parallel", False)
           for chunk in handle.chunks for m in chunk.modules() if isinstance(m, MoELayer)):  # fmt: skip
        raise ZooError(f"{handle.arch_config.architecture}: an MoE model at TP={handle.placement.tp} without sequence"
                       " parallelism cannot run in training mode (Megatron-Core's MoE layer refuses it): build it"
                       " with Parallelism(..., sequence_parallel=True), or call model.eval() for forwards"
                       " that do not train")  # fmt: skip


def _sequences(sequences: Union[Sequence[torch.Tensor], torch.Tensor], attention_mask: Optional[torch.Tensor],
               vocab_size: Optional[int] = None, pad_token_id: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """The 1-D token sequences of ``sequences`` (a list of 1-D integer tensors, or a padded
    ``[B, S]`` batch with ``attention_mask``), checked: integer ids in ``[0, vocab_size)`` - the
    HF vocabulary, not a padded one (rows past it are padding, whose logits the zoo masks) - and a
    ``pad_token_id`` in range. Raises :class:`~mcore_zoo.errors.InputError` naming the argument,
    the sequence and the position."""
    from ..errors import InputError

    if vocab_size is not None and not (isinstance(pad_token_id, int) and not isinstance(pad_token_id, bool)
                                       and 0 <= pad_token_id < vocab_size):  # fmt: skip
        raise InputError(f"pad_token_id={pad_token_id!r} is not a token id of this model (0 <= id < {vocab_size})")
    if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != sequences.shape):
            raise InputError(f"attention_mask must be a tensor of the batch's shape {tuple(sequences.shape)}")
        rows = pack_sequences(sequences, attention_mask)
        seqs = rows.unpack(rows.input_ids)
    elif attention_mask is not None:
        raise ZooError("attention_mask goes with a padded [B, S] batch")
    elif isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence) or isinstance(sequences, (str, bytes)):
        raise InputError(f"sequences must be a list of 1-D token tensors or a [B, S] tensor, got {type(sequences).__name__}"
                         + (f" of shape {tuple(sequences.shape)}" if isinstance(sequences, torch.Tensor) else ""))  # fmt: skip
    else:
        seqs = []
        for i, s in enumerate(sequences):
            try:
                t = torch.as_tensor(s)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InputError(f"sequences[{i}] is not a token tensor ({type(s).__name__}: {exc})") from None
            if t.dim() > 1 and t.numel() != max(t.shape):
                raise InputError(f"sequences[{i}] must be 1-D, got shape {tuple(t.shape)}")
            seqs.append(t.reshape(-1))
    for i, t in enumerate(seqs):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"sequences[{i}] holds {t.dtype} values; token ids are integers")
        if vocab_size is not None and t.numel():
            bad = ((t < 0) | (t >= vocab_size)).nonzero()
            if bad.numel():
                j = int(bad[0, 0])
                raise InputError(f"sequences[{i}][{j}] = {int(t[j])} is not a token id of this model (0 <= id <"
                                 f" {vocab_size}, the HF vocab_size){'' if bad.numel() == 1 else f'; {bad.numel()} such ids'}")  # fmt: skip
    return seqs


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
    temperature: float = 1.0,
    return_mtp_logprobs: bool = False,
    vision_inputs: Optional[Sequence[Any]] = None,
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
        temperature: log-probs of ``softmax(logits / temperature)`` (what a rollout sampled from;
            ``train_step`` takes the same); logits are returned as the model computes them.
        return_mtp_logprobs: a model built with multi-token prediction (``num_nextn_predict_layers``):
            also ``mtp_logprobs[d][i]``, the ``[len_i - 2 - d]`` fp32 log-probs (temperature 1)
            depth ``d + 1`` gives token ``j + d + 2``. The logits and log-probs of the main model
            are the same with or without the MTP block.
        vision_inputs: a vision-language model: one entry per sequence, handed to each chunk call
            for the sequences of its micro-batch (``vision_language_forward`` checks them).

    Returns:
        :class:`~mcore_zoo.packing.PackedOutput`; on non-last pipeline stages with
        ``broadcast=False`` its fields are ``None``.
    """
    handle.check_current()
    layout = handle.placement
    chunks = handle.chunks
    check_moe_training_layout(handle)
    check_batching(num_microbatches, max_tokens_per_microbatch)
    if seq_format not in ("thd", "bshd"):
        raise ZooError(f"unknown seq_format {seq_format!r}; use 'thd' or 'bshd'")
    staged = layout.pp > 1 or layout.cp > 1
    if staged and (seq_format != "thd" or isinstance(sequences, PackedBatch)):
        raise ZooError("pipeline / context-parallel models run THD packs built from the sequences;"
                       " pass the sequences (no seq_format='bshd' or PackedBatch)")  # fmt: skip
    if seq_format == "thd" and handle.backend == "local" and handle.numerics.attention == "backend" \
            and handle.numerics.kernels == "backend":
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
    vocab_size = handle.arch_config.vocab_size
    if isinstance(sequences, PackedBatch):
        _sequences([sequences.input_ids.reshape(-1)], None, vocab_size, pad_token_id)
        batch = sequences.to(device)
        micro = [make_microbatch(batch, layout, list(range(len(batch.lengths))))]
        lengths = list(batch.lengths)
    else:
        seqs = _sequences(sequences, attention_mask, vocab_size, pad_token_id)
        if not seqs:
            raise ZooError("nothing to run")
        lengths = [int(s.numel()) for s in seqs]
        if num_microbatches is None and max_tokens_per_microbatch is None:
            num_microbatches = 1 if layout.pp == 1 else min(len(seqs), layout.pp)
        groups = plan_microbatches(lengths, count=num_microbatches, max_tokens=max_tokens_per_microbatch, keep_order=True)
        micro = build_microbatches(layout, seqs, groups, align=align, pad_token_id=pad_token_id, device=device)
    if getattr(handle.options, "head", "lm") == "value":  # a critic: values instead of logits / log-probs
        return_logits = return_logprobs = False
    want_values = not (return_logits or return_logprobs) and getattr(handle.options, "head", "lm") == "value"
    if not temperature > 0:
        raise ZooError(f"temperature must be > 0, got {temperature}")
    depths = handle.arch_config.mtp_num_layers
    if return_mtp_logprobs and not depths:
        raise ZooError(f"{handle.arch_config.architecture}: return_mtp_logprobs needs a model built with"
                       " multi-token prediction (num_nextn_predict_layers > 0)")  # fmt: skip
    collect = functools.partial(_collect, layout=layout, want_logits=return_logits, want_logprobs=return_logprobs,
                                want_values=want_values, temperature=temperature, mtp_depths=depths,
                                want_mtp=return_mtp_logprobs, vllm_head=uses_vllm_logprob_head(handle))  # fmt: skip
    def run(chunk: Any, mb: Microbatch) -> torch.Tensor:
        with vision_inputs_for(chunk, mb.members, vision_inputs):
            return (_run_bshd if seq_format == "bshd" else _run_thd)(chunk, mb, layout)

    if not staged:  # one stage, whole sequences on this rank: differentiable
        stored = [collect(mb, run(chunks[0], mb), bshd=seq_format == "bshd") for mb in micro]
        out = PackedOutput()
        _assemble(out, stored, micro, len(lengths), return_logits, return_logprobs, want_values)
        _assemble_mtp(out, stored, micro, len(lengths), depths if return_mtp_logprobs else 0)
        return out

    def step(data_iterator: Iterator[Microbatch], chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        out = run(chunk, mb)

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> dict:
            return collect(mb, output)

        return out, loss_func

    with torch.no_grad():
        stored = _run_pipeline(chunks, micro, layout, step) if layout.pp > 1 else [
            collect(mb, run(chunks[0], mb)) for mb in micro
        ]  # fmt: skip
        out = PackedOutput()
        if layout.last_stage:
            _assemble(out, stored, micro, len(lengths), return_logits, return_logprobs, want_values)
            _assemble_mtp(out, stored, micro, len(lengths), depths if return_mtp_logprobs else 0)
        if broadcast and layout.pp > 1:
            _broadcast_from_last_stage(out, lengths, handle, return_logits, return_logprobs, device, want_values)
            _broadcast_mtp(out, lengths, handle, depths if return_mtp_logprobs else 0, device)
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


def _assemble(out: PackedOutput, stored: list[dict], micro: list[Microbatch], n: int, want_logits: bool, want_logprobs: bool,
              want_values: bool = False) -> None:  # fmt: skip
    if len(stored) != len(micro):
        raise ZooError(f"pipeline schedule returned {len(stored)} results for {len(micro)} micro-batches")
    for key, wanted in (("logits", want_logits), ("logprobs", want_logprobs), ("values", want_values)):
        if not wanted:
            continue
        per_seq: list[Optional[torch.Tensor]] = [None] * n
        for mb, data in zip(micro, stored):
            for i, value in zip(mb.members, data[key]):
                per_seq[i] = value
        setattr(out, key, per_seq)


def _assemble_mtp(out: PackedOutput, stored: list[dict], micro: list[Microbatch], n: int, depths: int) -> None:
    """``out.mtp_logprobs[d][i]`` from the micro-batches' results (``depths`` 0: nothing)."""
    if not depths:
        return
    per_depth: list[list[Optional[torch.Tensor]]] = [[None] * n for _ in range(depths)]
    for mb, data in zip(micro, stored):
        for d in range(depths):
            for i, value in zip(mb.members, data["mtp_logprobs"][d]):
                per_depth[d][i] = value
    out.mtp_logprobs = per_depth  # type: ignore[assignment]


def _broadcast_mtp(out: PackedOutput, lengths: list[int], handle: ModelHandle, depths: int, device: torch.device) -> None:
    """Send the last stage's MTP log-probs to the other stages of its pipeline group."""
    if not depths:
        return
    layout = handle.placement
    group = layout.groups.pp
    src = dist.get_process_group_ranks(group)[-1]
    result = []
    for d in range(depths):
        sizes = [max(n - 2 - d, 0) for n in lengths]
        flat = (torch.cat(out.mtp_logprobs[d]) if layout.last_stage
                else torch.empty((sum(sizes),), dtype=torch.float32, device=device))  # fmt: skip
        dist.broadcast(flat, src=src, group=group)
        result.append(list(torch.split(flat, sizes)))
    out.mtp_logprobs = result


def _broadcast_from_last_stage(out: PackedOutput, lengths: list[int], handle: ModelHandle, want_logits: bool, want_logprobs: bool, device: torch.device,
                               want_values: bool = False) -> None:  # fmt: skip
    """Send the last stage's per-sequence results to the other stages of its pipeline group."""
    layout = handle.placement
    group = layout.groups.pp
    src = dist.get_process_group_ranks(group)[-1]
    if want_values:
        flat = torch.cat(out.values) if layout.last_stage else torch.empty((sum(lengths),), dtype=torch.float32, device=device)
        dist.broadcast(flat, src=src, group=group)
        out.values = list(torch.split(flat, lengths))
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


__all__ = [
    "packed_forward",
    "generic_forward",
    "Microbatch",
    "make_microbatch",
    "split_microbatches",
    "partition_by_tokens",
    "build_microbatches",
    "pack_labels",
    "run_schedule",
    "schedule_groups",
    "two_way_pipeline",
    "vocab_parallel_logprobs",
    "uses_vllm_logprob_head",
]
