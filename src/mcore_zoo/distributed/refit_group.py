"""The process group of a disaggregated refit: trainer ranks and engine ranks, made from a host and a port.

A trainer job and an inference engine are separate jobs, each with its own ``torch.distributed``
world (vLLM's workers own theirs). A refit joins them in a group of its own, built from a
``TCPStore`` (the trainer's rank 0 hosts it) without touching either default group - as vLLM's
``StatelessProcessGroup`` does for its RLHF examples, with torch's own process-group classes so
that a trainer without vLLM installed can join:

* refit ranks ``0 .. trainers - 1`` are the trainer's global ranks, ``trainers ..`` the engine's
  processes (engine process ``i`` is refit rank ``trainers + i``);
* a *control* group over every rank (gloo, CPU tensors) carries the plan once
  (:meth:`RefitGroup.share`);
* one *channel* per ``(sender, engine rank)`` with traffic: the sender and every DP replica of
  that engine rank, the sender first (gloo on CPU, NCCL on GPU). A message is one ``broadcast``
  on its channel: every replica gets every byte from one send, not one send per replica.

Every member of a channel must open it (:meth:`RefitGroup.open_channels`, in the same sorted
order on every rank); the engine side learns the channels from the plan it is shared.
"""

from __future__ import annotations

import datetime
import io
import pickle
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import ZooError


class RefitGroup:
    """One process's membership of a refit group (module docstring). Make it with :meth:`join`."""

    def __init__(self, store: Any, rank: int, trainers: int, engines: int, backend: str,
                 device: torch.device, timeout: datetime.timedelta) -> None:  # fmt: skip
        self.store, self.rank, self.trainers, self.engines = store, rank, trainers, engines
        self.backend, self.device, self.timeout = backend, device, timeout
        self.control = _process_group("gloo", dist.PrefixStore("zoo-refit/control", store), rank, trainers + engines, timeout)
        self.channels: dict[tuple[int, int], Any] = {}

    @classmethod
    def join(cls, host: str, port: int, *, rank: int, trainers: int, engines: int, backend: Optional[str] = None,
             device: Optional[torch.device] = None, timeout: float = 300.0) -> "RefitGroup":  # fmt: skip
        """Join the refit group at ``host:port`` as refit rank ``rank`` (trainer global rank, or
        ``trainers + i`` for engine process ``i``); refit rank 0 hosts the store. ``backend``:
        ``"nccl"`` when ``device`` is a CUDA device (default: the current one when CUDA is
        available), else ``"gloo"``. Blocks until every rank has joined."""
        if not 0 <= rank < trainers + engines:
            raise ZooError(f"refit group: rank {rank} is not in [0, {trainers + engines})")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(host, int(port), trainers + engines, rank == 0, wait)
        return cls(store, rank, trainers, engines, backend, device, wait)

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainers

    def share(self, value: Any, root: int = 0) -> Any:
        """``value`` of refit rank ``root`` on every rank (pickled over the control group: what
        the trainer ranks planned, for the engine ranks)."""
        return _share_object(self.control, value, root, self.rank == root)

    def open_channels(self, channels: Sequence[tuple[tuple[int, int], Sequence[int]]], backend: Optional[str] = None) -> None:
        """Open the channels this rank is a member of: ``(key, members)`` with the sender first,
        given in the same (sorted) order on every rank. ``backend``: the channels' (default the
        group's; ``"gloo"`` for channels that carry only small host messages, as the shared-buffer
        transport's do)."""
        for key, members in channels:
            if self.rank not in members or key in self.channels:
                continue
            store = dist.PrefixStore(f"zoo-refit/channel/{key[0]}/{key[1]}", self.store)
            rank, size = list(members).index(self.rank), len(members)
            self.channels[key] = _process_group(backend or self.backend, store, rank, size, self.timeout)

    def share_on(self, key: tuple[int, int], value: Any) -> Any:
        """``value`` of channel ``key``'s sender on every member of the channel (pickled, on CPU
        tensors: the channel's backend must be gloo)."""
        return _share_object(self.channels[key], value, 0, self.rank == key[0])  # the sender: member 0

    def broadcast(self, key: tuple[int, int], tensor: torch.Tensor) -> Any:
        """Broadcast ``tensor`` from the sender of channel ``key`` to its other members; returns
        the work to ``wait()`` on (asynchronous)."""
        try:
            group = self.channels[key]
        except KeyError:
            raise ZooError(f"refit group: rank {self.rank} has no channel {key} (open_channels first)") from None
        return _broadcast(group, tensor, 0)


class _PlanUnpickler(pickle.Unpickler):
    """What :meth:`RefitGroup.share` / :meth:`RefitGroup.share_on` carry: the zoo's rollout plan
    types, shared-buffer handles, builtin containers and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("mcore_zoo.rollout.") or (module == "builtins" and name in _BUILTINS):
            return super().find_class(module, name)
        if module == "mcore_zoo.distributed.shared_buffers" and name == "SharedBuffer":
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ZooError(f"refit group: refused to unpickle {module}.{name} (not a refit plan type)")


_BUILTINS = frozenset({"tuple", "list", "dict", "set", "frozenset", "int", "str", "float", "bool", "slice", "bytes"})


def group_ranks(group: Any) -> list[int]:
    """The global ranks of a ``torch.distributed`` group of this process's world, in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def _share_object(group: Any, value: Any, root: int, is_root: bool) -> Any:
    """``value`` of ``group``'s rank ``root`` on every member (its pickle's length, then its bytes,
    broadcast on CPU tensors; unpickled with :class:`_PlanUnpickler`)."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast(group, length, root).wait()
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_root else torch.empty(int(length), dtype=torch.uint8)
    _broadcast(group, buffer, root).wait()
    return value if is_root else _PlanUnpickler(io.BytesIO(buffer.numpy().tobytes())).load()


def _broadcast(group: Any, tensor: torch.Tensor, root: int) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    return group.broadcast([tensor], options)


def _process_group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A process group object of ``size`` ranks over ``store`` (not registered as a default or a
    ``new_group``: nothing of the process's own world is touched)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ZooError(f"refit group: backend {backend!r} (gloo or nccl)")


def all_gather_objects(value: Any, group: Any, size: int) -> list[Any]:
    """``value`` of every rank of ``group`` (``size`` ranks; ``None``: the world), in rank order."""
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value, group=group)
    return out


__all__ = ["RefitGroup", "all_gather_objects", "group_ranks"]
