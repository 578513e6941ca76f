"""Disaggregated refit: trainer processes send, engine processes receive, over one refit group.

Trainer and inference engine run as separate jobs (often on separate nodes). Both join a
:class:`~mcore_zoo.distributed.refit_group.RefitGroup` from a host and a port; then, every step::

    # every trainer rank                                # every engine rank (e.g. a vLLM worker)
    sender = DisaggSender(model, group, engine_tp=2,    receiver = EngineReceiver(group, index)
                          engine_dp=2)                   # ... once
    sender.send()                                       receiver.receive(sink)

:class:`DisaggSender` computes, once, the :class:`~mcore_zoo.rollout.plan.RefitPlan` (collective
over the pipeline group), what every trainer rank holds, and the
:class:`~mcore_zoo.rollout.transfer.TransferPlan` (who sends which engine shard: the rank whose
chunk holds it, gathered only where the engine's cut spans trainer shards); trainer rank 0
shares each engine rank's part, and every rank opens its broadcast channels. A refit then moves
only data: per bucket (the plan's bucket size) each trainer rank packs the shards it sends to
each engine rank into one buffer and broadcasts it to every DP replica of that engine rank; the
next bucket is packed while the previous one is on the wire (asynchronous broadcasts, two buckets
in flight at most). Shards are exact: the bytes an export would give, cut as the engine holds
them.

Integrity: every message is a header - ``[magic, kind, bucket, slots, bytes, checksum, sender,
engine rank]`` (int64; the checksum is the sum of the payload's 64-bit words modulo 2^64, computed
where the payload is, no host sync on the sender, one read of the payload) - then its payload;
after its last bucket every sender sends an end header on each of its channels. The receiver
knows from the plan which messages come in which order, so a dropped, duplicated or reordered
message, or a damaged payload, fails with an :class:`IntegrityError` naming the bucket, the sender
and the slots. The receiver drains the rest of the stream before it raises, so that the senders do
not wait on it.

The engine side hands each bucket to an engine sink with the
:class:`~mcore_zoo.rollout.adapter.EngineAdapter` interface (``begin`` / ``load_bucket`` /
``end``), for one engine rank: :class:`~mcore_zoo.rollout.adapter.DictAdapter` (the CPU stand-in:
the engine's tensors in its names and TP shards) or the vLLM worker's own
(:mod:`mcore_zoo.rollout.vllm_disagg`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ..distributed.export import tp_gather
from ..distributed.refit_group import RefitGroup, all_gather_objects, group_ranks
from ..distributed.shared_buffers import SharedBuffer, shared_empty
from ..errors import ZooError
from ..handle import handle_of
from ..model_groups import refuse_part_of_job
from ..weights.export import aligned_nbytes, export_dtype, export_rule, export_views, hf_copies
from ..weights.rules import narrow, narrow_view, split_shapes
from .adapter import EngineAdapter, RefitBucket
from .engine_format import EngineFormat, get_engine_format
from .plan import EngineTensor, RefitPlan, Slot, expert_piece
from .refit import Model, RefitStats, get_plan
from .disagg_shared import TRANSPORTS, SharedReceiver, SharedSender, link_rate, sync_device
from .transfer import EngineRoutes, Route, TransferPlan, holdings_of, packed_offsets, plan_transfer

#: first word of every message header
MAGIC = 0x5A4F4F52  # "ZOOR"
#: header kinds
DATA, END = 0, 1
HEADER_WORDS = 8


class IntegrityError(ZooError):
    """A refit message out of step (dropped, duplicated, reordered) or damaged, named by bucket,
    sender and slots."""


@dataclass(frozen=True)
class EngineSetup:
    """What the engine ranks learn from trainer rank 0, once (picklable plan data only): the
    plan's engine format (by name), architecture and TP size, every engine rank's routes, engine
    tensors and bucket count, and every channel with its members (sender first)."""

    architecture: str
    engine_format: str
    target_tp: int
    buckets: int
    routes: list[EngineRoutes]
    engine_tensors: list[list[EngineTensor]]
    channels: list[tuple[tuple[int, int], tuple[int, ...]]]
    transport: str = "broadcast"


def engine_plan_rank(index: int, target_tp: int, engine_tp: int) -> int:
    """The plan rank whose slots engine process ``index`` receives: its TP rank (processes are
    numbered replica by replica, ``index = replica * engine_tp + tp_rank``), or 0 for a plan that
    is not pre-split (every engine rank loads whole tensors)."""
    return index % engine_tp if target_tp > 1 else 0


def channel_members(trainers: int, engines: int, engine_tp: int, target_tp: int) -> dict[int, tuple[int, ...]]:
    """Per plan rank, the refit ranks of the engine processes that receive it (its DP replicas)."""
    out: dict[int, list[int]] = {}
    for index in range(engines):
        out.setdefault(engine_plan_rank(index, target_tp, engine_tp), []).append(trainers + index)
    return {rank: tuple(members) for rank, members in out.items()}


class DisaggSender:
    """The trainer side of a disaggregated refit (module docstring). Every trainer rank makes one
    (collective: the plan over the pipeline group, the holdings over the trainer's world, the
    engine's share over the refit group) and calls :meth:`send` every step.

    Args:
        model: a zoo-built model (chunk, list of chunks or handle), any TP / PP / VPP / EP layout.
        group: this rank's refit group membership (refit rank = the trainer's global rank).
        engine_format: the engine's format (default vLLM's).
        engine_tp / engine_dp: the engine's tensor-parallel size and its data-parallel replicas
            (``engine_tp * engine_dp`` engine processes in the group).
        dtype: cast before sending (``None``: the parameters' dtype).
        bucket_size: bytes per bucket, all engine ranks' shards counted (the plan's).
        transport: ``"broadcast"`` (the payloads through the channels: NCCL on GPUs, any hosts) or
            ``"shared"`` (every process on one host: the engine ranks read the payloads out of this
            rank's ring, CUDA IPC on GPUs - :mod:`~mcore_zoo.rollout.disagg_shared`).
    """

    def __init__(self, model: Model, group: RefitGroup, *, engine_format: Union[str, EngineFormat] = "vllm",
                 engine_tp: int = 1, engine_dp: int = 1, dtype: Optional[torch.dtype] = None,
                 bucket_size: Union[int, str] = "1GB", transport: str = "broadcast") -> None:  # fmt: skip
        if transport not in TRANSPORTS:
            raise ZooError(f"disaggregated refit: transport {transport!r} (one of {', '.join(TRANSPORTS)})")
        handle = self.handle = handle_of(model)
        handle.check_current()
        refuse_part_of_job(handle.placement, "disaggregated refit")
        placement = handle.placement
        if group.trainers != placement.world_size or group.rank != placement.rank:
            raise ZooError(f"disaggregated refit: refit rank {group.rank} of {group.trainers} trainer ranks, but this is"
                           f" trainer rank {placement.rank} of {placement.world_size}")  # fmt: skip
        if group.engines != engine_tp * engine_dp:
            raise ZooError(f"disaggregated refit: the refit group has {group.engines} engine process(es), engine TP"
                           f" {engine_tp} x DP {engine_dp} needs {engine_tp * engine_dp}")  # fmt: skip
        fmt = get_engine_format(engine_format)
        self.group, self.transport = group, transport
        self.plan: RefitPlan = get_plan(handle, engine_format=fmt, target_tp=engine_tp, dtype=dtype, bucket_size=bucket_size)
        self.steps = handle.export_steps()
        copies = hf_copies(handle.weight_map)
        self._origin = {copy: name for name, names in copies.items() for copy in names}
        mine = holdings_of(self.steps, copies, placement.rank, lambda step: group_ranks(step.tp_group))
        everyone = all_gather_objects(mine, None, placement.world_size) if placement.distributed else [mine]
        self.transfer: TransferPlan = plan_transfer(self.plan, [h for per in everyone for h in per], placement.world_size)
        members = channel_members(group.trainers, group.engines, engine_tp, self.plan.target_tp)
        channels = [(key, (key[0], *members[key[1]])) for key in self.transfer.channels()]
        setup = EngineSetup(self.plan.architecture, self.plan.engine_format.name, self.plan.target_tp, len(self.plan.buckets),
                            [self.transfer.for_engine_rank(r) for r in range(self.plan.target_tp)],
                            self.plan.engine_tensors, channels, transport)  # fmt: skip
        group.share(setup if group.rank == 0 else None)
        group.open_channels(channels, backend="gloo" if transport == "shared" else None)
        self._group_of = {h.step: h.group for h in mine}
        self._exported_steps = self._steps_exported_per_bucket()
        self.routes = self.transfer.sent_by(placement.rank)
        self._layouts: dict[tuple[int, int, int], tuple[list[Slot], list[int], int]] = {}
        self._sizes: dict[tuple[int, int, int], list[int]] = {}
        self._destinations: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._ring: Optional[PayloadRing] = None
        self._sources = _Sources(self)
        self._shared: Optional[SharedSender] = None
        if transport == "shared":  # the ring now, shared once with the engine ranks (collective per channel)
            self._ring = PayloadRing(self.routes, self._device, shared=True)
            mine = {key: members for key, members in channels if key[0] == placement.rank}
            self._shared = SharedSender(group, self._ring, self.routes, mine, len(self.plan.buckets))

    def _steps_exported_per_bucket(self) -> list[list[int]]:
        """Per bucket, this rank's steps whose rule its TP group exports gathered for that bucket
        (every rank of the group: the same steps in the same order)."""
        out = []
        for names in self.plan.buckets:
            wanted = set(names)
            out.append([i for i, step in enumerate(self.steps)
                        if any(n in wanted and n in self.transfer.exported.get(self._group_of[i], ())
                               for n in self._names_of(step))])  # fmt: skip
        return out

    def _names_of(self, step: Any) -> list[str]:
        names = list(step.bound.hf)
        return names + [copy for copy, origin in self._origin.items() if origin in names]

    # ------------------------------------------------------------------ one refit
    def send(self) -> RefitStats:
        """Send every bucket (module docstring); returns what this rank sent."""
        self.handle.check_current()
        sync_device(self.handle.device)
        t0 = time.perf_counter()
        by_bucket: dict[int, list[Route]] = {}
        for route in self.routes:
            by_bucket.setdefault(route.bucket, []).append(route)
        in_flight: deque[list[Any]] = deque()
        nbytes = 0
        for index in range(len(self.plan.buckets)):
            if self._shared is not None:
                self._shared.wait_free(index)  # its buffer's last bucket is written by every engine rank
            exported = self._export_bucket(index)
            chunks: dict[int, list[torch.Tensor]] = {}
            posted: list[Any] = []
            for route in by_bucket.get(index, []):
                payload = self._pack(route, exported, chunks)
                header = _header(DATA, index, len(route.positions), route, payload)
                posted += self._post((route.sender, route.engine_rank), index, header, payload)
                posted += [header, payload]  # alive until their broadcasts are done
                nbytes += route.nbytes
            del exported, chunks
            in_flight.append(posted)
            if len(in_flight) > 1:  # the previous bucket was on the wire while this one was packed
                _wait(in_flight.popleft())
        for key in sorted({(r.sender, r.engine_rank) for r in self.routes}):
            end = torch.tensor([MAGIC, END, len(self.plan.buckets), 0, 0, 0, key[0], key[1]], dtype=torch.int64, device=self._wire)
            in_flight.append([self.group.broadcast(key, end), end])
        while in_flight:
            _wait(in_flight.popleft())
        if self._shared is not None:
            self._shared.finish()
        sync_device(self.handle.device)
        slots = sum(len(r.positions) for r in self.routes)
        return RefitStats(len(self.plan.buckets), slots, nbytes, time.perf_counter() - t0, False, "disaggregated")

    @property
    def _device(self) -> torch.device:
        """Where payloads are packed."""
        return self.group.device if self.group.backend == "nccl" else torch.device("cpu")

    @property
    def _wire(self) -> torch.device:
        """Where channel messages live (host memory on gloo channels)."""
        return torch.device("cpu") if self.transport == "shared" else self._device

    def _post(self, key: tuple[int, int], bucket: int, header: torch.Tensor, payload: torch.Tensor) -> list[Any]:
        """Put one message on its channel: the header, then the payload (asynchronous). Shared
        transport: the header alone, once the payload is packed (its copy to the host waits for
        the packing on the device) - the engine ranks read the payload in this rank's ring."""
        if self.transport == "shared":
            header = header.cpu()
            return [self.group.broadcast(key, header), header]
        return [self.group.broadcast(key, header), self.group.broadcast(key, payload)]

    def _export_bucket(self, index: int) -> dict[int, dict[str, torch.Tensor]]:
        """The rules this rank's TP groups export gathered for bucket ``index`` (every rank of a
        group takes part in its gathers), by step."""
        out = {}
        for i in self._exported_steps[index]:
            step = self.steps[i]
            gather = tp_gather(step) if step.ctx.tp_size > 1 else None
            dtype = export_dtype(step, self.plan.dtype)  # a checkpoint-state buffer keeps its own
            out[i] = {name: (t if dtype is None else t.to(dtype))
                      for name, t in export_rule(step.bound, step.tensor().detach(), step.ctx, gather)}  # fmt: skip
        return out

    def _pack(self, route: Route, exported: dict[int, dict[str, torch.Tensor]], chunks: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """The payload of one route: its slots' shards packed in plan order (aligned) into the
        route's place in the :class:`PayloadRing` (views made once), copied in one batched call
        (``torch._foreach_copy_``: one dispatch for the route, not one per slot).
        Shards cut from this rank's own chunk of a parameter are views of it, resolved once and
        kept (:class:`_Sources`) while the parameter keeps its storage."""
        if self._ring is None:
            self._ring = PayloadRing(self.routes, self._device)
        payload = self._ring.payload(route)
        key = (route.bucket, route.engine_rank, route.sender)
        slots = self._layout(route)[0]
        destinations = self._destinations.get(key)
        if destinations is None:
            pieces = torch.split(payload, self._sizes[key])
            destinations = self._destinations[key] = [piece[: slot.nbytes].view(slot.dtype).view(slot.shape)
                                                      for piece, slot in zip(pieces, slots)]  # fmt: skip
        sources = self._sources.get(route)
        if sources is None or not sources.valid(self.steps):
            sources = self._sources.resolve(route, self._device)
        shards = [self._shard(self.transfer.assignments[(route.bucket, route.engine_rank, position)], slot, exported, chunks)
                  if shard is None else shard for position, slot, shard in zip(route.positions, slots, sources.shards)]  # fmt: skip
        # a shard keeps its own shape (a strided cut reshaped would be a copy made at every
        # refit): its slot's contiguous bytes viewed in that shape take the same row-major order
        destinations = [d if d.shape == t.shape else d.view(t.shape) for d, t in zip(destinations, shards)]
        torch._foreach_copy_(destinations, shards)
        return payload

    def _layout(self, route: Route) -> tuple[list[Slot], list[int], int]:
        """A route's slots, their byte offsets in its payload and the payload's size (cached)."""
        key = (route.bucket, route.engine_rank, route.sender)
        if key not in self._layouts:
            slots = [self.transfer.slots[route.bucket][route.engine_rank][p] for p in route.positions]
            offsets, total = packed_offsets(slots)
            self._layouts[key] = (slots, offsets, total)
            self._sizes[key] = [b - a for a, b in zip(offsets, offsets[1:] + [total])]
        return self._layouts[key]

    def _shard(self, how: Any, slot: Slot, exported: dict[int, dict[str, torch.Tensor]], chunks: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """One slot's bytes: cut from this rank's chunk of its rule source, or from the rule's
        gathered export; in the slot's shape (cast and moved by the payload copy)."""
        if how.cuts is None:
            piece = slot.cut(exported[how.step][self._origin.get(slot.hf_name, slot.hf_name)])
        else:
            step = self.steps[how.step]
            if how.step not in chunks:
                chunks[how.step] = list(step.bound.transform.split(step.tensor().detach(), step.ctx))
            piece = _cut_chunk(step, chunks[how.step][how.source], how.cuts, slot)
        _check_size(piece, slot)
        return piece.to(device=self._device)


def _chunk_views(step: Any, tensor: torch.Tensor) -> Optional[list[tuple[torch.Tensor, tuple[int, ...]]]]:
    """This rank's chunk of each HF piece of ``step``'s rule as a view of ``tensor`` with the
    piece's shape (``transform.split``'s, computed on a meta tensor), where the transform has
    trusted views (:func:`~mcore_zoo.weights.export.export_views`): QKV's q as ``[groups, q_rows,
    ...]``, which ``split`` reshapes into a copy. ``None`` where it has none."""
    views = export_views(step.bound, tensor, step.ctx, chunk=True)
    if views is None:
        return None
    shapes = split_shapes(step.bound.transform, tensor.shape, step.ctx, tensor.dtype)
    return [(view, shape) for (_, _, view), shape in zip(views, shapes)] if len(shapes) == len(views) else None


def _check_size(piece: torch.Tensor, slot: Slot) -> None:
    """A shard is copied in its own shape into its slot's bytes: it must have the slot's size."""
    if piece.numel() != math.prod(slot.shape):
        raise ZooError(f"refit: {_slot_name(slot)} is {tuple(slot.shape)}, its shard {tuple(piece.shape)}")


def _cut_chunk(step: Any, chunk: torch.Tensor, cuts: Any, slot: Slot) -> torch.Tensor:
    """A slot's piece of this rank's chunk of its rule source (``finish`` first, where the rule's
    transform has one: TP 1 only, a transfer plan gathers it otherwise)."""
    finish = getattr(step.bound.transform, "finish", None)
    if finish is not None:
        chunk = finish(chunk)
    piece = narrow(chunk, cuts)
    return expert_piece(piece) if slot.expert_slice else piece


class _Sources:
    """Per route, the shards that are views of this rank's own parameters (cut from its chunk, no
    gather, no copy on the way), resolved once: a refit then copies them without re-cutting. A
    route's views stay in use while every parameter they view has the storage, shape and strides
    it had when they were resolved (:meth:`_RouteSources.valid`, checked at every refit); else
    they are resolved again. Shards that are not such views (gathered exports, a ``finish`` that
    computes, another device) are ``None`` and cut at every refit."""

    def __init__(self, sender: "DisaggSender") -> None:
        self.sender = sender
        self.routes: dict[tuple[int, int, int], _RouteSources] = {}

    def get(self, route: Route) -> Optional["_RouteSources"]:
        return self.routes.get((route.bucket, route.engine_rank, route.sender))

    def resolve(self, route: Route, device: torch.device) -> "_RouteSources":
        sender = self.sender
        slots = sender._layout(route)[0]
        shards: list[Optional[torch.Tensor]] = []
        fingerprints: dict[int, tuple] = {}
        chunks: dict[int, list[torch.Tensor]] = {}
        views: dict[int, Optional[list[tuple[torch.Tensor, tuple[int, ...]]]]] = {}
        for position, slot in zip(route.positions, slots):
            how = sender.transfer.assignments[(route.bucket, route.engine_rank, position)]
            shard = None
            if how.cuts is not None:
                step = sender.steps[how.step]
                tensor = step.tensor().detach()
                if how.step not in views:
                    views[how.step] = _chunk_views(step, tensor)
                piece = None
                if views[how.step] is not None and not slot.expert_slice:  # a strided view where the transform has one
                    view, shape = views[how.step][how.source]
                    piece = narrow_view(view, shape, how.cuts)
                if piece is None:
                    if how.step not in chunks:
                        chunks[how.step] = list(step.bound.transform.split(tensor, step.ctx))
                    piece = _cut_chunk(step, chunks[how.step][how.source], how.cuts, slot)
                _check_size(piece, slot)
                if piece.device == device and _same_storage(piece, tensor):
                    shard = piece
                    fingerprints[how.step] = _fingerprint(tensor)
            shards.append(shard)
        resolved = _RouteSources(shards, fingerprints)
        self.routes[(route.bucket, route.engine_rank, route.sender)] = resolved
        return resolved


@dataclass
class _RouteSources:
    #: per slot of the route, a view of this rank's parameter, or ``None`` (cut at every refit)
    shards: list[Optional[torch.Tensor]]
    #: per export step whose parameter the views read, that parameter's storage, shape and strides
    fingerprints: dict[int, tuple]

    def valid(self, steps: Sequence[Any]) -> bool:
        return all(_fingerprint(steps[i].tensor()) == f for i, f in self.fingerprints.items())


def _fingerprint(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _same_storage(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


class EngineReceiver:
    """The engine side of a disaggregated refit, for engine process ``index`` (refit rank
    ``group.trainers + index``; ``index = replica * engine_tp + tp_rank``). Making it takes the
    plan trainer rank 0 shares and opens this rank's channels (collective with the trainer ranks'
    :class:`DisaggSender`); :meth:`receive` then takes one refit into an engine sink."""

    def __init__(self, group: RefitGroup, index: int, *, engine_tp: int = 1) -> None:
        if group.rank != group.trainers + index:
            raise ZooError(f"engine receiver: engine process {index} is refit rank {group.trainers + index}, not {group.rank}")
        self.group = group
        self.setup: EngineSetup = group.share(None)
        self.transport = self.setup.transport
        group.open_channels(self.setup.channels, backend="gloo" if self.transport == "shared" else None)
        self.rank = engine_plan_rank(index, self.setup.target_tp, engine_tp)
        self.routes = self.setup.routes[self.rank]
        self.plan = self._engine_plan()
        self._by_bucket: dict[int, list[Route]] = {}
        for route in self.routes.routes:
            self._by_bucket.setdefault(route.bucket, []).append(route)
        self._layouts: dict[tuple[int, int], tuple[list[Slot], list[int]]] = {}
        self._ring: Optional[PayloadRing] = None
        #: per bucket, this rank's (slot, shard view into the ring) in plan order (made once)
        self._items: dict[int, list[tuple[Slot, torch.Tensor]]] = {}
        self._shared: Optional[SharedReceiver] = None
        if self.transport == "shared":  # map each sender's ring (collective per channel, sorted)
            self._shared = SharedReceiver(group, self.setup.channels, self.setup.buckets)

    def measure_shared_read(self, sender: int, iters: int = 10) -> dict[str, float]:
        """Shared transport: this rank's read rate of trainer rank ``sender``'s ring
        (:meth:`~mcore_zoo.rollout.disagg_shared.SharedReceiver.measure_read`; no collective)."""
        if self._shared is None:
            raise ZooError("measure_shared_read: this refit uses the broadcast transport (measure_link)")
        return self._shared.measure_read(sender, iters)

    def _engine_plan(self) -> RefitPlan:
        """The plan as this engine rank sees it: its own slots and tensors (other ranks' empty),
        what a sink's ``begin`` checks and allocates from."""
        s, tp = self.setup, self.setup.target_tp
        slots: dict[str, list[list[Slot]]] = {}
        for bucket in self.routes.slots:
            for slot in bucket:
                slots.setdefault(slot.hf_name, [[] for _ in range(tp)])[self.rank].append(slot)
        tensors = [s.engine_tensors[r] if r == self.rank else [] for r in range(tp)]
        buckets = [list(dict.fromkeys(slot.hf_name for slot in bucket)) for bucket in self.routes.slots]
        return RefitPlan(s.architecture, get_engine_format(s.engine_format), tp, None, 0, [], slots, buckets, tensors)

    def receive(self, sink: EngineAdapter) -> RefitStats:
        """Receive one refit into ``sink`` (an :class:`~mcore_zoo.rollout.adapter.EngineAdapter`
        for this engine rank: ``begin(plan)``, ``load_bucket`` per bucket, ``end``). Raises
        :class:`IntegrityError` for a message out of step or damaged (after draining the stream)."""
        t0 = time.perf_counter()
        sink.begin(self.plan)
        nbytes = 0
        ended: set[int] = set()  # senders whose end header was taken
        received: list[tuple[Route, list[int], torch.Tensor, Any]] = []
        upcoming: list[tuple[Route, list[int], torch.Tensor, Any]] = []
        try:
            if self.setup.buckets:
                received = self._post_bucket(0, ended, [])
            for index in range(self.setup.buckets):
                slots = self.routes.slots[index]
                _wait([work for *_, work in received])
                # the next bucket's payloads travel while this one is checked and written
                upcoming = self._post_bucket(index + 1, ended, received) if index + 1 < self.setup.buckets else []
                for route, header, payload, _ in received:
                    self._check_payload(header, route, payload, slots)
                    nbytes += route.nbytes
                items: list[list[tuple[Slot, torch.Tensor]]] = [[] for _ in range(self.setup.target_tp)]
                items[self.rank] = self._bucket_items(index, received, slots)
                sink.load_bucket(RefitBucket(index, items))
                del items
                if self._shared is not None:  # the senders may reuse this bucket's buffers
                    sync_device(self.group.device)
                    self._shared.done(index)
                received, upcoming = upcoming, []
            for sender in self.routes.senders:
                header = self._take_header(sender)
                if header[1] == END:
                    ended.add(sender)
                else:
                    self._take_payload(sender, header)
                    raise IntegrityError(f"engine rank {self.rank}: after the last bucket ({self.setup.buckets - 1}), trainer rank"
                                         f" {sender} sent another message: {_describe(header, self._slots_of(header))}"
                                         " (duplicated?)")  # fmt: skip
        except IntegrityError:
            _wait([work for *_, work in received + upcoming])
            if self._shared is not None:
                self._shared.release()
            self._drain(ended)
            raise
        finally:
            if self._shared is not None:
                self._shared.finish()
        sink.end()
        slots = sum(len(r.positions) for r in self.routes.routes)
        return RefitStats(self.setup.buckets, slots, nbytes, time.perf_counter() - t0, False, "disaggregated")

    @property
    def _device(self) -> torch.device:
        """Where payloads are received."""
        return self.group.device if self.group.backend == "nccl" else torch.device("cpu")

    @property
    def _wire(self) -> torch.device:
        """Where channel messages live (host memory on gloo channels)."""
        return torch.device("cpu") if self.transport == "shared" else self._device

    def _post_bucket(self, index: int, ended: set[int], pending: list[Any]) -> list[tuple[Route, list[int], torch.Tensor, Any]]:
        """Take the headers of bucket ``index``'s messages and post their payloads' receives
        (asynchronous); a header out of step raises :class:`IntegrityError` once the payloads
        posted so far (``pending``: the bucket before) and the one it announces were taken."""
        slots = self.routes.slots[index]
        received: list[tuple[Route, list[int], torch.Tensor, Any]] = []
        for route in self._by_bucket.get(index, []):
            header = self._take_header(route.sender)
            if not self._fits(header, route):
                _wait([work for *_, work in pending + received])
                if header[1] == END:
                    ended.add(route.sender)
                self._take_payload(route.sender, header)
                self._check_header(header, route, slots)
            if self._shared is not None:  # in the sender's ring already
                received.append((route, header, self._shared.payload(route), None))
                continue
            if self._ring is None:
                self._ring = PayloadRing(self.routes.routes, self._device)
            payload = self._ring.payload(route)
            received.append((route, header, payload, self.group.broadcast((route.sender, self.rank), payload)))
        return received

    def _bucket_items(self, index: int, received: list[tuple[Route, list[int], torch.Tensor, Any]],
                      slots: list[Slot]) -> list[tuple[Slot, torch.Tensor]]:  # fmt: skip
        """Bucket ``index``'s ``(slot, shard)`` pairs of this rank in plan order: views into the
        ring's payloads, made at the first refit and the same tensors at every later one (so an
        engine sink's copy table keyed by them stays valid)."""
        items = self._items.get(index)
        if items is None:
            shards: list[Optional[torch.Tensor]] = [None] * len(slots)
            for route, _, payload, _ in received:
                for position, slot, start in zip(route.positions, *self._layout(route, slots)):
                    shards[position] = payload[start : start + slot.nbytes].view(slot.dtype).view(slot.shape)
            items = self._items[index] = [(slot, shard) for slot, shard in zip(slots, shards) if shard is not None]
        return items

    def _layout(self, route: Route, slots: list[Slot]) -> tuple[list[Slot], list[int]]:
        """A route's slots and their byte offsets in its payload (cached)."""
        key = (route.bucket, route.sender)
        if key not in self._layouts:
            chosen = [slots[p] for p in route.positions]
            self._layouts[key] = (chosen, packed_offsets(chosen)[0])
        return self._layouts[key]

    def _take_header(self, sender: int) -> list[int]:
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self._wire)
        self.group.broadcast((sender, self.rank), header).wait()
        return header.tolist()

    def _slots_of(self, header: list[int]) -> list[Slot]:
        bucket = header[2]
        return self.routes.slots[bucket] if 0 <= bucket < len(self.routes.slots) else []

    def _fits(self, header: list[int], route: Route) -> bool:
        """Whether ``header`` is the one ``route`` expects next."""
        expected = (MAGIC, DATA, route.bucket, len(route.positions), route.nbytes)
        return tuple(header[:5]) == expected and header[6] == route.sender and header[7] == self.rank

    def _check_header(self, header: list[int], route: Route, slots: list[Slot]) -> None:
        if not self._fits(header, route):
            first = slots[route.positions[0]]
            raise IntegrityError(f"engine rank {self.rank}: bucket {route.bucket} from trainer rank {route.sender}: expected"
                                 f" {len(route.positions)} slot(s) from {_slot_name(first)} ({route.nbytes} bytes), got"
                                 f" {_describe(header, self._slots_of(header))} (a message dropped, duplicated or out of order)")  # fmt: skip

    def _check_payload(self, header: list[int], route: Route, payload: torch.Tensor, slots: list[Slot]) -> None:
        got = int(_checksum(payload))
        if got != header[5]:
            names = [_slot_name(slots[p]) for p in route.positions]
            raise IntegrityError(f"engine rank {self.rank}: bucket {route.bucket} from trainer rank {route.sender}: checksum"
                                 f" {got} != {header[5]} over slot(s) {names[0]} .. {names[-1]} (payload damaged)")  # fmt: skip

    def _take_payload(self, sender: int, header: list[int]) -> None:
        """Take (and drop) the payload a header announces, so that the stream stays in step."""
        if header[0] == MAGIC and header[1] == DATA and header[4] > 0 and self.transport != "shared":
            payload = torch.empty(int(header[4]), dtype=torch.uint8, device=self._device)
            self.group.broadcast((sender, self.rank), payload).wait()

    def _drain(self, ended: set[int]) -> None:
        """Take every sender's remaining messages up to its end header (so that no sender waits
        on this rank), ignoring their content; ``ended``: senders whose end header was taken."""
        for sender in self.routes.senders:
            while sender not in ended:
                header = self._take_header(sender)
                if header[1] == END or header[0] != MAGIC:
                    ended.add(sender)
                self._take_payload(sender, header)


class PayloadRing:
    """The message payloads of one side of a refit, in two buffers allocated once: bucket ``i``'s
    routes (this rank's) live in buffer ``i % 2``, each at a fixed offset, so the views cut from
    them - the sender's packing destinations, the receiver's shards and an engine's copy table
    keyed by those - are the same tensors at every refit.

    Reuse is safe because two buckets are in flight at most: the sender waits on bucket ``i - 1``'s
    broadcasts before it packs bucket ``i + 1``, and the receiver writes bucket ``i - 1`` into the
    engine before it posts bucket ``i + 1``'s receives (ordered on the device's stream with NCCL,
    on the host with gloo). Memory: the two largest buckets' messages of this rank, as when each
    payload was allocated for its bucket, but kept between refits. ``shared``: buffers other
    processes of the host can map (:func:`~mcore_zoo.distributed.shared_buffers.shared_empty`)."""

    def __init__(self, routes: Iterable[Route], device: torch.device, shared: bool = False) -> None:
        self.offsets: dict[tuple[int, int, int], int] = {}
        ends: dict[int, int] = {}
        for route in routes:
            start = ends.get(route.bucket, 0)
            self.offsets[(route.bucket, route.engine_rank, route.sender)] = start
            ends[route.bucket] = start + aligned_nbytes(route.nbytes)
        # at least one aligned word each: a buffer of no bytes has no storage to share (a one-bucket refit)
        sizes = [max((end for bucket, end in ends.items() if bucket % 2 == parity), default=aligned_nbytes(1))
                 for parity in (0, 1)]  # fmt: skip
        made = [shared_empty(size, device) if shared else (torch.empty(size, dtype=torch.uint8, device=device), None)
                for size in sizes]  # fmt: skip
        self.buffers = [buffer for buffer, _ in made]
        #: with ``shared``: each buffer's handle for other processes of the host
        self.shared: list[Optional[SharedBuffer]] = [handle for _, handle in made]

    def payload(self, route: Route) -> torch.Tensor:
        """``route``'s payload: ``route.nbytes`` bytes of its bucket's buffer (contiguous)."""
        start = self.offsets[(route.bucket, route.engine_rank, route.sender)]
        return self.buffers[route.bucket % 2][start : start + route.nbytes]


def measure_link(group: RefitGroup, key: tuple[int, int], nbytes: int = 2**30, iters: int = 10) -> dict[str, float]:
    """The broadcast bandwidth of one refit channel ``key`` (the backend's own: NCCL on GPU),
    as the refit uses it: median seconds and GB/s of ``iters`` broadcasts of ``nbytes`` (after two
    warm-ups). Every member of the channel calls it (collective)."""
    device = group.device if group.backend == "nccl" else torch.device("cpu")
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return link_rate(lambda: group.broadcast(key, buffer).wait(), nbytes, device, iters)


def _header(kind: int, bucket: int, count: int, route: Route, payload: torch.Tensor) -> torch.Tensor:
    """A message header on the payload's device, its checksum computed there (no host sync: on
    CUDA the fields go up from pinned memory without waiting for the stream, where a copy from
    pageable memory - ``torch.tensor(..., device=...)`` - first waits for the packing before it,
    0.6 ms per 1 GB bucket in an H100 trace)."""
    header = torch.tensor([MAGIC, kind, bucket, count, payload.numel(), 0, route.sender, route.engine_rank], dtype=torch.int64)
    if payload.device.type == "cuda":
        header = header.pin_memory().to(payload.device, non_blocking=True)
    else:
        header = header.to(payload.device)
    header[5:6].copy_(_checksum(payload).reshape(1))
    return header


def _checksum(payload: torch.Tensor) -> torch.Tensor:
    """The sum of the payload's 64-bit words, modulo 2^64 (int64 additions wrap; the result does
    not depend on the order of the additions, so sender and receiver agree on any device). The
    payload is a multiple of 64 bytes. The words are summed as they are: asking ``sum`` for another
    dtype (``view(int32).sum(dtype=int64)``) first writes a converted copy of the whole payload -
    on an H100 that copy and its sum took 2.0 - 2.4 ms per GB on each side, 1.2 - 1.6 ms of it the
    copy (2026-11-27 trace of ``bench/gpu/disagg_refit_bench.py``)."""
    return payload.view(torch.int64).sum()


def _slot_name(slot: Slot) -> str:
    return slot.name + ("" if slot.expert is None else f"[expert {slot.expert}]") + (f" rows {slot.offset}.." if slot.offset else "")


def _describe(header: list[int], slots: Sequence[Slot]) -> str:
    if header[0] != MAGIC:
        return "no refit header"
    if header[1] == END:
        return f"the end of trainer rank {header[6]}'s stream"
    first = f", its bucket starts at {_slot_name(slots[0])}" if slots else ""
    return f"bucket {header[2]} ({header[3]} slot(s), {header[4]} bytes){first}"


def _wait(items: list[Any]) -> None:
    for item in items:
        if item is not None and not isinstance(item, torch.Tensor):
            item.wait()


__all__ = ["DisaggSender", "EngineReceiver", "EngineSetup", "IntegrityError", "PayloadRing", "engine_plan_rank",
           "channel_members", "measure_link"]
