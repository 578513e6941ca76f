"""Grouped experts (Megatron-Core's ``TEGroupedMLP`` with the CPU stand-in grouped linears of
``tests/te_grouped_standin.py``) under expert and expert-tensor parallelism, on real gloo process
groups: EP2, expert-TP2 (TP2) and TP2 with EP2 / expert-TP1, for Qwen3-MoE (a dense layer among
the MoE layers) and Mixtral.

Per layout, on every rank:

* ownership: ``linear_fc1.weight{i}`` of EP rank ``r`` holds HF expert ``r * E / ep + i``'s gate
  rows then up rows of this expert-TP rank (``[gate_t; up_t]``), ``linear_fc2.weight{i}`` its
  down-projection columns of that rank, compared bit for bit with the checkpoint, every expert
  parameter of the rank checked;
* sharded loading: the rank reads its own experts' tensors and the shared ones, nothing else
  (an instrumented checkpoint reader);
* the packed forward against the single-process sequential-experts model (1e-5, as the
  sequential layouts in ``test_moe_layouts.py``, whose inputs no token routes within ``MARGIN`` of
  a tie: checked on the reference);
* the export gathered over EP / expert-TP equals the checkpoint bit for bit;
* a refit into vLLM's layout at engine TP 2 (fused ``w13_weight`` / ``w2_weight`` experts) equals
  the independent vLLM-loader emulation of ``tests/unit/test_refit.py`` bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_zoo
from mcore_zoo.placement import Parallelism

from ..conftest import SharedLaunch, checkpoint_tensors, export_mismatches, random_sequences
from ..unit.test_refit import assert_same, vllm_engine_tensors
from .test_moe_layouts import (
    LENGTHS,
    OVERRIDES,
    TOL,
    _counting_checkpoint,
    _expected_reads,
    assert_decisive_routing,
    logits_mismatch,
    routing_margins,
)

LAYOUTS = {
    "Qwen3MoeForCausalLM": [("ep2", Parallelism(ep=2)), ("etp2", Parallelism(tp=2)),
                            ("tp2-ep2-etp1", Parallelism(tp=2, ep=2, etp=1))],  # fmt: skip
    "MixtralForCausalLM": [("ep2", Parallelism(ep=2))],
}
CASE_OVERRIDES = {"Qwen3MoeForCausalLM": OVERRIDES, "MixtralForCausalLM": {"num_hidden_layers": 4}}


def _profile():
    from mcore_zoo.numerics.profiles import get_profile

    return dataclasses.replace(get_profile("hf-exact"), name="standin-grouped", grouped_experts=True)


def _ownership(model, source: dict, hf_moe: str, projections: tuple, first_expert: int, etp: int, etp_rank: int) -> dict:
    """Mismatches of this rank's grouped expert parameters against the checkpoint, and how many
    parameters were compared (every ``linear_fc{1,2}.weight{i}``)."""
    gate, up, down = projections
    checked, bad = 0, []
    for name, param in model.named_parameters():
        if ".mlp.experts." not in name:
            continue
        layer = int(name.split(".")[2])  # one pipeline stage: local layer == global layer
        fc, index = name.split(".mlp.experts.")[1].split(".weight")
        e = first_expert + int(index)
        prefix = f"model.layers.{layer}.{hf_moe}experts.{e}."
        if fc == "linear_fc1":
            want = torch.cat([source[prefix + gate + ".weight"].chunk(etp, dim=0)[etp_rank],
                              source[prefix + up + ".weight"].chunk(etp, dim=0)[etp_rank]])  # fmt: skip
        else:
            want = source[prefix + down + ".weight"].chunk(etp, dim=1)[etp_rank]
        checked += 1
        if not torch.equal(param.detach(), want):
            bad.append(f"{name} != expert {e}")
    return {"checked": checked, "bad": bad}


def _run(ckpt: str, arch_name: str, layouts: list) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.rollout import DictAdapter

    from ..te_grouped_standin import installed

    hf_moe, projections = ("block_sparse_moe.", ("w1", "w3", "w2")) if arch_name.startswith("Mixtral") else \
        ("mlp.", ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    source = checkpoint_tensors(ckpt)
    seqs = random_sequences(LENGTHS, 256)
    found: dict = {}
    with installed():
        for name, parallel in layouts:
            ensure_model_parallel(parallel)
            model = mcore_zoo.build_model(ckpt, backend="portable", numerics=_profile(), parallel=parallel)
            counting = _counting_checkpoint(ckpt)
            report = mcore_zoo.load_hf_weights(model, counting, replicas="read")
            r: dict = {"ep_rank": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size(),
                       "etp_rank": ps.get_expert_tensor_parallel_rank(), "etp_size": ps.get_expert_tensor_parallel_world_size(),
                       "tp_size": ps.get_tensor_model_parallel_world_size(), "pp_rank": 0, "pp_size": 1}  # fmt: skip
            r["classes"] = sorted({type(layer.mlp.experts).__name__ for layer in model.decoder.layers if hasattr(layer.mlp, "experts")})
            r["read_names"], r["read_bytes"], r["report_bytes"] = sorted(counting.names), counting.nbytes, report.bytes_read
            counting.close()
            per_rank = mcore_zoo.handle_of(model).arch_config.moe.num_experts // r["ep_size"]
            r["ownership"] = _ownership(model, source, hf_moe, projections, r["ep_rank"] * per_rank, r["etp_size"], r["etp_rank"])
            r["experts_on_rank"] = sum(1 for n, _ in model.named_parameters() if ".mlp.experts.linear_fc1.weight" in n)
            model.eval()
            with torch.no_grad():
                r["logits"] = mcore_zoo.packed_forward(model, seqs).logits
            r["export"] = export_mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
            adapter = DictAdapter(tp_size=2) if dist.get_rank() == 0 else None
            mcore_zoo.refit(model, adapter, target_tp=2, bucket_size="32KB")
            r["refit"] = adapter.tensors if adapter is not None else None
            found[name] = r
            ps.destroy_model_parallel()
    return found


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint, mpu) -> SharedLaunch:
    """One two-rank launch running every architecture of ``LAYOUTS`` at its layouts."""
    return SharedLaunch(2, lambda: {arch_name: (_run, str(reference_checkpoint(arch_name, CASE_OVERRIDES[arch_name])),
                                                arch_name, layouts) for arch_name, layouts in LAYOUTS.items()})  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("arch_name", list(LAYOUTS))
def test_grouped_experts_under_ep_and_expert_tp(reference_checkpoint, two_rank_runs, arch_name):
    import json

    from safetensors.torch import load_file

    ckpt = reference_checkpoint(arch_name, CASE_OVERRIDES[arch_name])
    source = checkpoint_tensors(str(ckpt))
    arch = mcore_zoo.lookup(arch_name).config_from_hf(json.loads((ckpt / "config.json").read_text()))
    num_experts, num_layers = arch.moe.num_experts, arch.num_layers
    moe_layers = sum(1 for i in range(num_layers) if arch.moe.is_moe_layer(i))
    found = two_rank_runs[arch_name]
    single = mcore_zoo.build_model(ckpt, backend="portable", numerics="hf-exact", load=ckpt).eval()
    with torch.no_grad(), routing_margins(single) as margins:
        ref = mcore_zoo.packed_forward(single, random_sequences(LENGTHS, 256)).logits
    assert_decisive_routing(margins, LENGTHS, arch_name)
    config = json.loads((ckpt / "config.json").read_text())
    engine = vllm_engine_tensors(load_file(str(ckpt / "model.safetensors")), config, 2)
    for name, parallel in LAYOUTS[arch_name]:
        ep_ranks = sorted(f[name]["ep_rank"] for f in found)
        assert ep_ranks == ([0, 1] if parallel.ep == 2 else [0, 0]), (name, ep_ranks)
        for rank, ranks in enumerate(found):
            r, where = ranks[name], f"{arch_name} {name} rank {rank}"
            assert r["classes"] == ["HFOrderTEGroupedMLP"], where
            assert r["ep_size"] == parallel.ep and r["etp_size"] == (parallel.etp or parallel.tp), where
            per_rank = num_experts // parallel.ep
            assert r["experts_on_rank"] == per_rank * moe_layers, where
            assert r["ownership"]["checked"] == 2 * per_rank * moe_layers and r["ownership"]["bad"] == [], (where, r["ownership"])
            want = _expected_reads(source, r, set(range(num_layers)), num_experts)
            assert set(r["read_names"]) == want, (
                f"{where}: read {sorted(set(r['read_names']) - want)[:5]} it does not need,"
                f" missed {sorted(want - set(r['read_names']))[:5]}"
            )
            if r["tp_size"] == r["etp_size"] == 1:  # whole tensors: exactly those tensors' bytes
                assert r["read_bytes"] == r["report_bytes"] == sum(source[n].numel() * source[n].element_size() for n in want), where
            diff, detail = logits_mismatch(r["logits"], ref, margins)
            assert diff <= TOL, f"{where}: logits differ from the single-process sequential model by {diff} ({detail})"
            assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
        assert found[1][name]["refit"] is None
        assert_same(found[0][name]["refit"], engine)
