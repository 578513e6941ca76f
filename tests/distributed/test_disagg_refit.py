"""Disaggregated refit on gloo: trainer processes (their own world, a TP2 / PP2 / EP2 / TP2 x EP2
layout) and engine processes (no world of their own) joined by a refit group from a host and a
port. One process launch for the two-trainer layouts (TP2, PP2, EP2, in turn) and one for TP2 x EP2
run the built-ins (a CI run: one of each kind, ``CI_BUILTINS``; every built-in with
``MCORE_ZOO_TEST_ALL_BUILTINS=1``) and every engine layout in them:
engine TP1, engine TP2, an engine of two DP replicas (TP1, every byte through one broadcast) and,
for MoE built-ins with per-expert tensors, an engine with expert parallelism over TP2 (each engine
rank's experts whole: the ``vllm-ep`` format).
Each engine rank's tensors (the CPU stand-in engine: a dict per rank in vLLM's names and TP
shards) must be bitwise those of an engine loaded from the zoo's export (the colocated refit
through the export stream, on trainer rank 0). A dropped or a duplicated message fails with an
error naming the bucket; the refit after it is whole again."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_zoo.distributed import launch
from mcore_zoo.placement import Parallelism

from ..conftest import Once

#: (id, architecture, config overrides): every built-in, tiny
BUILTINS = [
    ("llama", "LlamaForCausalLM", {"vocab_size": 250}),
    ("mistral", "MistralForCausalLM", {}),
    ("qwen2", "Qwen2ForCausalLM", {}),
    ("qwen3", "Qwen3ForCausalLM", {}),
    ("qwen3-moe", "Qwen3MoeForCausalLM", {}),
    ("qwen2-moe", "Qwen2MoeForCausalLM", {}),
    ("mixtral", "MixtralForCausalLM", {}),
    ("glm4-moe", "Glm4MoeForCausalLM", {}),
    ("deepseek-v2", "DeepseekV2ForCausalLM", {}),
    ("deepseek-v3", "DeepseekV3ForCausalLM", {}),
    ("deepseek-v3.2", "DeepseekV32ForCausalLM", {}),
    ("glm-5", "GlmMoeDsaForCausalLM", {}),
    ("qwen3-next", "Qwen3NextForCausalLM", {}),
    ("qwen3.5", "Qwen3_5ForCausalLM", {}),
    ("qwen3.5-moe", "Qwen3_5MoeForCausalLM", {}),
    ("qwen3.5-vl", "Qwen3_5ForConditionalGeneration", {}),
    ("qwen3.5-moe-vl", "Qwen3_5MoeForConditionalGeneration", {}),
    ("qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", {}),
    ("gpt-oss", "GptOssForCausalLM", {}),
]

#: the built-ins a CI run takes (one of each kind the transfer plan treats apart: two dense models,
#: MoE, MLA, experts with biases, gated DeltaNet, a vision-language model); the whole
#: list with MCORE_ZOO_TEST_ALL_BUILTINS=1 (the suite's time budget keeps it out of every run)
CI_BUILTINS = ("llama", "qwen3", "qwen3-moe", "deepseek-v3", "gpt-oss", "qwen3-next", "qwen2.5-vl")


def _selected(names=None):
    if names is not None:
        return names
    return None if os.environ.get("MCORE_ZOO_TEST_ALL_BUILTINS") == "1" else CI_BUILTINS


#: (id, engine TP, engine DP replicas); an id ending in "-shared": the shared-buffer transport
#: (the engine ranks read the senders' rings in shared memory), for SHARED_BUILTINS only
ENGINES = [("tp1", 1, 1), ("tp2", 2, 1), ("tp1-dp2", 1, 2), ("tp2-shared", 2, 1), ("tp1-dp2-shared", 1, 2), ("ep2", 2, 1)]
#: the built-ins the "ep2" engine runs (vLLM's ``enable_expert_parallel`` over TP2: each engine rank
#: holds its experts whole, the ``vllm-ep`` engine format): MoE with per-expert HF tensors
EP_ENGINE_BUILTINS = ("qwen3-moe", "qwen2-moe", "mixtral", "glm4-moe", "deepseek-v2", "deepseek-v3", "deepseek-v3.2",
                      "glm-5", "qwen3-next", "qwen3.5-moe")  # fmt: skip
#: the built-ins the shared transport runs (its data path does not depend on the model)
SHARED_BUILTINS = ("llama", "qwen3-moe", "qwen2.5-vl")


def _disagg(trainers: int, cases: list, faults: str | None) -> dict:
    """One launched process: trainer rank (its own gloo world of ``trainers``) or engine process.
    ``faults``: the case id whose refit into engine TP2 also drops and duplicates messages."""
    import torch.distributed as dist

    import mcore_zoo
    from mcore_zoo.distributed.refit_group import RefitGroup
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import DictAdapter, DisaggSender, EngineReceiver, IntegrityError, get_engine_format

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # the launch's store, kept past its world
    trainer_port = _shared_port(store, rank)
    dist.destroy_process_group()
    if rank < trainers:
        import os

        os.environ.update(MASTER_PORT=str(trainer_port), WORLD_SIZE=str(trainers), LOCAL_WORLD_SIZE=str(trainers))
        dist.init_process_group("gloo", rank=rank, world_size=trainers)
    found: dict = {}
    for case_id, ckpt, parallel in cases:
        if rank < trainers:
            ensure_model_parallel(parallel)
        model = mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt) if rank < trainers else None
        for engine_id, tp, dp in _engines(case_id):
            used = tp * dp
            key = f"{case_id}/{engine_id}"
            if rank >= trainers + used:
                continue
            group = RefitGroup(dist.PrefixStore(key, store), rank, trainers, used, "gloo", torch.device("cpu"), _timeout())
            transport = "shared" if engine_id.endswith("-shared") else "broadcast"
            fmt = get_engine_format("vllm-ep" if engine_id == "ep2" else "vllm")
            if rank < trainers:
                sender = DisaggSender(model, group, engine_tp=tp, engine_dp=dp, bucket_size="64KB", transport=transport,
                                      engine_format=fmt)  # fmt: skip
                sent = [sender.send() for _ in range(2)]
                reference = DictAdapter(tp_size=tp, engine_format=fmt) if rank == 0 else None  # the export, through the colocated refit
                mcore_zoo.refit(model, reference, target_tp=tp, bucket_size="64KB")
                found[key] = {"reference": reference.tensors if reference else None, "bytes": [s.nbytes for s in sent],
                              "routes": len(sender.transfer.routes), "exported": sorted(n for v in sender.transfer.exported.values() for n in v),
                              "recut": _recut(sender)}  # fmt: skip
                if engine_id.startswith("tp2") and case_id == faults:
                    for fault in ("drop", "duplicate", "duplicate-last"):
                        _Faulty(sender, fault).send()
                    _change_parameters(model)
                    sender.send()
                    changed = DictAdapter(tp_size=tp) if rank == 0 else None
                    mcore_zoo.refit(model, changed, target_tp=tp, bucket_size="64KB")
                    found[key]["changed"] = changed.tensors if changed else None
            else:
                index = rank - trainers
                receiver = EngineReceiver(group, index, engine_tp=tp)
                engine = [DictAdapter(tp_size=tp, engine_rank=receiver.rank) for _ in range(2)]
                for e in engine:
                    receiver.receive(e)
                found[key] = {"rank": receiver.rank, "tensors": [e.tensors[receiver.rank] for e in engine]}
                if engine_id.startswith("tp2") and case_id == faults:
                    errors = []
                    for _ in range(3):
                        try:
                            receiver.receive(DictAdapter(tp_size=tp, engine_rank=receiver.rank))
                            errors.append(None)
                        except IntegrityError as exc:
                            errors.append(str(exc))
                    after = DictAdapter(tp_size=tp, engine_rank=receiver.rank)
                    receiver.receive(after)
                    found[key].update(errors=errors, after=after.tensors[receiver.rank])
        if rank < trainers:
            from megatron.core import parallel_state

            del model
            parallel_state.destroy_model_parallel()
    return found


def _recut(sender) -> list[str]:
    """The slots a sender cuts from its own parameters again at every refit (not kept as views of
    them: a copy per refit). A trainer holding several query groups at TP1 had its q / k / v cut
    from ``FuseQKV.split``'s reshaped copies; they are strided views of ``linear_qkv`` now."""
    names = []
    for route in sender.routes:
        sources = sender._sources.get(route)
        slots = sender._layout(route)[0]
        for position, slot, shard in zip(route.positions, slots, sources.shards):
            if shard is None and sender.transfer.assignments[(route.bucket, route.engine_rank, position)].cuts is not None:
                names.append(slot.name)
    return names


