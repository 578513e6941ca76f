"""The shared-buffer transport of a disaggregated refit: trainer and engine processes on one host.

With ``DisaggSender(..., transport="shared")`` no payload travels through a collective. Each
sender's :class:`~mcore_zoo.rollout.disagg.PayloadRing` is shared once with the engine ranks it
sends to (CUDA IPC on GPUs - the same GPU, or another GPU of the node, read over NVLink / PCIe -
shared memory on the CPU: :mod:`mcore_zoo.distributed.shared_buffers`); every refit the sender
packs a bucket into its ring as before and sends only the message headers (gloo channels, host
memory), and each engine rank reads its shards straight out of the sender's ring into its
parameters. Flow control is an :class:`~mcore_zoo.distributed.shared_buffers.AckBoard` per
channel: an engine rank marks each bucket written (its copies synchronised), and a sender packs
bucket ``i + 2`` into the buffer bucket ``i`` used only once every reader of bucket ``i`` has
marked it. An engine rank that stops a refit early (an integrity error) marks the whole refit
done before it drains the headers, so no sender waits on it.

The headers, their integrity checks and the errors are those of the broadcast transport.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..distributed.refit_group import RefitGroup
from ..distributed.shared_buffers import AckBoard, SharedBuffer, open_buffer
from .transfer import Route

#: how a refit's payloads travel: through the channels' broadcasts, or read from the sender's ring
TRANSPORTS = ("broadcast", "shared")


@dataclass(frozen=True)
class RingOffer:
    """What a sender gives the members of one of its channels, once: its ring's two buffers, the
    byte offset of each of the channel's routes in them (by ``(bucket, engine rank, sender)``),
    and the channel's ack board (a slot per engine member, in member order)."""

    buffers: tuple[SharedBuffer, ...]
    offsets: dict[tuple[int, int, int], int]
    acks: SharedBuffer


def _route_key(route: Route) -> tuple[int, int, int]:
    return (route.bucket, route.engine_rank, route.sender)


class SharedSender:
    """A sender's side: shares its ring and one ack board per channel (collective with the
    members, channel by channel in sorted order), then, every refit, :meth:`wait_free` before a
    bucket is packed and :meth:`finish` after the last one."""

    def __init__(self, group: RefitGroup, ring: Any, routes: Sequence[Route], channels: dict[tuple[int, int], tuple[int, ...]],
                 buckets: int) -> None:  # fmt: skip
        self.group, self.buckets, self.refits = group, buckets, 0
        self.boards: dict[tuple[int, int], AckBoard] = {}
        self.readers: dict[tuple[int, int], list[int]] = {}
        self.channels_of: dict[int, list[tuple[int, int]]] = {}
        for route in routes:
            key = (route.sender, route.engine_rank)
            if key not in self.channels_of.setdefault(route.bucket, []):
                self.channels_of[route.bucket].append(key)
        buffers = tuple(ring.shared)
        for key in sorted(channels):
            members = channels[key]
            board, shared = AckBoard.create(len(members) - 1)
            offsets = {_route_key(r): ring.offsets[_route_key(r)] for r in routes if (r.sender, r.engine_rank) == key}
            group.share_on(key, RingOffer(buffers, offsets, shared))
            self.boards[key], self.readers[key] = board, list(range(len(members) - 1))

    def wait_free(self, bucket: int) -> None:
        """Before bucket ``bucket`` is packed: every reader of bucket ``bucket - 2`` (the last user
        of its buffer) has written it."""
        if bucket >= 2:
            self._wait(bucket - 2)

    def finish(self) -> None:
        """After the last bucket's headers: every reader has written the refit's last two buckets."""
        for bucket in range(max(self.buckets - 2, 0), self.buckets):
            self._wait(bucket)
        self.refits += 1

    def _wait(self, bucket: int) -> None:
        target = self.refits * self.buckets + bucket + 1
        seconds = self.group.timeout.total_seconds()
        for key in self.channels_of.get(bucket, []):
            self.boards[key].wait(self.readers[key], target, seconds,
                                  f"refit channel {key}: bucket {bucket} not marked written")  # fmt: skip


class SharedReceiver:
    """An engine rank's side: takes each of its channels' offers (sorted order), maps each
    sender's ring once; then gives each route's payload (a view of the sender's ring) and marks
    buckets written (:meth:`done`), or the whole refit (:meth:`release`)."""

    def __init__(self, group: RefitGroup, channels: Sequence[tuple[tuple[int, int], Sequence[int]]], buckets: int) -> None:
        self.group, self.buckets, self.refits = group, buckets, 0
        device = group.device if group.device.type == "cuda" else torch.device("cpu")
        self.rings: dict[int, list[torch.Tensor]] = {}
        self.offsets: dict[tuple[int, int, int], int] = {}
        self.slots: list[tuple[AckBoard, int]] = []
        for key, members in sorted(channels):
            if group.rank not in members:
                continue
            offer: RingOffer = group.share_on(key, None)
            if key[0] not in self.rings:
                self.rings[key[0]] = [open_buffer(b, device) for b in offer.buffers]
            self.offsets.update(offer.offsets)
            self.slots.append((AckBoard.open(offer.acks), list(members).index(group.rank) - 1))

    def payload(self, route: Route) -> torch.Tensor:
        """``route``'s payload, in place in its sender's ring."""
        start = self.offsets[_route_key(route)]
        return self.rings[route.sender][route.bucket % 2][start : start + route.nbytes]

    def done(self, bucket: int) -> None:
        """Bucket ``bucket`` is written (the caller synchronised its copies)."""
        self._mark(self.refits * self.buckets + bucket + 1)

    def release(self) -> None:
        """This refit ends here for this rank: no sender waits on it for any of its buckets."""
        self._mark((self.refits + 1) * self.buckets)

    def finish(self) -> None:
        self.refits += 1

    def _mark(self, value: int) -> None:
        for board, slot in self.slots:
            board.raise_to(slot, value)

    def measure_read(self, sender: int, iters: int = 10) -> dict[str, float]:
        """The rate at which this rank reads sender ``sender``'s ring: median seconds and GB/s of
        ``iters`` copies of its first buffer into a local one (after two warm-ups) - the link the
        shared transport uses, as :func:`~mcore_zoo.rollout.disagg.measure_link` is the
        broadcast's."""
        source = self.rings[sender][0]
        target = torch.empty_like(source)
        return link_rate(lambda: target.copy_(source), source.numel(), target.device, iters)


def link_rate(move: Callable[[], Any], nbytes: int, device: torch.device, iters: int) -> dict[str, float]:
    """Median seconds and GB/s of ``iters`` calls of ``move`` (moving ``nbytes``), after two
    warm-ups, each timed between device synchronisations (CUDA; the host clock alone on the CPU)."""
    times = []
    for i in range(iters + 2):
        sync_device(device)
        t0 = time.perf_counter()
        move()
        sync_device(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}


def sync_device(device: torch.device) -> None:
    """Wait for the CUDA ``device``'s work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

__all__ = ["RingOffer", "SharedReceiver", "SharedSender", "TRANSPORTS", "link_rate", "sync_device"]
