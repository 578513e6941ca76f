"""Refit into SGLang engines in other processes: SGLang's ``update_weights_from_distributed``.

An SGLang engine on other GPUs - or other nodes - receives weights by broadcast, in a process
group it joins when asked (``init_weights_update_group``): the trainer is rank 0 of that group,
the engine's TP ranks are ``rank_offset + tp_rank``. For each bucket the engine is told the
tensors' names, dtypes and shapes (``update_weights_from_distributed(names, dtypes, shapes,
group_name, flush_cache, load_format="flattened_bucket")``), allocates them, receives their bytes
as one flat ``uint8`` tensor in one broadcast from rank 0 (SGLang's ``FlattenedTensorBucket``:
each tensor's bytes in order, no padding) and loads them with its model's ``load_weights`` - its
own fusion and TP slicing, as for ``update_weights_from_tensor``. The call returns once every
engine rank has loaded the bucket.

:class:`SGLangBroadcastAdapter` is rank 0, on the trainer rank that :func:`mcore_zoo.refit` feeds
(``receiver``): whole HF tensors (:data:`~mcore_zoo.rollout.engine_format.HF_NAMES`, as
:class:`~mcore_zoo.rollout.sglang.SGLangAdapter`), one broadcast per bucket. Several engines (DP
replicas, each its own SGLang server) join one group at consecutive rank offsets, so one
broadcast gives every replica every byte (NCCL's tree / ring, not one send per replica).

The trainer's side of the group is made as SGLang's ``init_custom_process_group`` makes the
engine's - a ``TCPStore`` at ``host:port`` (hosted here, rank 0), prefixed with the group name,
one backend per device type of the group's backend - but from torch's process-group classes
directly: nothing is registered in this process's ``torch.distributed`` world, and a trainer whose
default group is bound to a device does not try to split the new communicator from it.

``engine`` objects: an in-process ``sglang.Engine`` or :class:`SGLangServer` (a server started with
``python -m sglang.launch_server``, over HTTP) - anything with ``init_weights_update_group``,
``update_weights_from_distributed`` and ``destroy_weights_update_group`` as they have them. With
several engines their calls run on threads (a collective needs every member at once); in-process
``sglang.Engine`` objects share one asyncio loop and cannot be called concurrently, so several
replicas are servers.

Pause / resume: SGLang's tokenizer manager takes its model-update writer lock for the call -
requests in flight finish first, new ones wait - and with ``flush_cache`` (the last bucket only)
the radix cache is flushed, so no KV computed with the old weights is reused.
"""

from __future__ import annotations

import datetime
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import ZooError
from .adapter import RefitBucket
from .sglang import SGLangAdapter, check_answer

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan

#: SGLang's name for the flat-bytes bucket format of ``update_weights_from_distributed``
FLATTENED_BUCKET = "flattened_bucket"


