"""The disaggregated refit's plan data on one process: the transfer plan of a TP1 trainer (every
slot from rank 0's own tensors, nothing gathered), the integrity unpickler of the refit group,
the model of the refit time at scale (bytes per link from a config, the CLI subcommand), and which vLLM
worker takes part in a link measurement."""

from __future__ import annotations

import json
import math
import pickle

import pytest

import mcore_zoo
from mcore_zoo.errors import ZooError


def test_transfer_plan_of_a_single_rank_trainer_sends_every_slot_from_its_own_tensors(reference_checkpoint, mpu):
    from mcore_zoo.handle import handle_of
    from mcore_zoo.rollout import get_plan, plan_transfer
    from mcore_zoo.rollout.transfer import holdings_of
    from mcore_zoo.weights.export import hf_copies

    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2, "vocab_size": 250})
    model = mcore_zoo.build_model(str(ckpt), backend="portable", load=str(ckpt))
    handle = handle_of(model)
    plan = get_plan(model, target_tp=2, bucket_size="64KB")
    holdings = holdings_of(handle.export_steps(), hf_copies(handle.weight_map), 0, lambda step: [0])
    transfer = plan_transfer(plan, holdings, 1)
    assert {a.sender for a in transfer.assignments.values()} == {0}
    assert all(a.cuts is not None for a in transfer.assignments.values())  # cut from the tensors: no export
    assert not transfer.exported
    assert transfer.channels() == [(0, 0), (0, 1)]
    assert sum(transfer.bytes_per_link().values()) >= plan.nbytes
    assert len(transfer.assignments) == sum(len(s) for per in plan.slots.values() for s in per)
    part = transfer.for_engine_rank(1)
    assert part.senders == [0] and all(r.engine_rank == 1 for r in part.routes)
    with pytest.raises(ZooError, match="no trainer rank holds"):
        plan_transfer(plan, holdings[1:], 1)
    assert "message(s) from trainer rank(s) [0]" in transfer.describe()


def test_the_refit_group_unpickles_plan_types_only():
    import io

    from mcore_zoo.distributed.refit_group import _PlanUnpickler
    from mcore_zoo.rollout.transfer import Route

    route = Route(0, 1, 0, (0, 2), 128)
    assert _PlanUnpickler(io.BytesIO(pickle.dumps([route, {"a": (1, 2)}]))).load() == [route, {"a": (1, 2)}]

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    with pytest.raises(ZooError, match="refused to unpickle"):
        _PlanUnpickler(io.BytesIO(pickle.dumps(Payload()))).load()


TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
            "vocab_size": 256, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


def test_refit_time_at_scale_counts_the_bytes_each_link_carries():
    from mcore_zoo.rollout.scale import hf_tensor_shapes, refit_time_at_scale

    shapes = hf_tensor_shapes(TINY_MOE)
    total = sum(math.prod(s) for _, s in shapes) * 2
    one = refit_time_at_scale(TINY_MOE, shapes=shapes, link_gbps=1.0)
    assert one.total_bytes == total and one.busiest_sender_bytes == total and one.engine_rank_bytes == total
    assert one.senders == 1 and one.seconds == pytest.approx(total / 1e9)
    wide = refit_time_at_scale(TINY_MOE, shapes=shapes, trainer_pp=2, trainer_ep=2, engine_tp=2, engine_dp=4, link_gbps=1.0)
    replicated = sum(math.prod(s) for _, s in shapes if len(s) < 2) * 2
    assert wide.engine_rank_bytes == (total - replicated) // 2 + replicated
    assert wide.senders == 4  # two stages x two EP ranks, each sending its experts (the first also the dense part)
    assert wide.busiest_sender_bytes < total
    assert "engine TP2 x DP4" in wide.describe() and "trainer TP1 x PP2 x EP2" in wide.describe()


