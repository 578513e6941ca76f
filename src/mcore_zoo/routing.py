"""MoE routing for RL: record the experts a forward chose, replay them in a later forward (and its
backward), and per-layer expert token counts.

Built on Megatron-Core's router replay (``transformer/moe/router_replay.py``): build the model with
``overrides={"moe_enable_routing_replay": True}`` so that every router owns a ``RouterReplay``.
The zoo's HF-order router honours it the same way as the stock one: in replay the chosen experts
are the given ones, the weights are recomputed from the current router scores (so gradients reach
the router) with HF's renormalisation and scaling.

::

    model = mcore_zoo.build_model(ckpt, load=ckpt, overrides={"moe_enable_routing_replay": True})
    with mcore_zoo.routing.record(model) as rec:          # e.g. the old-policy log-prob pass
        old = mcore_zoo.packed_forward(model, seqs)
    with mcore_zoo.routing.replay(model, rec.routes):      # training pass: same experts
        new = mcore_zoo.packed_forward(model, seqs)
        loss(new).backward()

``routes`` is one ``[tokens, top_k]`` int64 tensor per MoE layer of this rank's model chunks (in
layer order), in the order the router sees the tokens: the packed order of :func:`packed_forward`
(alignment padding included; sequence-parallel ranks hold their slice). With several forwards in
one block (the micro-batches of a pipeline schedule) their tokens follow one another; the zoo's
router (numerics ``router="hf"``) records and replays forward by forward, Megatron-Core's stock
router keeps a single target (one forward per block). Replay fails closed: a forward that finds
too few routes left, and routes left unused when the block ends, raise
:class:`~mcore_zoo.errors.ZooError` naming the layer (and how many of its tokens were left).
Routes chosen by a rollout engine (per sequence, token and layer) are packed that way by
:func:`pack_routes` (one forward) or :func:`microbatch_routes` (several); :func:`routes_from_vllm`
reads them from vLLM's request outputs (``enable_return_routed_experts=True``); :func:`unpack_routes`
splits recorded routes per sequence. Activation recomputation of MoE layers (``"full"``, or
``"selective"`` with ``"moe"``): with the zoo's router a forward rerun in the backward routes its
tokens to the experts of the forward it recomputes, in a record and in a replay alike, and neither
records nor consumes routes again (a record holds each token once; Megatron-Core's
``REPLAY_BACKWARD`` action does the same); the stock router replays its single target again.

Training: ``mcore_zoo.train_step(..., replay_routes=per_sequence)`` takes the routes of the whole
step per sequence (``[moe_layers, len_i, top_k]`` for every MoE layer of the model,
:func:`moe_layer_numbers`) and lays them out itself for every rank and micro-batch - each
context-parallel rank's zigzag share, each TP rank's sequence-parallel slice of each micro-batch
(not of the whole step's pack), each pipeline stage's layers - then refuses routes left unused.

Context parallelism: a CP rank's routers see its zigzag share of every sequence
(:func:`mcore_zoo.packing.zigzag_index`), so it records and must replay routes in that order.
:func:`context_parallel_routes` takes routes in pack order (a single-process record, or
:func:`pack_routes` without ``cp_size``) to one rank's order (``pack_routes(..., cp_rank=,
cp_size=)`` packs per-sequence routes straight into it); :func:`merge_context_parallel_routes`
puts the CP ranks' records back into pack order (the single-process record), which
:func:`unpack_routes` splits per sequence. The sequences of a pack are listed in the order the
forwards routed them: :func:`mcore_zoo.train_step` runs its micro-batches as
:func:`mcore_zoo.partition_by_tokens` groups them, each group's sequences in ascending order (a
single-process record of a step lists them so).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from .errors import ZooError


def moe_routers(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[Any]:
    """The MoE routers of ``model`` (or its virtual-pipeline chunks), in layer order."""
    from .handle import handle_of

    routers = []
    for chunk in handle_of(model).chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                routers.append(router)
    return routers


def _replays(model: Any) -> list[Any]:
    routers = moe_routers(model)
    if not routers:
        raise ZooError("the model has no MoE layers")
    missing = [i for i, r in enumerate(routers) if getattr(r, "router_replay", None) is None]
    if missing:
        raise ZooError("routing replay needs the model built with overrides={'moe_enable_routing_replay': True}")
    if any(r.router_replay.router_replay_action is not None for r in routers):
        raise ZooError("the model's routers are already recording or replaying (a routing.record() / replay() block,"
                       " or train_step(replay_routes=)): these blocks do not nest")  # fmt: skip
    return [r.router_replay for r in routers]


def moe_layer_numbers(model: Any) -> list[int]:
    """The numbers of every MoE layer of the whole model (all pipeline stages), in layer order:
    1-based like ``router.layer_number``. Per-sequence routes (:func:`pack_routes`,
    :func:`microbatch_routes`, ``train_step(replay_routes=)``) hold one entry per such layer."""
    from .handle import handle_of

    arch = handle_of(model).arch_config
    if arch.moe is None:
        raise ZooError(f"{arch.architecture} has no MoE layers")
    return [i + 1 for i in range(arch.num_layers) if arch.moe.is_moe_layer(i)]


@dataclass
class Recording:
    """What :func:`record` collected: ``routes`` (per MoE layer, ``[tokens, top_k]`` expert
    indices of the last forward) and ``tokens_per_expert`` (per layer, ``[num_experts]`` counts
    summed over every forward inside the block)."""

    routes: list[torch.Tensor] = field(default_factory=list)
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def record(model: Any) -> Iterator[Recording]:
    """Record the experts every MoE layer chooses inside the block (see module docstring)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    out = Recording()
    with count_tokens(model) as counts:
        for r in replays:
            r.clear_indices()
            r.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield out
        finally:
            for r in replays:
                r.clear_router_replay_action()
    out.routes = [r.get_recorded_indices() for r in replays]
    out.tokens_per_expert = counts.tokens_per_expert
    if any(x is None for x in out.routes):
        raise ZooError("no forward ran inside mcore_zoo.routing.record(): nothing was recorded")
    out.routes = [x.detach().clone() for x in out.routes]


