"""Expert parallelism on real gloo process groups: EP2 for every MoE family; TP2 x EP2, PP2 x EP2,
PP2 x VPP2 x EP2 and EP4 for Qwen3-MoE (a dense layer among the MoE layers), DeepSeek-V3.2, GLM-5
and gpt-oss (its experts at expert-TP 1 under TP 2, the job's parallel state made so); a job whose
parallel state splits gpt-oss's experts otherwise is refused by name.

Per layout, on every rank: sharded loading (an EP rank reads its own experts and the shared
tensors, nothing else - counted through an instrumented checkpoint reader), the packed forward
against the single-process model and transformers (1e-5), the gathered export and the checkpoint
written by ``save_hf_checkpoint`` against the source checkpoint (bitwise), and a distributed checkpoint
written by ``mcore-zoo convert`` in one process loaded at the layout (export bitwise again); routing
recorded in one forward and replayed in the next gives the same logits bit for bit.

The 1e-5 logits bound holds only while no token's top-k choice is a near tie: a layout's rounding
(another reduction order of the combine, TP partial sums) moves the router scores by ~5e-7, and one
token routed to another expert moves the logits by 0.1-1. :func:`routing_margins` measures how far
every token of the single-process reference is from a tie, and :func:`assert_decisive_routing` fails
(with the layer and token) when the inputs come within ``MARGIN`` of one: then the inputs, not the
layout, are at fault. A logits mismatch names its worst token and that token's margin
(:func:`logits_mismatch`).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

import mcore_zoo
from mcore_zoo.placement import Parallelism
from mcore_zoo.testing.common import LAYOUT_ULPS, layout_bound

from ..conftest import SharedLaunch, checkpoint_tensors, export_mismatches, random_sequences

ARCH = "Qwen3MoeForCausalLM"
OVERRIDES = {"num_hidden_layers": 4, "mlp_only_layers": [1]}  # PP2: two layers per stage, one dense
LENGTHS = [23, 9, 40, 5, 17]
NUMERICS = "hf-exact"
TOL = 1e-5
#: the smallest top-k margin (selection score of the k-th minus the (k+1)-th expert) the test inputs may
#: have: 20x the router-score change of any layout here (<= 4.5e-7, also with MKL's AVX2 kernels)
MARGIN = 1e-5
EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
#: a layer's experts stacked in one tensor per projection (gpt-oss): an EP rank reads its slice of it
STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?$")


def _counting_checkpoint(path: str):
    """An HFCheckpoint that records every tensor it reads and the bytes it returns."""
    from mcore_zoo.weights.io import HFCheckpoint

    class Counting(HFCheckpoint):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.names: set[str] = set()
            self.nbytes = 0

        def read(self, name, **kw):
            tensor = super().read(name, **kw)
            self.names.add(name)
            self.nbytes += tensor.numel() * tensor.element_size()
            return tensor

        def read_into(self, name, out, **kw):
            n = super().read_into(name, out, **kw)
            self.names.add(name)
            self.nbytes += n
            return n

    return Counting(path)


@contextlib.contextmanager
def routing_margins(model) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every forward of ``model`` (one process, the zoo's HF router) appends, per MoE
    layer in layer order, each packed token's distance from a routing tie: the gap between the k-th and
    the (k+1)-th expert's selection score (softmax or sigmoid of the router logits, plus the expert
    bias); with group-limited routing the smaller of that gap (within the chosen groups) and the gap
    between the ``group_topk``-th and the next group score. ``[tokens]`` float32 each. A router called
    once per sequence of a pack (``hf-exact`` routes a THD pack one sequence at a time) has its calls
    concatenated in order when the block exits."""
    from mcore_zoo import routing

    margins: list[torch.Tensor] = []
    calls: list[tuple[int, torch.Tensor]] = []
    routers = routing.moe_routers(model)

    def measure(router, args) -> None:
        moe = router.zoo_moe
        logits = router.gating(args[0]).float().reshape(-1, router.weight.shape[0])
        scores = torch.softmax(logits, dim=-1) if moe.router_score_function == "softmax" else torch.sigmoid(logits)
        if moe.router_expert_bias:
            scores = scores + router.expert_bias.float()
        gap = torch.full(scores.shape[:1], float("inf"))
        if moe.num_groups and moe.group_topk:
            grouped = scores.view(scores.shape[0], moe.num_groups, -1)
            group_scores = grouped.topk(moe.group_score_topk, dim=-1).values.sum(dim=-1)
            ranked, order = group_scores.sort(dim=-1, descending=True)
            if moe.group_topk < moe.num_groups:
                gap = ranked[:, moe.group_topk - 1] - ranked[:, moe.group_topk]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, order[:, : moe.group_topk], True)
            scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(scores.shape)
        ranked = scores.sort(dim=-1, descending=True).values
        calls.append((next(k for k, r in enumerate(routers) if r is router),
                      torch.minimum(gap, ranked[:, moe.top_k - 1] - ranked[:, moe.top_k])))

    hooks = [router.register_forward_pre_hook(measure) for router in routers]
    try:
        yield margins
    finally:
        for hook in hooks:
            hook.remove()
        # one entry per layer per forward: a forward's calls run layer after layer, sequence by sequence
        # within a layer, so consecutive calls of one router belong to the same layer pass
        last = None
        for k, gap in calls:
            if k == last:
                margins[-1] = torch.cat([margins[-1], gap])
            else:
                margins.append(gap)
            last = k


