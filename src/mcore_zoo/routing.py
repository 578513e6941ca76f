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
router keeps a single target (one forward per block). Routes chosen by a rollout engine (per
sequence, token and layer) are packed that way by :func:`pack_routes`; :func:`unpack_routes`
splits recorded routes per sequence. Activation recomputation of MoE layers replays the same
routes again (Megatron-Core's ``REPLAY_BACKWARD``).

Context parallelism: a CP rank's routers see its zigzag share of every sequence
(:func:`mcore_zoo.packing.zigzag_index`), so it records and must replay routes in that order.
:func:`context_parallel_routes` takes routes in pack order (a single-process record, or
:func:`pack_routes` without ``cp_size``) to one rank's order (``pack_routes(..., cp_rank=,
cp_size=)`` packs per-sequence routes straight into it); :func:`merge_context_parallel_routes`
puts the CP ranks' records back into pack order (the single-process record), which
:func:`unpack_routes` splits per sequence. The sequences of a pack are listed in the order the
forwards routed them: :func:`mcore_zoo.train_step` runs its micro-batches as
:func:`mcore_zoo.partition_by_tokens` groups them, each group's sequences in ascending order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

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
    return [r.router_replay for r in routers]


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
    forward run inside the block and its backward (see module docstring)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    if len(routes) != len(replays):
        raise ZooError(f"{len(routes)} route tensors for {len(replays)} MoE layers")
    for r, idx in zip(replays, routes):
        r.clear_indices()
        r.set_target_indices(idx)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


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


def pack_routes(per_sequence: Sequence[torch.Tensor], *, align: int = 1, rank: int = 0, size: int = 1,
                cp_rank: int = 0, cp_size: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """Routes chosen elsewhere (a rollout engine: per sequence, ``[moe_layers, len_i, top_k]``
    expert indices) in the packed order :func:`replay` expects: per MoE layer ``[tokens, top_k]``,
    each sequence padded to a multiple of ``align`` as :func:`mcore_zoo.packing.pack_sequences`
    pads it (padding slots get experts ``0..top_k-1``; their outputs are discarded).
    ``cp_rank``/``cp_size``: the context-parallel rank's zigzag share of every sequence
    (:func:`context_parallel_routes`; ``align`` a multiple of ``2 * cp_size``).
    ``rank``/``size``: the sequence-parallel slice a TP rank's routers see (``size`` = TP with
    sequence parallelism), of the CP share. Sequence-parallel slices are per forward: with
    several micro-batches, pack each one's sequences separately."""
    if not per_sequence:
        raise ZooError("no routes to pack")
    layers, _, topk = per_sequence[0].shape
    parts = []
    for routes in per_sequence:
        if routes.dim() != 3 or routes.shape[0] != layers or routes.shape[2] != topk:
            raise ZooError(f"routes of shape {tuple(routes.shape)}; expected [{layers}, len, {topk}]")
        n = routes.shape[1]
        pad = -(-n // align) * align - n
        filler = torch.arange(topk, dtype=routes.dtype).expand(layers, pad, topk)
        parts.append(torch.cat([routes, filler.to(routes.device)], dim=1))
    packed = list(torch.cat(parts, dim=1).long())
    if cp_size > 1:
        packed = context_parallel_routes(packed, [r.shape[1] for r in per_sequence], align=align, cp_rank=cp_rank,
                                         cp_size=cp_size)  # fmt: skip
    tokens = packed[0].shape[0]
    if tokens % size:
        raise ZooError(f"{tokens} packed tokens do not split over {size} sequence-parallel ranks")
    per_rank = tokens // size
    return [layer[rank * per_rank : (rank + 1) * per_rank].contiguous() for layer in packed]


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


@dataclass
class TokenCounts:
    """Per MoE layer, how many tokens each expert received (summed over the forwards counted)."""

    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def count_tokens(model: Any) -> Iterator[TokenCounts]:
    """Count, per MoE layer and expert, the tokens routed inside the block (from the routers'
    routing maps; padding positions of a pack included)."""
    routers = moe_routers(model)
    counts = TokenCounts([torch.zeros(r.config.num_moe_experts, dtype=torch.long) for r in routers])
    handles = []
    for i, router in enumerate(routers):

        def hook(_module: Any, _inputs: Any, output: Any, i: int = i) -> None:
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
           "merge_context_parallel_routes", "moe_routers", "pack_routes", "record", "replay", "unpack_routes"]