#: built-ins whose every cut of a trainer's own parameter is a view (no transform computes it)
VIEW_CUTS = ("llama", "qwen3", "qwen3-moe")


def _change_parameters(model) -> None:
    """New weights between two refits, half of them written in place and half as new tensors
    (``param.data`` replaced): the sender must send the values the parameters hold now."""
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            if i % 2:
                param.data.mul_(2)
            else:
                param.data = param.data * 3


def _engines(case_id: str) -> list:
    """The engine layouts of a case (a vision-language model built at TP 1 only: no engine TP; the
    shared transport for SHARED_BUILTINS only)."""
    shared = case_id.split("/")[-1] in SHARED_BUILTINS
    engines = [e for e in ENGINES if shared or not e[0].endswith("-shared")]
    engines = [e for e in engines if e[0] != "ep2" or case_id.split("/")[-1] in EP_ENGINE_BUILTINS]
    return [e for e in engines if e[1] == 1] if case_id.endswith("qwen2.5-vl") else engines


class _Faulty:
    """A sender that drops or duplicates one message (the first bucket's, or the last one's)."""

    def __init__(self, sender, fault: str) -> None:
        self.sender, self.fault = sender, fault

    def send(self):
        sender, fault = self.sender, self.fault
        last = len(sender.plan.buckets) - 1
        target = last if fault == "duplicate-last" else 0
        post = type(sender)._post

        def faulty(key, bucket, header, payload):
            if bucket != target or key[1] != 0:
                return post(sender, key, bucket, header, payload)
            if fault == "drop":
                return []
            return post(sender, key, bucket, header, payload) + post(sender, key, bucket, header, payload)

        sender._post = faulty
        try:
            return sender.send()
        finally:
            del sender._post


