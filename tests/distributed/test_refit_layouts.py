"""Refit from TP2, PP2 and EP2 source layouts on real gloo process groups: rank 0 receives every
engine rank's shards (engine TP 2), the other rank only takes part in the gathers. The engine
tensors must equal the independent vLLM-loader emulation of ``tests/unit/test_refit.py`` bit for
bit, on the first refit (plan computed) and the second (plan reused); and with ``receiver="all"``
(every trainer rank feeds its own engine rank) on both ranks. A receiver whose engine refuses
the plan raises, and the other rank's gathers still complete."""

from __future__ import annotations

import json

from safetensors.torch import load_file

import mcore_zoo
from mcore_zoo.distributed import launch
from mcore_zoo.placement import Parallelism

from ..unit.test_refit import assert_same, vllm_engine_tensors


def _refit_layouts(ckpt: str, layouts: list) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.errors import ZooError
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import DictAdapter

    found: dict = {}
    for name, parallel in layouts:
        ensure_model_parallel(parallel)
        model = mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt)
        adapter = DictAdapter(tp_size=2) if dist.get_rank() == 0 else None
        runs = [mcore_zoo.refit(model, adapter, target_tp=2, bucket_size="32KB") for _ in range(2)]
        class Refusing(DictAdapter):
            def begin(self, plan):
                raise ZooError("the engine refuses")

        try:  # the receiver fails before its first tensor: the other rank's gathers must still end
            mcore_zoo.refit(model, Refusing(tp_size=2) if dist.get_rank() == 0 else None, target_tp=2, bucket_size="32KB")
            refused = None
        except ZooError as exc:
            refused = str(exc)
        every = DictAdapter(tp_size=2)  # receiver="all": one engine rank per trainer rank
        mcore_zoo.refit(model, every, receiver="all", bucket_size="32KB")
        found[name] = {
            "planned": [r.planned for r in runs],
            "tensors": adapter.tensors if adapter is not None else None,
            "calls": adapter.calls if adapter is not None else None,
            "all": every.tensors,
            "refused": refused,
        }
        ps.destroy_model_parallel()
    return found


def test_refit_from_tp2_pp2_ep2_sources(reference_checkpoint, mpu):
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"num_hidden_layers": 2})
    layouts = [("tp2", Parallelism(tp=2)), ("pp2", Parallelism(pp=2)), ("ep2", Parallelism(ep=2))]
    found = launch(_refit_layouts, 2, str(ckpt), layouts)
    config = json.loads((ckpt / "config.json").read_text())
    want = vllm_engine_tensors(load_file(str(ckpt / "model.safetensors")), config, 2)
    for name, _ in layouts:
        assert found[0][name]["planned"] == [True, False], name
        assert found[1][name]["tensors"] is None
        assert found[0][name]["calls"].count("end") == 2
        assert_same(found[0][name]["tensors"], want)
        assert_same(found[0][name]["all"], want)
        assert_same(found[1][name]["all"], want)
        assert found[0][name]["refused"] == "the engine refuses" and found[1][name]["refused"] is None