@contextlib.contextmanager
def replay(model: Any, routes: Sequence[torch.Tensor]) -> Iterator[None]:
    """Route every MoE layer to ``routes`` (one ``[tokens, top_k]`` tensor per layer) for the
    forwards run inside the block and their backward (see module docstring).

    Fails closed: a forward that routes more tokens than the routes have left raises
    :class:`~mcore_zoo.errors.ZooError` (naming the layer), and so does leaving the block with
    routes no forward consumed (routes for a longer pack, a forward that did not run) - the error
    names each such layer and how many of its tokens were left. Megatron-Core's stock router
    (numerics ``router="mcore"``) replays the same routes in every forward: each forward must
    route exactly as many tokens as they hold."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    replays = _replays(model)
    if len(routes) != len(replays):
        raise ZooError(f"{len(routes)} route tensors for {len(replays)} MoE layers")
    for router, idx in zip(routers, routes):
        if idx.dim() != 2 or idx.shape[1] != router.topk:
            raise ZooError(f"routes of layer {router.layer_number} have shape {tuple(idx.shape)};"
                           f" expected [tokens, {router.topk}]")  # fmt: skip
        if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < router.num_experts:
            raise ZooError(f"routes of layer {router.layer_number} name experts outside 0..{router.num_experts - 1}")
    forwards = [0] * len(routers)  # per router, forwards that replayed the stock way (whole target)
    hooks = []
    for i, (router, r, idx) in enumerate(zip(routers, replays, routes)):
        r.clear_indices()
        r.set_target_indices(idx)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        r.layer_number = int(router.layer_number)
        if not hasattr(r, "rows_left"):
            hooks.append(router.register_forward_pre_hook(functools.partial(_whole_target, forwards, i, r)))
    try:
        yield
        left = []
        for r, idx, done in zip(replays, routes, forwards):
            total = int(idx.shape[0])
            unused = r.rows_left() if hasattr(r, "rows_left") else (0 if done else total)
            if unused:
                left.append(f"layer {r.layer_number}: {unused} of its {total} tokens left")
    finally:
        for h in hooks:
            h.remove()
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()
    if left:
        raise ZooError("routing replay: the forwards left routes unused (routes for more tokens than they routed, or"
                       f" a forward that did not run): {'; '.join(left)}")  # fmt: skip


def _whole_target(forwards: list[int], i: int, replay: Any, router: Any, args: tuple) -> None:
    """Forward pre-hook of a stock router in replay: it replays its whole target each forward."""
    tokens = args[0].numel() // args[0].shape[-1]
    want = int(replay.target_topk_idx.shape[0])
    if tokens != want:
        raise ZooError(f"routing replay, layer {replay.layer_number}: this forward routes {tokens} tokens;"
                       f" Megatron-Core's stock router (router='mcore') replays all {want} rows of its routes"
                       " in every forward")  # fmt: skip
    forwards[i] += 1


def _padded_bounds(lengths: Sequence[int], align: int) -> torch.Tensor:
    padded = torch.tensor([-(-int(n) // align) * align for n in lengths], dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])


def context_parallel_routes(routes: Sequence[torch.Tensor], lengths: Sequence[int], *, align: int, cp_rank: int,
                            cp_size: int) -> list[torch.Tensor]:  # fmt: skip
    """Per-layer routes in pack order (sequences of ``lengths``, each padded to ``align``, e.g. a
    single-process :attr:`Recording.routes`) -> the rows context-parallel rank ``cp_rank`` routes,
    in its zigzag order (what it records, and what :func:`replay` needs there)."""
    from .packing import zigzag_index

    bounds = _padded_bounds(lengths, align)
    for r in routes:
        if r.shape[0] != int(bounds[-1]):
            raise ZooError(f"routes of {r.shape[0]} tokens; lengths {list(lengths)} with align={align} pack {int(bounds[-1])}")
    index = zigzag_index(bounds, cp_rank, cp_size)
    return [r[index.to(r.device)].contiguous() for r in routes]


def merge_context_parallel_routes(parts: Sequence[Sequence[torch.Tensor]], lengths: Sequence[int], *,
                                  align: int) -> list[torch.Tensor]:  # fmt: skip
    """Inverse of :func:`context_parallel_routes`: every CP rank's per-layer routes (``parts[r]``:
    rank ``r``'s :attr:`Recording.routes`, e.g. all-gathered over the CP group) -> per-layer routes
    in pack order, as one process records them."""
    from .packing import zigzag_index

    size = len(parts)
    bounds = _padded_bounds(lengths, align)
    index = torch.cat([zigzag_index(bounds, r, size) for r in range(size)])
    merged = []
    for layer in zip(*parts):
        rows = torch.cat(list(layer))
        if rows.shape[0] != int(bounds[-1]):
            raise ZooError(f"{size} ranks' routes cover {rows.shape[0]} tokens; lengths {list(lengths)} with"
                           f" align={align} pack {int(bounds[-1])}")  # fmt: skip
        out = rows.new_empty(rows.shape)
        out[index.to(rows.device)] = rows
        merged.append(out)
    return merged


def _route_shape(per_sequence: Sequence[torch.Tensor]) -> tuple[int, int]:
    """``(moe_layers, top_k)`` of per-sequence routes, each ``[moe_layers, len_i, top_k]``."""
    if not per_sequence:
        raise ZooError("no routes to pack")
    layers, topk = per_sequence[0].shape[0], per_sequence[0].shape[-1]
    for i, routes in enumerate(per_sequence):
        if routes.dim() != 3 or routes.shape[0] != layers or routes.shape[2] != topk:
            raise ZooError(f"routes of sequence {i} have shape {tuple(routes.shape)}; expected [{layers}, len, {topk}]")
    return layers, topk


def microbatch_routes(per_sequence: Sequence[torch.Tensor], microbatches: Sequence[tuple[Sequence[int], Any]], *,
                      layers: Optional[Sequence[int]] = None, rank: int = 0, size: int = 1, cp_rank: int = 0,
                      cp_size: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """Per-sequence routes -> what one rank's routers replay over several forwards (the
    micro-batches of a training step, in the order they run): per MoE layer ``[tokens, top_k]``.

    ``per_sequence[i]``: ``[moe_layers, len_i, top_k]`` expert indices of sequence ``i`` (a rollout
    engine's; :func:`unpack_routes` of a single-process record). ``microbatches``: one
    ``(members, cu_seqlens_padded)`` per forward: the sequences its pack holds first (indices into
    ``per_sequence``) and the pack's padded segment bounds
    (:attr:`mcore_zoo.packing.PackedBatch.cu_seqlens_padded`); alignment padding and segments
    after the members (a padding micro-batch, a pipeline's filler) get experts ``0..top_k-1``.
    Of each pack the rank routes the context-parallel rank's zigzag share (``cp_rank`` /
    ``cp_size``), then the sequence-parallel slice of it (``rank`` / ``size``: the TP rank and size
    under sequence parallelism); the packs' rows follow one another. ``layers``: the indices into
    the first axis of ``per_sequence`` of this rank's MoE layers (a pipeline stage's; default all).
    :func:`mcore_zoo.train_step` does this itself given ``replay_routes=``."""
    from .packing import zigzag_index

    num_layers, topk = _route_shape(per_sequence)
    keep = list(range(num_layers)) if layers is None else [int(x) for x in layers]
    if any(not 0 <= x < num_layers for x in keep):
        raise ZooError(f"layers {keep}: the routes hold {num_layers} MoE layers")
    device = per_sequence[0].device
    parts = []
    for members, cu_seqlens_padded in microbatches:
        bounds = torch.as_tensor(cu_seqlens_padded).tolist()
        if len(members) > len(bounds) - 1:
            raise ZooError(f"{len(members)} sequences in a pack of {len(bounds) - 1} segments")
        pack = torch.arange(topk, device=device).expand(len(keep), int(bounds[-1]), topk).clone()
        for k, member in enumerate(members):
            routes = per_sequence[member]
            n = routes.shape[1]
            if n > bounds[k + 1] - bounds[k]:
                slot = bounds[k + 1] - bounds[k]
                raise ZooError(f"routes of sequence {member} cover {n} tokens; its packed slot holds {slot}")
            pack[:, bounds[k] : bounds[k] + n] = routes[keep]
        if cp_size > 1:
            pack = pack[:, zigzag_index(torch.tensor(bounds), cp_rank, cp_size).to(device)]
        tokens = pack.shape[1]
        if tokens % size:
            raise ZooError(f"{tokens} packed tokens do not split over {size} sequence-parallel ranks")
        per_rank = tokens // size
        parts.append(pack[:, rank * per_rank : (rank + 1) * per_rank])
    return [layer.contiguous() for layer in torch.cat(parts, dim=1)]


def pack_routes(per_sequence: Sequence[torch.Tensor], *, align: int = 1, rank: int = 0, size: int = 1,
                cp_rank: int = 0, cp_size: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """Routes chosen elsewhere (a rollout engine: per sequence, ``[moe_layers, len_i, top_k]``
    expert indices) in the packed order :func:`replay` expects for one forward of their pack: per
    MoE layer ``[tokens, top_k]``, each sequence padded to a multiple of ``align`` as
    :func:`mcore_zoo.packing.pack_sequences` pads it (padding slots get experts ``0..top_k-1``;
    their outputs are discarded, but they count in the load-balancing loss).
    ``cp_rank``/``cp_size``: the context-parallel rank's zigzag share of every sequence
    (:func:`context_parallel_routes`; ``align`` a multiple of ``2 * cp_size``).
    ``rank``/``size``: the sequence-parallel slice a TP rank's routers see (``size`` = TP with
    sequence parallelism), of the CP share. Sequence-parallel slices are per forward: for several
    micro-batches use :func:`microbatch_routes`, or ``train_step(replay_routes=)``."""
    _route_shape(per_sequence)
    bounds = _padded_bounds([r.shape[1] for r in per_sequence], align)
    return microbatch_routes(per_sequence, [(range(len(per_sequence)), bounds)], rank=rank, size=size,
                             cp_rank=cp_rank, cp_size=cp_size)  # fmt: skip


def unpack_routes(routes: Sequence[torch.Tensor], lengths: Sequence[int], *, align: int = 1) -> list[torch.Tensor]:
    """Inverse of :func:`pack_routes` (routes in pack order: one rank without sequence or context
    parallelism, or :func:`merge_context_parallel_routes` of the CP ranks' records): per sequence
    ``[moe_layers, len_i, top_k]`` from per-layer packed routes (e.g. :attr:`Recording.routes`)."""
    stacked = torch.stack(list(routes))  # [layers, tokens, k]
    out, offset = [], 0
    for n in lengths:
        out.append(stacked[:, offset : offset + n].clone())
        offset += -(-n // align) * align
    if offset != stacked.shape[1]:
        raise ZooError(f"lengths {list(lengths)} with align={align} cover {offset} tokens, the routes {stacked.shape[1]}")
    return out


def routes_from_vllm(outputs: Sequence[Any], moe_layers: Sequence[int]) -> list[torch.Tensor]:
    """The experts vLLM routed each token of its requests to, as per-sequence routes for
    :func:`pack_routes`, :func:`microbatch_routes` or ``train_step(replay_routes=)``: one
    ``[len(moe_layers), len_i, top_k]`` int64 tensor per completion (the requests in order, each
    request's completions in order), sequence ``i`` being the request's prompt followed by that
    completion's tokens.

    ``outputs``: vLLM ``RequestOutput`` objects of an engine started with
    ``enable_return_routed_experts=True``, each completion carrying ``routed_experts``: a numpy
    array ``[tokens, num_hidden_layers, top_k]`` (vLLM 0.26; ``uint8`` up to 256 experts, else
    ``uint16``) indexed by the decoder layer's index, a dense layer's rows zero, one row per token
    that went through a forward: the prompt and every sampled token but the last. The last
    token's experts are unknown; its output predicts past the sequence, so it gets experts
    ``0..top_k-1`` (as padding does). ``moe_layers``: the model's MoE layer numbers, 1-based
    (:func:`moe_layer_numbers`). Refuses a completion without routes (the engine option off) or
    whose routes do not start at the prompt's first token (``routed_experts_prompt_start``)."""
    index = [int(n) - 1 for n in moe_layers]
    per_sequence = []
    for r, request in enumerate(outputs):
        for c, completion in enumerate(request.outputs):
            experts = getattr(completion, "routed_experts", None)
            if experts is None:
                raise ZooError(f"request {r}, completion {c}: no routed_experts; start vLLM with"
                               " enable_return_routed_experts=True")  # fmt: skip
            length = len(request.prompt_token_ids) + len(completion.token_ids)
            routes = torch.as_tensor(experts.astype("int64"))
            if routes.dim() != 3 or max(index, default=-1) >= routes.shape[1]:
                raise ZooError(f"request {r}, completion {c}: routed_experts of shape {tuple(routes.shape)} for MoE"
                               f" layers {list(moe_layers)}; expected [tokens, num_hidden_layers, top_k]")  # fmt: skip
            if routes.shape[0] not in (length - 1, length):
                raise ZooError(f"request {r}, completion {c}: routes for {routes.shape[0]} tokens, the sequence has"
                               f" {length} (routes from the prompt's first token: no routed_experts_prompt_start)")  # fmt: skip
            routes = routes[:, index].transpose(0, 1)  # [moe_layers, tokens, k]
            top_k = routes.shape[2]
            tail = torch.arange(top_k).expand(len(index), length - routes.shape[1], top_k)
            per_sequence.append(torch.cat([routes, tail], dim=1).contiguous())
    return per_sequence


@dataclass
class TokenCounts:
    """Per MoE layer, how many tokens each expert received (summed over the forwards counted)."""

    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def count_tokens(model: Any) -> Iterator[TokenCounts]:
    """Count, per MoE layer and expert, the tokens routed inside the block (from the routers'
    routing maps; padding positions of a pack included; forwards recomputed in the backward by
    activation recomputation are not counted again)."""
    from .families.moe.spec import in_backward

    routers = moe_routers(model)
    counts = TokenCounts([torch.zeros(r.config.num_moe_experts, dtype=torch.long) for r in routers])
    handles = []
    for i, router in enumerate(routers):

        def hook(_module: Any, _inputs: Any, output: Any, i: int = i) -> None:
            if in_backward():
                return
            routing_map = output[1]
            counts.tokens_per_expert[i] += routing_map.sum(dim=0).to("cpu", torch.long)

        handles.append(router.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def aux_losses(clear: bool = True) -> dict[str, torch.Tensor]:
    """Megatron-Core's tracked MoE auxiliary losses of the forwards run since the last call
    (``{name: per-layer values}``; the loss itself is already attached to the graph by the router
    when ``moe_aux_loss_coeff > 0``, so a trainer only logs these). ``clear`` empties the tracker,
    so the next model's values are sized by its own layer count (Megatron-Core's own clearing
    keeps the first model's)."""
    from .compat import take_moe_aux_losses

    return take_moe_aux_losses(clear)


__all__ = ["Recording", "TokenCounts", "aux_losses", "context_parallel_routes", "count_tokens",
           "merge_context_parallel_routes", "microbatch_routes", "moe_layer_numbers", "moe_routers", "pack_routes",
           "record", "replay", "routes_from_vllm", "unpack_routes"]