def _shared_port(store, rank: int) -> int:
    """A free port for the trainers' own world, chosen by rank 0 and shared through the store."""
    if rank == 0:
        from mcore_zoo.distributed.launch import _free_port

        store.set("trainer_port", str(_free_port()))
    return int(store.get("trainer_port"))


def _timeout():
    import datetime

    return datetime.timedelta(seconds=900)  # engines wait while the trainers build (minutes on a loaded machine)


def _check(found: list, cases: list, trainers: int, faults: str | None) -> None:
    for case_id, _, _ in cases:
        for engine_id, tp, dp in _engines(case_id):
            key = f"{case_id}/{engine_id}"
            want = found[0][key]["reference"]
            sent = sum(found[r][key]["bytes"][0] for r in range(trainers))
            if case_id.split("/")[-1] in VIEW_CUTS:  # each refit reads these parameters in place
                assert not any(found[r][key]["recut"] for r in range(trainers)), (key, [found[r][key]["recut"] for r in range(trainers)])
            assert sent == sum(t.numel() * t.element_size() for per in want for t in per.values()) or sent > 0, key
            for index in range(tp * dp):
                got = found[trainers + index][key]
                rank = got["rank"]
                assert rank == index % tp, key
                for tensors in got["tensors"]:
                    assert sorted(tensors) == sorted(want[rank]), key
                    for name, ref in want[rank].items():
                        assert torch.equal(tensors[name], ref), (key, index, name)
                if engine_id.startswith("tp2") and case_id == faults:
                    drop, duplicate, last = got["errors"]
                    if rank == 0:
                        assert drop and "bucket 0" in drop and "dropped" in drop, drop
                        assert duplicate and "bucket 1" in duplicate or "after the last bucket" in duplicate, duplicate
                        assert last and "after the last bucket" in last, last
                    changed = found[0][key]["changed"][rank]
                    assert any(not torch.equal(changed[name], ref) for name, ref in want[rank].items()), key
                    for name, ref in changed.items():
                        assert torch.equal(got["after"][name], ref), (key, name)