class UpdateGroup:
    """Rank 0 of an SGLang weight-update group (module docstring): the store it hosts and one
    process-group backend per device type, as ``init_custom_process_group`` makes them on the
    engine's ranks. Construction blocks until every rank has connected (call it while the engines
    are asked to join, :meth:`SGLangBroadcastAdapter.connect` does)."""

    def __init__(self, host: str, port: int, world_size: int, group_name: str, backend: str,
                 timeout: datetime.timedelta) -> None:  # fmt: skip
        from torch.distributed.distributed_c10d import BackendConfig

        self.store = dist.TCPStore(host, int(port), world_size, True, timeout, multi_tenant=True)
        # init_custom_process_group: PrefixStore(group_name, store); _new_process_group_helper adds
        # "<group_name>/" and then "<device>/" per backend of the group - one backend (the first
        # device's) serving every device type when they all name the same one (gloo: cpu and cuda)
        prefix = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, self.store))
        self.backends: dict[str, Any] = {}
        devices = BackendConfig(dist.Backend(backend)).get_device_backend_map()
        shared = len(set(devices.values())) == 1
        for device, name in devices.items():
            if shared and self.backends:
                self.backends[device] = next(iter(self.backends.values()))
                continue
            store = dist.PrefixStore(f"{device}/", prefix)
            if name == dist.Backend.NCCL:
                options = dist.ProcessGroupNCCL.Options()
                options.is_high_priority_stream = False
                options._timeout = timeout
                self.backends[device] = dist.ProcessGroupNCCL(store, 0, world_size, options)
            elif name == dist.Backend.GLOO:
                self.backends[device] = dist.ProcessGroupGloo(store, 0, world_size, timeout)
            else:
                raise ZooError(f"SGLang weight-update group: backend {name!r} for {device} (nccl or gloo)")

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Broadcast ``tensor`` from this rank (0) to the group; returns the work (asynchronous)."""
        backend = self.backends.get(tensor.device.type)
        if backend is None:
            raise ZooError(f"SGLang weight-update group has no backend for {tensor.device.type} tensors"
                           f" (it has {sorted(self.backends)})")  # fmt: skip
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return backend.broadcast([tensor], options)

    def close(self, abort: bool = False) -> None:
        """Shut the backends down (``abort``: abort them - a broadcast no engine took is pending)."""
        for backend in {id(b): b for b in self.backends.values()}.values():
            end = getattr(backend, "abort" if abort else "shutdown", None) or getattr(backend, "shutdown", None)
            if end is not None:
                try:
                    end()
                except Exception:  # noqa: BLE001 - closing: a backend already torn down is fine
                    pass
        self.backends = {}
        self.store = None  # the TCPStore (and its port) goes with the last reference to it


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[str], list[str], list[list[int]]]:
    """SGLang's flattened bucket of ``[(name, tensor)]``: ``(each tensor's bytes in order in one
    uint8 tensor on their device, names, dtype names as ``torch`` spells them, shapes)``."""
    if not named:
        raise ZooError("an SGLang bucket needs at least one tensor")
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    return flat, [n for n, _ in named], dtypes, [list(t.shape) for _, t in named]


class SGLangBroadcastAdapter(SGLangAdapter):
    """Refit into SGLang engines in other processes by SGLang's ``update_weights_from_distributed``
    (module docstring).

    ``engines``: one engine or a list (DP replicas), ``engine_tp``: each engine's TP size (an int
    for all, or one per engine) - its ranks in the group. ``host`` / ``port``: where this process
    hosts the group's store (reachable from the engines; a free port). ``backend``: the group's
    (default ``"nccl"`` on CUDA, else ``"gloo"``); ``device``: where buckets are packed and sent
    from (default the current CUDA device, else the CPU). ``timeout``: seconds for the group's
    rendezvous and collectives.

    :meth:`connect` (called by the first refit when not called before) forms the group; one refit
    sends one broadcast per bucket; ``end`` raises unless every tensor of the plan reached every
    engine once. After a failed bucket the group holds a broadcast no engine takes: :meth:`close`,
    then connect again (another ``group_name`` or port) before the next refit.

    Each bucket's broadcast is posted from a thread of its own while the request asks the engines
    for the bucket (NCCL makes the group's communicator at the first collective, which blocks until
    the engine ranks join it - inside that request); the caller's stream waits for the broadcast
    before the bucket's bytes are freed. ``overlap`` (default: on when every engine is an
    :class:`SGLangServer`): the request runs on a thread too, and ``load_bucket`` returns once the
    bucket is packed - the next bucket's export and packing run while the engines receive and
    load this one (one request in flight: SGLang takes them one at a time). Off, the request runs
    in the caller's thread (an in-process ``sglang.Engine`` runs its asyncio loop there)."""

    def __init__(self, engines: Union[Any, Sequence[Any]], *, host: str, port: int, engine_tp: Union[int, Sequence[int]] = 1,
                 group_name: str = "mcore-zoo-refit", backend: Optional[str] = None,
                 device: Optional[Union[str, torch.device]] = None, flush_cache: bool = True,
                 timeout: float = 600.0, overlap: Optional[bool] = None) -> None:  # fmt: skip
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.engines:
            raise ZooError("SGLangBroadcastAdapter needs at least one engine")
        super().__init__(self.engines[0], flush_cache=flush_cache)
        tps = [engine_tp] * len(self.engines) if isinstance(engine_tp, int) else list(engine_tp)
        if len(tps) != len(self.engines) or any(t < 1 for t in tps):
            raise ZooError(f"engine_tp: one TP size >= 1 per engine ({len(self.engines)} engine(s)), got {engine_tp!r}")
        self.engine_tp = tps
        #: each engine's first rank in the group (SGLang's ``rank_offset``): the trainer is rank 0
        self.rank_offsets = [1 + sum(tps[:i]) for i in range(len(tps))]
        self.world_size = 1 + sum(tps)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.host, self.port, self.group_name = host, int(port), group_name
        self.timeout = datetime.timedelta(seconds=timeout)
        self.group: Optional[UpdateGroup] = None
        self._broken: Optional[str] = None
        self._pool = ThreadPoolExecutor(len(self.engines)) if len(self.engines) > 1 else None
        if overlap is None:  # an in-process sglang.Engine runs its asyncio loop in the caller's thread
            overlap = all(isinstance(engine, SGLangServer) for engine in self.engines)
        self.overlap = overlap
        #: with ``overlap``: the thread that sends each bucket's request while the caller prepares the next
        self._requests = ThreadPoolExecutor(1, thread_name_prefix="mcore-zoo-sglang-request") if overlap else None
        #: the bucket whose request and broadcast may still run: (what, names, request, broadcast)
        self._in_flight: Optional[tuple[str, list[str], Future, Future]] = None

    # ------------------------------------------------------------------ the group
    def connect(self) -> None:
        """Form the weight-update group: every engine's ``init_weights_update_group`` while this
        process hosts the store as rank 0. Raises naming the engine that refused."""
        if self.group is not None:
            return
        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["group"] = UpdateGroup(self.host, self.port, self.world_size, self.group_name, self.backend, self.timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                made["error"] = exc

        # a daemon thread: after an engine's refusal it is left waiting for ranks that never come
        # (until the timeout), and the refusal is raised at once
        maker = threading.Thread(target=make, name="mcore-zoo-sglang-group", daemon=True)
        maker.start()
        answers = self._call_all(lambda engine, i: engine.init_weights_update_group(
            master_address=self.host, master_port=self.port, rank_offset=self.rank_offsets[i],
            world_size=self.world_size, group_name=self.group_name, backend=self.backend))  # fmt: skip
        for i, answer in enumerate(answers):
            check_answer(answer, f"joining weight-update group {self.group_name!r} (engine {i}, rank offset {self.rank_offsets[i]})")
        maker.join(self.timeout.total_seconds())
        if "error" in made:
            raise ZooError(f"SGLang weight-update group {self.group_name!r} at {self.host}:{self.port}: {made['error']}") from made["error"]
        if "group" not in made:
            raise ZooError(f"SGLang weight-update group {self.group_name!r}: not every rank joined within {self.timeout}")
        self.group, self._broken = made["group"], None

    def close(self) -> None:
        """Leave the group: every engine's ``destroy_weights_update_group``, then this side's."""
        if self.group is None:
            return
        try:
            self._call_all(lambda engine, i: engine.destroy_weights_update_group(group_name=self.group_name))
        finally:
            self.group.close(abort=self._broken is not None)
            self.group, self._broken = None, None

    # ------------------------------------------------------------------ a refit
    def begin(self, plan: "RefitPlan") -> None:
        self._finish_in_flight()  # a refit that raised before its end: its last bucket first
        if self._broken:
            raise ZooError(f"SGLang weight-update group {self.group_name!r} is unusable after {self._broken}:"
                           " close() and connect to a new group first")  # fmt: skip
        self.connect()
        super().begin(plan)

    def load_bucket(self, bucket: RefitBucket) -> None:
        assert self.group is not None, "load_bucket before begin"
        named = bucket.named(0)
        flat, names, dtypes, shapes = flatten_bucket([(n, t.to(self.device)) for n, t in named])
        what = f"bucket {bucket.index} ({len(names)} tensor(s), {flat.numel()} bytes, first {names[0]!r})"
        flush = self.flush_cache and bucket.index == self._last
        packed = torch.cuda.current_stream(flat.device).record_event() if flat.is_cuda else None
        self._finish_in_flight()  # packed while it ran; one request in flight: SGLang takes them one at a time
        # posted from a thread of its own: NCCL makes the communicator at the first collective, and
        # that call blocks until every rank makes it - the engine ranks only do once asked for the
        # bucket, which the request does meanwhile (a daemon thread: one left blocked by an engine
        # that refused before receiving does not keep the process from exiting)
        posted: Future = Future()
        threading.Thread(target=self._post, args=(flat, packed, posted), name="mcore-zoo-sglang-send", daemon=True).start()

        def request() -> list[Any]:
            return self._call_all(lambda engine, i: engine.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=self.group_name, flush_cache=flush,
                load_format=FLATTENED_BUCKET))  # fmt: skip

        if self._requests is not None:  # answered while the caller prepares the next bucket
            asked = self._requests.submit(request)
        else:
            asked = Future()
            try:
                asked.set_result(request())
            except BaseException as exc:  # noqa: BLE001 - raised by _finish_in_flight, below
                asked.set_exception(exc)
        self._in_flight = (what, names, asked, posted)
        if self._requests is None:
            self._finish_in_flight()

    def end(self) -> None:
        self._finish_in_flight()
        super().end()

    def _finish_in_flight(self) -> None:
        """Wait for the bucket in flight: every engine's answer checked, its broadcast done (NCCL:
        the caller's stream waits for it before the bucket's bytes are freed)."""
        if self._in_flight is None:
            return
        what, names, asked, posted = self._in_flight
        self._in_flight = None
        try:
            for i, answer in enumerate(asked.result()):
                check_answer(answer, f"{what} (engine {i})")
            work = posted.result(self.timeout.total_seconds())
        except BaseException:
            self._broken = what
            raise
        work.wait()
        self._count_sent(names)

    def _post(self, flat: torch.Tensor, packed: Optional[torch.cuda.Event], posted: Future) -> None:
        """Broadcast ``flat`` (on a sender thread, after the caller's stream packed it); the work,
        or the error, into ``posted``."""
        try:
            assert self.group is not None
            if packed is not None:
                torch.cuda.set_device(flat.device)
                torch.cuda.current_stream(flat.device).wait_event(packed)
            posted.set_result(self.group.broadcast(flat))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            posted.set_exception(exc)

    def _call_all(self, call: Callable[[Any, int], Any]) -> list[Any]:
        """``call(engine, index)`` for every engine, at once (threads) when there are several."""
        if self._pool is None:
            return [call(self.engines[0], 0)]
        futures = [self._pool.submit(call, engine, i) for i, engine in enumerate(self.engines)]
        return [future.result() for future in futures]