def assert_decisive_routing(margins: list[torch.Tensor], lengths: list[int], where: str) -> None:
    """Fail unless every token's routing in ``margins`` (:func:`routing_margins` of one forward over
    sequences of ``lengths``, packed without padding) is at least ``MARGIN`` from a tie."""
    for layer, m in enumerate(margins):
        assert m.numel() == sum(lengths), (where, layer, m.numel(), lengths)
        token = int(m.argmin())
        assert m[token] >= MARGIN, (
            f"{where}: the test inputs route packed token {token} of MoE layer {layer} within {m[token].item():.2e} of a tie"
            f" (< MARGIN {MARGIN}): a layout's rounding may pick another expert there; change the inputs (lengths / seed)"
        )


def logits_mismatch(logits: list[torch.Tensor], ref: list[torch.Tensor], margins: list[torch.Tensor]) -> tuple[float, str]:
    """``(max |logits - ref|, a description of the worst token)``: its sequence and position, how many
    tokens exceed ``TOL``, and the worst token's smallest routing margin over the MoE layers."""
    per_token = torch.cat([(a - b).abs().amax(dim=-1) for a, b in zip(logits, ref)])
    token = int(per_token.argmax())
    offsets = torch.tensor([0] + [len(r) for r in ref]).cumsum(0)
    seq = int((offsets <= token).sum()) - 1
    margin = min(m[token].item() for m in margins) if margins else float("nan")
    return per_token[token].item(), (f"worst at sequence {seq} position {token - int(offsets[seq])},"
                                      f" {int((per_token > TOL).sum())} tokens over {TOL}, that token's smallest routing margin {margin:.2e}")  # fmt: skip


def _run(ckpt: str, out_dir: str, layouts: list, mcore_dir: str = "") -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_zoo.parallel import ensure_model_parallel

    rank = dist.get_rank()
    source = checkpoint_tensors(ckpt)
    seqs = random_sequences(LENGTHS, 256)
    found: dict = {}
    for name, parallel in layouts:
        r: dict = {}
        ensure_model_parallel(parallel)
        model = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel,
                                      overrides={"moe_enable_routing_replay": True})  # fmt: skip
        counting = _counting_checkpoint(ckpt)
        report = mcore_zoo.load_hf_weights(model, counting, replicas="read")
        r["ep_rank"], r["ep_size"] = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        r["etp_size"] = ps.get_expert_tensor_parallel_world_size()
        r["pp_rank"], r["tp_rank"] = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        r["read_names"], r["read_bytes"], r["report_bytes"] = sorted(counting.names), counting.nbytes, report.bytes_read
        r["vpp"] = parallel.vpp or 1
        counting.close()
        for chunk in model if isinstance(model, list) else [model]:
            chunk.eval()
        from mcore_zoo import routing

        with torch.no_grad():
            with routing.record(model) as rec:
                out = mcore_zoo.packed_forward(model, seqs)
            with routing.replay(model, rec.routes):
                again = mcore_zoo.packed_forward(model, seqs)
        r["logits"] = out.logits
        r["replay_bitwise"] = all(torch.equal(a, b) for a, b in zip(out.logits, again.logits))
        r["export"] = export_mismatches(dict(mcore_zoo.iter_hf_weights(model, bucket_size="64KB")), source)
        to_rank0 = dict(mcore_zoo.iter_hf_weights(model, ranks=[0], bucket_size=1))
        r["export_rank0"] = export_mismatches(to_rank0, source) if rank == 0 else sorted(to_rank0)
        mcore_zoo.save_hf_checkpoint(model, os.path.join(out_dir, name), max_shard_size="200KB")
        if mcore_dir:  # a distributed checkpoint written by one process, loaded at this layout
            from mcore_zoo.dist_checkpoint import load_mcore_checkpoint

            fresh = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, parallel=parallel)
            load_mcore_checkpoint(fresh, mcore_dir)
            r["from_dist_checkpoint"] = export_mismatches(dict(mcore_zoo.iter_hf_weights(fresh)), source)
        found[name] = r
        ps.destroy_model_parallel()
    return found


