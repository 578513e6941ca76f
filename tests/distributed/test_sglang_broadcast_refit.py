"""Refit into SGLang engines in other processes (``SGLangBroadcastAdapter``) on gloo, CPU.

The engine side is a stand-in for SGLang 0.5.17's: each engine TP rank is a process of its own
that joins the weight-update group the way ``sglang/srt/utils/common.py::init_custom_process_group``
does (torch's ``rendezvous`` and ``_new_process_group_helper`` - so the trainer's mirror of it must
meet the same store keys and backends) and receives a bucket the way
``model_runner_components/weight_updater.py::_update_bucketed_weights_from_distributed`` does
(allocate each tensor, ``FlattenedTensorBucket`` of them, one ``broadcast(src=0)`` into the flat
bytes, the tensors back as views), then keeps what its ``load_weights`` would get: whole HF tensors
by name. Every engine rank's tensors must be bitwise the zoo's export; two replicas share one
broadcast; a refused bucket and a skipped one fail naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from typing import Any

import pytest
import torch

import mcore_zoo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the stand-in engine rank
def _unflatten(flat: torch.Tensor, names, dtypes, shapes) -> dict[str, torch.Tensor]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors``: each tensor's bytes in order, as views
    of ``flat``; asserts the bucket holds nothing more."""
    out, offset = {}, 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        out[name] = flat[offset : offset + n].view(dt).reshape(shape)
        offset += n
    assert offset == flat.numel(), (offset, flat.numel())
    return out


def _init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout):
    """SGLang 0.5.17's ``init_custom_process_group`` (no store passed, torch >= 2.6)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _engine_rank(conn: Any, tp_rank: int, refuse: str) -> None:
    """One engine TP rank: answers ``(method, kwargs)`` messages as SGLang's weight updater does."""
    import datetime

    import torch.distributed as dist

    groups: dict[str, Any] = {}
    loaded: dict[str, torch.Tensor] = {}
    while True:
        method, kwargs = conn.recv()
        if method == "stop":
            conn.send(None)
            return
        if method == "dump":
            conn.send(loaded)
            continue
        if method == "init_weights_update_group":
            rank = kwargs["rank_offset"] + tp_rank
            na = f"tcp://{kwargs['master_address']}:{kwargs['master_port']}"
            groups[kwargs["group_name"]] = _init_custom_process_group(
                kwargs["backend"], na, kwargs["world_size"], rank, kwargs["group_name"], datetime.timedelta(seconds=120))
            conn.send((True, "Succeeded to initialize custom process group."))
        elif method == "destroy_weights_update_group":
            dist.destroy_process_group(groups.pop(kwargs["group_name"]))
            conn.send((True, "Succeeded to destroy custom process group."))
        elif method == "update_weights_from_distributed":
            assert kwargs["load_format"] == "flattened_bucket"
            names, dtypes, shapes = kwargs["names"], kwargs["dtypes"], kwargs["shapes"]
            named = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(dtypes, shapes)]
            flat = torch.cat([t.flatten().view(torch.uint8) for t in named])  # FlattenedTensorBucket
            dist.broadcast(flat, src=0, group=groups[kwargs["group_name"]])
            loaded.update({n: t.clone() for n, t in _unflatten(flat, names, dtypes, shapes).items()})
            if refuse and any(refuse in n for n in names):
                conn.send((False, f"Failed to update parameter online: {refuse} unknown"))
            else:
                conn.send((True, "Succeeded to update parameter online."))
            loaded.setdefault("__flushes__", torch.zeros(1, dtype=torch.int64))
            loaded["__flushes__"] += int(kwargs["flush_cache"])