class SGLangServer:
    """An SGLang server (``python -m sglang.launch_server``) as :class:`SGLangBroadcastAdapter`'s
    engine: its ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
    ``/destroy_weights_update_group`` endpoints, each answered ``(success, message)``.
    ``api_key``: sent as a bearer token when the server requires one."""

    def __init__(self, url: str, *, timeout: float = 600.0, api_key: Optional[str] = None) -> None:
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key

    def init_weights_update_group(self, **request: Any) -> tuple[bool, str]:
        return self._post("init_weights_update_group", request)

    def update_weights_from_distributed(self, **request: Any) -> tuple[bool, str]:
        return self._post("update_weights_from_distributed", request)

    def destroy_weights_update_group(self, **request: Any) -> tuple[bool, str]:
        return self._post("destroy_weights_update_group", request)

    def _post(self, endpoint: str, body: dict[str, Any]) -> tuple[bool, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.url}/{endpoint}", data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:  # SGLang answers a refusal with 400 and its message
            text = exc.read().decode(errors="replace")
            try:
                answer = json.loads(text)
            except ValueError:
                return False, f"HTTP {exc.code} from {endpoint}: {text[:500]}"
            return bool(answer.get("success", False)), str(answer.get("message", text[:500]))
        answer = json.loads(text)
        return bool(answer.get("success", False)), str(answer.get("message", ""))


__all__ = ["SGLangBroadcastAdapter", "SGLangServer", "UpdateGroup", "flatten_bucket", "FLATTENED_BUCKET"]