def _expected_reads(source: dict, r: dict, layers_of_stage: set[int], num_experts: int) -> set[str]:
    per_rank = num_experts // r["ep_size"]
    mine = range(r["ep_rank"] * per_rank, (r["ep_rank"] + 1) * per_rank)
    names = set()
    for name in source:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) not in layers_of_stage:
            continue
        if not layer and r["pp_rank"] not in _stages_of(name, r):
            continue
        expert = EXPERT_TENSOR.match(name)
        if expert and int(expert.group(1)) not in mine:
            continue
        names.add(name)
    return names


def _stages_of(name: str, r: dict) -> set[int]:
    if name == "model.embed_tokens.weight":
        return {0}
    return {r["pp_size"] - 1} if "pp_size" in r else {0}


def _check(found: list[dict], ckpt: Path, hf, out_dir: Path, num_layers: int, num_experts: int,
           layout_ulps: Optional[dict] = None) -> dict:  # fmt: skip
    """Every rank's results of every layout against the single-process model, transformers and the
    checkpoint. ``layout_ulps``: layouts whose logits are held to the project's layout bound
    (``layout_bound``: that many ulps at the largest reference logit) instead of ``TOL``."""
    source = checkpoint_tensors(str(ckpt))
    seqs = random_sequences(LENGTHS, 256)
    single = mcore_zoo.build_model(ckpt, backend="portable", numerics=NUMERICS, load=ckpt).eval()
    with torch.no_grad(), routing_margins(single) as margins:
        ref = mcore_zoo.packed_forward(single, seqs).logits
    with torch.no_grad():
        hf_logits = [hf(s[None]).logits[0] for s in seqs]
    assert_decisive_routing(margins, LENGTHS, str(ckpt))
    worst: dict = {}
    for name in found[0]:
        pp = max(f[name]["pp_rank"] for f in found) + 1
        for rank, ranks in enumerate(found):
            r = dict(ranks[name], pp_size=pp)
            where = f"{name} rank {rank}"
            diff, detail = logits_mismatch(r["logits"], ref, margins)
            diff_hf = max((a - b).abs().max().item() for a, b in zip(r["logits"], hf_logits))
            bound = layout_bound(ref, layout_ulps[name]) if name in (layout_ulps or {}) else TOL
            assert diff <= bound and diff_hf <= bound, (
                f"{where}: logits differ by {diff} (single; {detail}) / {diff_hf} (HF), bound {bound:.3g}")
            assert r["replay_bitwise"], f"{where}: the replayed forward differs from the recorded one"
            assert r["export"] == [], f"{where}: exported tensors differ: {r['export'][:5]}"
            assert r["export_rank0"] == [], f"{where}: ranks=[0] export: {r['export_rank0'][:5]}"
            assert r.get("from_dist_checkpoint", []) == [], f"{where}: dist checkpoint: {r['from_dist_checkpoint'][:5]}"
            per_chunk = num_layers // (pp * r["vpp"])  # virtual stage v of stage p: chunk v * pp + p
            layers = {i for i in range(num_layers) if (i // per_chunk) % pp == r["pp_rank"]}
            want = _expected_reads(source, r, layers, num_experts)
            assert set(r["read_names"]) == want, (
                f"{where}: read {sorted(set(r['read_names']) - want)[:5]} it does not need,"
                f" missed {sorted(want - set(r['read_names']))[:5]}"
            )
            tp = max(f[name]["tp_rank"] for f in found) + 1
            if tp == 1:  # whole tensors (stacked experts: this EP rank's share): exactly those bytes
                assert r["read_bytes"] == r["report_bytes"] == sum(
                    source[n].numel() * source[n].element_size() // (r["ep_size"] if STACKED_EXPERTS.match(n) else 1)
                    for n in want
                ), where
            worst[name] = max(worst.get(name, 0.0), diff)
        assert export_mismatches(checkpoint_tensors(str(out_dir / name)), source) == [], f"{name}: save_hf_checkpoint"
    return worst


#: per architecture: overrides giving 4 layers (PP2) with a dense layer where the family has them
EP_CASES = {
    "Qwen3MoeForCausalLM": OVERRIDES,
    "Qwen2MoeForCausalLM": OVERRIDES,  # + the sigmoid-gated shared expert (dense TP)
    "MixtralForCausalLM": {"num_hidden_layers": 4},
    "Glm4MoeForCausalLM": {"num_hidden_layers": 4},  # + expert bias buffer, shared experts
    "DeepseekV32ForCausalLM": {"num_hidden_layers": 4},  # + MLA with the DSA indexer (replicated)
    "GlmMoeDsaForCausalLM": {"num_hidden_layers": 4},  # + the interleaved-RoPE indexer
}


def _layout_cases(reference_checkpoint, tmp_path_factory, cases: dict, layouts_of) -> dict[str, tuple]:
    """``{arch: (_run, checkpoint, output dir, layouts, distributed checkpoint)}`` for a
    :class:`~tests.conftest.SharedLaunch`: each architecture's reference checkpoint (``cases``:
    its overrides), converted to a distributed checkpoint by one process, at ``layouts_of(arch,
    checkpoint)``."""
    from mcore_zoo.dist_checkpoint import hf_to_mcore

    jobs = {}
    for arch, overrides in cases.items():
        ckpt = reference_checkpoint(arch, overrides)
        out = tmp_path_factory.mktemp(arch)
        hf_to_mcore(ckpt, out / "mcore")
        jobs[arch] = (_run, str(ckpt), str(out), layouts_of(arch, ckpt), str(out / "mcore"))
    return jobs


@pytest.fixture(scope="module")
def two_rank_runs(reference_checkpoint, mpu, tmp_path_factory) -> SharedLaunch:
    """One two-rank launch for this module's two-rank tests: EP2 for every family of ``EP_CASES``,
    then the two layouts refused by name (MoE training at TP2 without sequence parallelism,
    gpt-oss under a parallel state of expert-TP 2)."""

    def cases() -> dict[str, tuple]:
        jobs = _layout_cases(reference_checkpoint, tmp_path_factory, EP_CASES,
                             lambda arch, ckpt: [("ep2", Parallelism(ep=2))])  # fmt: skip
        jobs["moe-tp2-without-sp"] = (_moe_tp2_without_sp, str(reference_checkpoint(ARCH, {"num_hidden_layers": 2})))
        jobs["gpt-oss-etp2"] = (_gpt_oss_under_a_state_at_etp2,
                                str(reference_checkpoint("GptOssForCausalLM", {"num_hidden_layers": 2})))
        return jobs

    return SharedLaunch(2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(EP_CASES))
def test_two_ranks_ep2(reference_checkpoint, hf_reference, two_rank_runs, arch):
    ckpt = reference_checkpoint(arch, EP_CASES[arch])
    found = two_rank_runs[arch]
    assert [f["ep2"]["ep_rank"] for f in found] == [0, 1]
    worst = _check(found, ckpt, hf_reference(arch, ckpt), Path(two_rank_runs.cases[arch][2]), 4, 8)
    print("max |dlogit| vs the single-process model:", worst)


#: the four-rank layouts: Qwen3-MoE, MLA with the replicated DSA indexer (both indexer RoPE layouts),
#: and gpt-oss (attention sinks split over TP like the heads; stacked experts with biases, built at
#: expert-TP 1 under TP 2)
FOUR_RANK_CASES = {
    ARCH: OVERRIDES,
    "DeepseekV32ForCausalLM": EP_CASES["DeepseekV32ForCausalLM"],
    "GlmMoeDsaForCausalLM": EP_CASES["GlmMoeDsaForCausalLM"],
    "GptOssForCausalLM": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
}
#: layouts whose logits are held to the project's layout bound (``LAYOUT_ULPS`` ulps at the largest
#: logit, as tests/distributed/test_mla_layouts.py holds GLM-5 at TP2) instead of ``TOL``. GLM-5 at
#: TP2 x EP2: max |dlogit| 1.29e-5 on one token (~30 ulps at the largest logit 3.6; that token's
#: routing margin 8e-2, so no expert changed): TP2's reordered fp32 partial sums over its 4 layers
#: (DeepSeek-V3.2, the same model with the other indexer RoPE: 9.5e-6); its other layouts 1.4e-6
FOUR_RANK_LAYOUT_ULPS = {"GlmMoeDsaForCausalLM": {"tp2ep2": LAYOUT_ULPS}}


def _four_rank_layouts(arch: str, ckpt: Path) -> list:
    """TP2 x EP2, PP2 x EP2, PP2 x VPP2 x EP2 and EP4, each with the job's parallel state at the
    expert-TP size the model is built at (gpt-oss: 1)."""
    from mcore_zoo.testing.checks import case_layout

    layouts = [("tp2ep2", Parallelism(tp=2, ep=2)), ("pp2ep2", Parallelism(pp=2, ep=2)),
               ("pp2vpp2ep2", Parallelism(pp=2, vpp=2, ep=2)), ("ep4", Parallelism(ep=4))]
    return [(name, case_layout(mcore_zoo.lookup(arch), str(ckpt), p)) for name, p in layouts]


@pytest.fixture(scope="module")
def four_rank_runs(reference_checkpoint, mpu, tmp_path_factory) -> SharedLaunch:
    """One four-rank launch running the four-rank layouts for every family of ``FOUR_RANK_CASES``."""
    return SharedLaunch(4, lambda: _layout_cases(reference_checkpoint, tmp_path_factory, FOUR_RANK_CASES,
                                                 _four_rank_layouts))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(FOUR_RANK_CASES))
def test_four_ranks_tp2ep2_pp2ep2_ep4(reference_checkpoint, hf_reference, four_rank_runs, arch):
    ckpt = reference_checkpoint(arch, FOUR_RANK_CASES[arch])
    found = four_rank_runs[arch]
    worst = _check(found, ckpt, hf_reference(arch, ckpt), Path(four_rank_runs.cases[arch][2]), 4, 8,
                   FOUR_RANK_LAYOUT_ULPS.get(arch))  # fmt: skip
    print("max |dlogit| vs the single-process model:", worst)


def _moe_tp2_without_sp(ckpt: str) -> dict:
    from megatron.core import parallel_state as ps

    from mcore_zoo.errors import ZooError
    from mcore_zoo.parallel import ensure_model_parallel

    parallel = Parallelism(tp=2)
    ensure_model_parallel(parallel)
    model = mcore_zoo.build_model(ckpt, backend="portable", parallel=parallel, load=ckpt, params_dtype=torch.float32)
    seqs = random_sequences([12, 9], 256, seed=2)
    found = {}
    for name, call in [("forward", lambda: mcore_zoo.packed_forward(model.train(), seqs)),
                       ("train_step", lambda: mcore_zoo.train_step(model.train(), seqs, lambda t: (-(t.logprobs * t.mask).sum(), {})))]:  # fmt: skip
        try:
            with torch.no_grad() if name == "forward" else contextlib.nullcontext():
                call()
            found[name] = None
        except ZooError as exc:
            found[name] = str(exc)
    with torch.no_grad():
        found["eval"] = mcore_zoo.packed_forward(model.eval(), seqs).logits[0].shape[0]
    ps.destroy_model_parallel()
    return found


def test_moe_at_tp2_without_sequence_parallel_in_training_mode_is_named(two_rank_runs):
    """Megatron-Core's MoE layer refuses training mode at TP > 1 without sequence parallelism (a
    raw ValueError, under no_grad too): the zoo says so first, naming both ways out; eval runs."""
    for rank in two_rank_runs["moe-tp2-without-sp"]:
        assert "sequence_parallel=True" in rank["forward"] and "model.eval()" in rank["forward"]
        assert "sequence_parallel=True" in rank["train_step"]
        assert rank["eval"] == 12


def _gpt_oss_under_a_state_at_etp2(ckpt: str) -> str:
    from megatron.core import parallel_state as ps

    from mcore_zoo.errors import UnsupportedLayoutError
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel(Parallelism(tp=2))  # expert-TP follows TP: 2
    try:
        mcore_zoo.build_model(ckpt, backend="portable", parallel=Parallelism(tp=2), load=ckpt)
    except UnsupportedLayoutError as exc:
        return str(exc)
    finally:
        ps.destroy_model_parallel()
    return "built"


def test_gpt_oss_under_a_parallel_state_of_another_expert_tp_is_refused_by_name(two_rank_runs):
    """gpt-oss's experts (with biases) are built at expert-TP 1 under TP 2; a job whose parallel state
    splits experts over TP 2 would build them split while the load reads them whole: refused before
    anything is built, naming both sizes, the reason and the parallel state to create instead."""
    for message in two_rank_runs["gpt-oss-etp2"]:
        assert "etp=1" in message and "etp=2" in message and "biases" in message, message
        assert "ensure_model_parallel(Parallelism(tp=2, pp=1, ep=1, etp=1))" in message, message