def test_refit_time_cli(tmp_path, capsys):
    from mcore_zoo.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE))
    assert main(["refit-time", "--config", str(config), "--trainer", "pp=2,ep=2", "--engine", "tp=2,dp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainer"] == "trainer TP1 x PP2 x EP2" and out["seconds"] > 0
    assert main(["refit-time", "--config", str(config), "--trainer", "pp=zero"]) == 2
    assert "layout item 'pp=zero'" in capsys.readouterr().err


def test_a_vllm_worker_measures_only_the_link_it_is_asked_for(monkeypatch):
    """A worker whose engine rank is not the named one stays out of the link measurement, even when
    it holds a channel from the same sender: joining would leave it in broadcasts no trainer rank
    sends (TP2 -> TP2 on NCCL: the engine's TP rank 1 waited there, and the refit then hung)."""
    from types import SimpleNamespace

    from mcore_zoo.rollout import vllm_disagg

    calls = []
    monkeypatch.setattr(vllm_disagg, "measure_link", lambda group, key, nbytes, iters: calls.append(key) or {"key": key})
    channels = {(0, 0): None, (0, 1): None, (1, 1): None}
    workers = []
    for rank in (0, 1):
        worker = vllm_disagg.ZooDisaggWorkerExtension.__new__(vllm_disagg.ZooDisaggWorkerExtension)
        worker._zoo_receiver = SimpleNamespace(rank=rank, group=SimpleNamespace(channels=channels), transport="broadcast")
        workers.append(worker)
    assert [w.zoo_measure_link(0, 64, 1, 0) for w in workers] == [{"key": (0, 0)}, None]
    assert calls == [(0, 0)]
    assert [w.zoo_measure_link(1, 64, 1, 1) for w in workers] == [None, {"key": (1, 1)}]
    assert [w.zoo_measure_link(1, 64, 1, 0) for w in workers] == [None, None]  # no such channel
    calls.clear()  # every pair at once: each worker its own trainer rank's channel, none other
    assert [w.zoo_measure_paired_link(64, 1) for w in workers] == [{"key": (0, 0)}, {"key": (1, 1)}]
    assert calls == [(0, 0), (1, 1)]
    del channels[(1, 1)]
    assert [w.zoo_measure_paired_link(64, 1) for w in workers] == [{"key": (0, 0)}, None]
    workers[0]._zoo_receiver.transport = "shared"
    assert workers[0].zoo_measure_paired_link(64, 1) is None


def test_payload_ring_places_each_bucket_apart_from_the_one_in_flight_beside_it():
    """Bucket i's messages sit in buffer i % 2, apart from each other, at the same place at every
    refit; buckets i and i + 1 (in flight together) never share bytes."""
    import torch

    from mcore_zoo.rollout.disagg import PayloadRing
    from mcore_zoo.rollout.transfer import Route

    routes = [Route(0, 0, 0, (0,), 192), Route(0, 1, 0, (0, 1), 64), Route(1, 0, 0, (0,), 1000),
              Route(2, 1, 0, (0,), 64), Route(3, 0, 0, (0,), 128)]  # fmt: skip
    ring = PayloadRing(routes, torch.device("cpu"))
    views = {r: ring.payload(r) for r in routes}
    assert all(views[r].numel() == r.nbytes and views[r].is_contiguous() for r in routes)
    assert views[routes[0]].data_ptr() == ring.payload(routes[0]).data_ptr()  # the same place at every refit

    def span(r):
        start = views[r].data_ptr()
        return start, start + r.nbytes

    for a in routes:
        for b in routes:
            if a is not b and abs(a.bucket - b.bucket) <= 1:  # the same bucket, or two in flight together
                (s1, e1), (s2, e2) = span(a), span(b)
                assert e1 <= s2 or e2 <= s1, (a, b)
    assert [buf.numel() for buf in ring.buffers] == [256, 1024]  # the larger bucket of each parity, 64-byte aligned
    one_bucket = PayloadRing(routes[:1], torch.device("cpu"), shared=True)
    assert [buf.numel() for buf in one_bucket.buffers] == [192, 64]  # never an empty buffer (nothing to share)


def test_a_profiled_receive_writes_its_table_and_trace_and_passes_the_receive_result_on(tmp_path, monkeypatch):
    """``zoo_receive_refit_profiled`` runs the worker's receive under torch's profiler, writes the op
    table and the Chrome trace named by the worker's TP rank, and returns what the receive returned
    (None, or its error); a failure of the profiling itself comes back as an error string."""
    import torch

    from mcore_zoo.rollout import vllm_disagg

    worker = vllm_disagg.ZooDisaggWorkerExtension.__new__(vllm_disagg.ZooDisaggWorkerExtension)
    monkeypatch.setattr(worker, "_zoo_tp_rank", lambda: 1, raising=False)
    monkeypatch.setattr(worker, "zoo_receive_refit", lambda fused: torch.ones(64).sum() and None, raising=False)
    stem = tmp_path / "trace-case"
    assert worker.zoo_receive_refit_profiled(str(stem)) is None
    assert "aten::sum" in (tmp_path / "trace-case-engine1.txt").read_text()
    assert (tmp_path / "trace-case-engine1.json").stat().st_size > 0
    monkeypatch.setattr(worker, "zoo_receive_refit", lambda fused: "receive: IntegrityError: bucket 3", raising=False)
    assert worker.zoo_receive_refit_profiled(str(stem)) == "receive: IntegrityError: bucket 3"
    assert worker.zoo_receive_refit_profiled(str(tmp_path / "missing" / "x")).startswith("profiled receive: FileNotFoundError")