def _cases(reference_checkpoint, layout: str, names=None) -> list:
    """(id, checkpoint, trainer layout) of every built-in for a trainer layout (EP: MoE only;
    experts with biases - gpt-oss - at expert TP 1, as the engine splits them itself); the id is
    ``<layout>/<built-in>``."""
    cases = []
    names = _selected(names)
    for case_id, arch, over in BUILTINS:
        if names is not None and case_id not in names:
            continue
        layers = {} if "qwen3.5" in case_id or case_id in ("qwen3-next", "qwen2.5-vl") else {"num_hidden_layers": 2}
        ckpt = reference_checkpoint(arch, {**layers, **over})  # hybrid and vision-language: their example configs
        moe = "moe" in case_id or case_id in ("mixtral", "deepseek-v2", "deepseek-v3", "deepseek-v3.2", "glm-5", "gpt-oss", "qwen3-next")
        if case_id == "qwen2.5-vl":  # built at TP = PP = 1 only: two data-parallel trainer replicas, in the EP2 launch
            if layout == "ep2":
                cases.append((f"{layout}/{case_id}", str(ckpt), Parallelism()))
            continue
        if "ep" in layout and not moe:
            continue
        tp = 2 if "tp2" in layout else 1
        parallel = Parallelism(tp=tp, pp=2 if layout == "pp2" else 1, ep=2 if "ep2" in layout else 1,
                               etp=1 if case_id == "gpt-oss" and tp > 1 else None)  # fmt: skip
        cases.append((f"{layout}/{case_id}", str(ckpt), parallel))
    return cases


#: the trainer layouts of two trainer processes (beside two engine processes)
TWO_TRAINER_LAYOUTS = ["tp2", "pp2", "ep2"]


@pytest.fixture(scope="module")
def two_trainer_launch(reference_checkpoint) -> tuple[dict, str, Once]:
    """One launch of 2 trainer + 2 engine processes running the built-ins of every layout of
    ``TWO_TRAINER_LAYOUTS`` in turn (the trainers' parallel state made per case); the first TP2
    case also drops and duplicates messages. ``(cases by layout, that case's id, every process's
    results)``."""
    cases = {layout: _cases(reference_checkpoint, layout) for layout in TWO_TRAINER_LAYOUTS}
    faults = cases["tp2"][0][0]
    every = [case for layout in TWO_TRAINER_LAYOUTS for case in cases[layout]]
    return cases, faults, Once(lambda: launch(_disagg, 4, 2, every, faults, timeout=1800 * len(TWO_TRAINER_LAYOUTS)))


@pytest.mark.parametrize("layout", TWO_TRAINER_LAYOUTS)
def test_disaggregated_refit_from_each_trainer_layout(two_trainer_launch, layout):
    """Every built-in from one trainer layout, into engine TP1, TP2 and two DP replicas (2 trainer
    + 2 engine processes, one launch for the three layouts); the TP2 layout also drops and
    duplicates messages."""
    cases, faults, found = two_trainer_launch
    _check(found.value, cases[layout], 2, faults)


def test_disaggregated_refit_from_tp2_ep2(reference_checkpoint):
    """MoE built-ins from TP2 x EP2 (4 trainer + 2 engine processes)."""
    cases = _cases(reference_checkpoint, "tp2-ep2", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
    found = launch(_disagg, 6, 4, cases, None, timeout=1800)
    _check(found, cases, 4, None)