class StandInEngine:
    """An SGLang engine of ``tp`` ranks in processes of their own; its methods fan out to every
    rank and merge the answers (SGLang's ``FanOutCommunicator``)."""

    def __init__(self, tp: int = 1, refuse: str = "") -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine_rank, args=(child, r, refuse), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def _fan_out(self, method: str, **kwargs: Any) -> Any:
        for conn in self.conns:
            conn.send((method, kwargs))
        answers = [conn.recv() for conn in self.conns]
        if method in ("dump", "stop"):
            return answers
        return all(a[0] for a in answers), "; ".join(a[1] for a in answers)

    def init_weights_update_group(self, **kwargs):
        return self._fan_out("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs):
        return self._fan_out("update_weights_from_distributed", **kwargs)

    def destroy_weights_update_group(self, **kwargs):
        return self._fan_out("destroy_weights_update_group", **kwargs)

    def tensors(self) -> list[dict[str, torch.Tensor]]:
        return self._fan_out("dump")

    def stop(self) -> None:
        self._fan_out("stop")
        for proc in self.procs:
            proc.join(30)


def _export(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in mcore_zoo.iter_hf_weights(model)}


@pytest.mark.parametrize("arch,engines,overlap", [("LlamaForCausalLM", [2], False), ("Qwen3MoeForCausalLM", [1, 2], True)],
                         ids=["llama-tp2", "qwen3-moe-two-replicas-overlapped"])  # fmt: skip
def test_sglang_broadcast_refit_is_the_export_bitwise(mpu, reference_checkpoint, arch, engines, overlap):
    from mcore_zoo.rollout import SGLangBroadcastAdapter

    ckpt = reference_checkpoint(arch, {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    want = _export(model)
    fleet = [StandInEngine(tp) for tp in engines]
    try:
        adapter = SGLangBroadcastAdapter(fleet if len(fleet) > 1 else fleet[0], host="127.0.0.1", port=_free_port(),
                                         engine_tp=engines, timeout=120, overlap=overlap)  # fmt: skip
        for _ in range(2):  # the plan and the group reused
            stats = mcore_zoo.refit(model, adapter, bucket_size="64KB")
            assert stats.buckets > 1
        for engine in fleet:
            for rank in engine.tensors():
                flushes = int(rank.pop("__flushes__"))
                assert flushes == 2, "the radix cache is flushed once per refit (with the last bucket)"
                assert sorted(rank) == sorted(want)
                for name, t in want.items():
                    assert rank[name].dtype == t.dtype and torch.equal(rank[name], t), name
        adapter.close()
    finally:
        for engine in fleet:
            engine.stop()


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_sglang_broadcast_refit_fails_naming_the_bucket(mpu, reference_checkpoint, overlap):
    from mcore_zoo.errors import ZooError
    from mcore_zoo.rollout import SGLangBroadcastAdapter

    ckpt = reference_checkpoint("LlamaForCausalLM", {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    engine = StandInEngine(1, refuse="layers.1.mlp")
    try:
        adapter = SGLangBroadcastAdapter(engine, host="127.0.0.1", port=_free_port(), timeout=120, overlap=overlap)
        with pytest.raises(ZooError, match=r"SGLang refused bucket \d+ \(\d+ tensor\(s\), \d+ bytes.*engine 0.*layers.1.mlp unknown"):
            mcore_zoo.refit(model, adapter, bucket_size="64KB")
        with pytest.raises(ZooError, match="unusable after bucket"):
            mcore_zoo.refit(model, adapter, bucket_size="64KB")
        adapter.close()  # and a new group after it: whole again
        adapter.port, adapter.group_name = _free_port(), "mcore-zoo-refit-2"
        with pytest.raises(ZooError, match="layers.1.mlp unknown"):  # this engine refuses that tensor every time
            mcore_zoo.refit(model, adapter, bucket_size="64KB")
        adapter.close()
    finally:
        engine.stop()

    class SkipsOne(SGLangBroadcastAdapter):
        def load_bucket(self, bucket):
            if bucket.index != 1:
                super().load_bucket(bucket)

    engine = StandInEngine(1)
    try:
        adapter = SkipsOne(engine, host="127.0.0.1", port=_free_port(), timeout=120, overlap=overlap)
        with pytest.raises(ZooError, match=r"refit incomplete: [1-9][0-9]* tensor\(s\) never sent"):
            mcore_zoo.refit(model, adapter, bucket_size="64KB")
        adapter.close()
    finally:
        engine.stop()


def test_flatten_bucket_is_sglangs_layout():
    from mcore_zoo.rollout.sglang_broadcast import flatten_bucket

    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    c = torch.arange(3, dtype=torch.int64)[::2]  # not contiguous: its elements in order
    flat, names, dtypes, shapes = flatten_bucket([("a", a), ("b", b), ("c", c)])
    assert names == ["a", "b", "c"] and dtypes == ["bfloat16", "float32", "int64"] and shapes == [[2, 3], [3], [2]]
    assert flat.dtype == torch.uint8 and flat.numel() == 12 + 12 + 16
    assert torch.equal(flat[:12].view(torch.bfloat16).reshape(2, 3), a)
    assert torch.equal(flat[12:24].view(torch.float32), b)
    assert torch.equal(flat[24:].view(torch.int64), c.contiguous())


def test_each_broadcast_is_posted_while_the_engine_is_asked(mpu, reference_checkpoint):
    """NCCL makes a group's communicator at its first collective, a call that blocks until every
    rank makes it; SGLang's engine ranks make it inside the update request. So the trainer's
    broadcast must not block the thread that sends the request: a group whose broadcast waits for
    the request (as NCCL's first one does) must not stall the refit."""
    from mcore_zoo.rollout import SGLangBroadcastAdapter

    class Work:
        def wait(self):
            return True

    class LazyGroup:
        def __init__(self):
            self.asked, self.sent = threading.Event(), []

        def broadcast(self, flat):
            assert self.asked.wait(20), "the broadcast blocked the thread that asks the engine for the bucket"
            self.sent.append(flat.clone())
            self.asked.clear()
            return Work()

        def close(self, abort=False):
            pass

    class Engine:  # answers once the bucket's bytes went out, as SGLang's receive does
        def __init__(self, group):
            self.group, self.buckets = group, []

        def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache, load_format):
            before = len(self.group.sent)
            self.group.asked.set()
            deadline = time.monotonic() + 20
            while len(self.group.sent) == before and time.monotonic() < deadline:
                time.sleep(0.001)
            self.buckets.append((names, dtypes, shapes))
            return True, "Succeeded to update parameter online."

        def destroy_weights_update_group(self, group_name):
            return True, ""

    ckpt = reference_checkpoint("LlamaForCausalLM", {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    group = LazyGroup()
    engine = Engine(group)
    adapter = SGLangBroadcastAdapter(engine, host="127.0.0.1", port=0)
    adapter.group = group  # formed: connect() keeps it
    stats = mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert stats.buckets == len(group.sent) == len(engine.buckets) > 1
    got = {}
    for flat, (names, dtypes, shapes) in zip(group.sent, engine.buckets):
        got.update(_unflatten(flat, names, dtypes, shapes))
    want = _export(model)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_sglang_server_posts_the_requests_and_reads_refusals():
    """``SGLangServer``: each call is a JSON POST to the server's endpoint of that name (the bearer
    token when given); a 200 answer's and a 400 refusal's ``(success, message)`` are returned."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mcore_zoo.rollout import SGLangServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body, self.headers.get("Authorization")))
            ok = not body.get("names") or body["names"] != ["bad"]
            answer = json.dumps({"success": ok, "message": "done" if ok else "Failed to update parameter online: bad"})
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = SGLangServer(f"http://127.0.0.1:{server.server_address[1]}/", api_key="k")
        assert engine.init_weights_update_group(master_address="h", master_port=1, rank_offset=1, world_size=2,
                                                group_name="g", backend="nccl") == (True, "done")  # fmt: skip
        request = dict(names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]], group_name="g", flush_cache=True,
                       load_format="flattened_bucket")  # fmt: skip
        assert engine.update_weights_from_distributed(**request) == (True, "done")
        assert engine.update_weights_from_distributed(**{**request, "names": ["bad"]}) == (
            False, "Failed to update parameter online: bad")
        assert engine.destroy_weights_update_group(group_name="g") == (True, "done")
    finally:
        server.shutdown()
    assert [p for p, _, _ in seen] == ["/init_weights_update_group", "/update_weights_from_distributed",
                                       "/update_weights_from_distributed", "/destroy_weights_update_group"]  # fmt: skip
    assert seen[1][1] == request and all(auth == "Bearer k" for _, _, auth in seen)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_overlap_packs_the_next_bucket_while_the_engine_loads(mpu, reference_checkpoint, monkeypatch, overlap):
    """With ``overlap`` the next bucket is packed while the engines still load the one before (one
    request in flight); without it, every bucket's answer comes before the next is packed."""
    import mcore_zoo.rollout.sglang_broadcast as sb
    from mcore_zoo.rollout import SGLangBroadcastAdapter

    events = []
    lock = threading.Lock()
    flatten = sb.flatten_bucket

    def recorded(named):
        with lock:
            events.append("packed")
        return flatten(named)

    monkeypatch.setattr(sb, "flatten_bucket", recorded)

    class Work:
        def wait(self):
            return True

    class Group:
        def broadcast(self, flat):
            return Work()

        def close(self, abort=False):
            pass

    class Engine:
        def update_weights_from_distributed(self, **request):
            with lock:
                events.append("asked")
            time.sleep(0.25 if overlap else 0.02)  # the engine's receive and load_weights (long: a loaded CI machine)
            with lock:
                events.append("answered")
            return True, "Succeeded to update parameter online."

    ckpt = reference_checkpoint("LlamaForCausalLM", {})
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    adapter = SGLangBroadcastAdapter(Engine(), host="127.0.0.1", port=0, overlap=overlap)
    adapter.group = Group()
    stats = mcore_zoo.refit(model, adapter, bucket_size="64KB")
    assert stats.buckets > 2 and events.count("answered") == events.count("packed") == stats.buckets
    asked = [i for i, e in enumerate(events) if e == "asked"]
    answered = [i for i, e in enumerate(events) if e == "answered"]
    assert all(a < b for a, b in zip(asked, answered)) and all(b < a for b, a in zip(answered, asked[1:])), events
    packed = [i for i, e in enumerate(events) if e == "packed"]
    next_packed_first = sum(p < b for p, b in zip(packed[1:], answered))  # bucket k + 1 packed before k's answer
    assert next_packed_first == (stats.buckets - 1 if overlap else 0), events


def test_a_refused_join_is_raised_at_once():
    """An engine that refuses to join the group: the refusal, naming the engine, without waiting
    for the group's timeout."""
    from mcore_zoo.errors import ZooError
    from mcore_zoo.rollout import SGLangBroadcastAdapter

    class Refusing:
        def init_weights_update_group(self, **request):
            return False, "Failed to initialize custom process group: no route."

    adapter = SGLangBroadcastAdapter(Refusing(), host="127.0.0.1", port=_free_port(), timeout=300)
    start = time.monotonic()
    with pytest.raises(ZooError, match=r"SGLang refused joining weight-update group 'mcore-zoo-refit' \(engine 0, rank offset 1\).*no route"):
        adapter.connect()
    assert time.monotonic() - start < 30 and adapter.group is None
