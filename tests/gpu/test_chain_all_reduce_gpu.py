"""The ``vllm-exact`` row-parallel sum at TP4 against NCCL's all-reduce as vLLM's batch-invariant
mode configures it (``vllm.model_executor.layers.batch_invariant.override_envs_for_invariance``:
tree algorithm, Simple protocol, one channel): bit for bit, on four GPUs of one node. The CPU
counterpart (tests/distributed/test_vllm_exact_tp.py) checks the order itself on gloo."""

from __future__ import annotations

import pytest
import torch

# what vLLM 0.26 sets in its worker under VLLM_BATCH_INVARIANT=1, before its communicators exist
BATCH_INVARIANT_NCCL = {
    "NCCL_LAUNCH_MODE": "GROUP", "NCCL_COLLNET_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "NCCL_P2P_NET_DISABLE": "1",
    "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1", "NCCL_PROTO": "Simple", "NCCL_ALGO": "allreduce:tree",
    "NCCL_NTHREADS": "1", "NCCL_SOCKET_NTHREADS": "1",
}  # fmt: skip


def _reduce_both_ways(shapes: list) -> list:
    import torch.distributed as dist

    from mcore_zoo.distributed.collectives import chain_all_reduce

    rank, out = dist.get_rank(), []
    for shape in shapes:
        g = torch.Generator(device="cuda").manual_seed(3 + rank)
        mine = (torch.randn(shape, device="cuda", generator=g) * torch.logspace(-3, 1, shape[-1], device="cuda"))
        mine = mine.to(torch.bfloat16)
        nccl = mine.clone()
        dist.all_reduce(nccl)
        zoo = chain_all_reduce(mine, dist.group.WORLD)
        out.append({"shape": shape, "equal": bool(torch.equal(nccl, zoo)), "share": float((nccl == zoo).float().mean())})
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_tree_order_sum_equals_batch_invariant_nccl_all_reduce_at_tp4():
    from mcore_zoo.distributed import launch

    shapes = [(1, 1024), (37, 4096), (398, 1024), (2048, 4096)]  # a decode step to a long prefill
    results = launch(_reduce_both_ways, 4, shapes, backend="nccl", env=BATCH_INVARIANT_NCCL)
    print({"tree_order_vs_nccl": results[0]})
    assert all(r["equal"] for ranks in results for r in ranks), results[0]
