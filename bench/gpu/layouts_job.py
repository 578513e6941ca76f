"""Several models at several parallel layouts in one job, on 4 GPUs: numbers, copy and offload speed.

Run from the repository root, with ``PYTHONPATH=src``::

    torchrun --nproc_per_node 4 bench/gpu/layouts_job.py --out out/layouts-4gpu

Four parts, each recorded on its own (a part that fails writes its error and the next one runs):

1. **job** - the several-layouts job of ``tests/distributed/test_model_layouts.py`` in bf16 over
   NCCL: a random Llama checkpoint (hidden 1024, 8 layers; written by rank 0) built as the actor at
   TP2 x PP2 (the job's parallel state), the reference at TP1 x DP4 and the critic (value head,
   ``value_head_init="normal"``) at PP2 x DP2, each on its own process groups. The one-GPU models
   are the same checkpoints at TP1 (every rank holds them whole, as a data-parallel replica: the
   forward is the one-GPU forward, the gradients the mean of identical replicas). Measured: the
   actor's log-probs and the critic's values against them, the gradients after ``train_step`` (the
   PPO actor loss and the clipped value loss of ``examples/rl_step.py``), then each model wrapped
   with ``mcore_zoo.wrap_for_training`` (Megatron-Core DDP, distributed Adam, ``clip_grad=1``): the
   clipped gradient norm ``optimizer.step()`` reports and the weights after that step; the actor
   copied into the reference (``mcore_zoo.copy_weights``; exported weights compared bit for bit)
   and the actor's offload round trip (parameters, gradients, optimizer state; bitwise).
2. **part-of-job** - beside the actor on every rank, a policy copy at TP2 on the last two ranks
   only (``build_model(..., ranks=...)``): its log-probs against the one-GPU model, the refusal on
   the other ranks, the actor's weights copied into it (timed; bitwise).
3. **bandwidth** - what the copies below are measured against, in the same run: a 1 GiB
   ``Tensor.copy_`` within a GPU and from GPU 0 to GPU 1, NCCL ``broadcast`` over the job and over
   the actor's pipeline group (the copy's route between stages), NCCL ``all_gather`` over the
   actor's tensor-parallel group, and the pinned host <-> device copy (with the time to pin 1 GiB).
4. **copy-8b** - an 8B-shaped Llama (``--copy-config``, default Llama-3.1-8B's published config,
   ``--copy-layers`` of its layers, random weights built on the devices) as the actor at TP2 x PP2
   and the reference at TP1 x DP4: ``copy_weights`` actor -> reference timed (twice: the first
   includes the allocator's first use), checked bit for bit against the actor's own shards; then
   the reference offloaded to host memory and back on rank 0 (twice: the first pins new host
   memory, the second reuses it), and the actor's shards on every rank at once, each checked
   bitwise on return.

Writes ``layouts_job.json`` and ``layouts_job.md`` to ``--out`` (after every part); exits 1 if a
part failed. On a
machine without GPUs, ``--device cpu --tiny`` runs the same logic on gloo in fp32 with small models
(``tests/distributed/test_layouts_job_script.py``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
ACTOR = {"tp": 2, "pp": 2}
CRITIC = {"pp": 2}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for layouts_job.json / .md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="portable")
    p.add_argument("--numerics", default="default")
    p.add_argument("--tiny", action="store_true", help="small models and buffers (CPU test runs)")
    p.add_argument("--parts", default="job,part-of-job,bandwidth,copy-8b", help="comma-separated subset of the parts")
    p.add_argument("--copy-config", default=str(ROOT / "tests/fixtures/configs/llama-3.1-8b.json"))
    p.add_argument("--copy-layers", type=int, default=32, help="decoder layers of the 8B-shaped model")
    p.add_argument("--bucket-size", default="512MB", help="copy_weights' bucket size for the 8B copy")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- setup
def init(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        try:  # before any other CUDA library (two cuDNNs otherwise: see the GPU notes)
            import transformer_engine.pytorch  # noqa: F401
        except Exception:  # the portable backend runs without it
            pass
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def release(args: argparse.Namespace) -> None:
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def small_config(args: argparse.Namespace) -> dict[str, Any]:
    import mcore_zoo

    config = mcore_zoo.lookup("LlamaForCausalLM").example_config()
    if args.tiny:
        config.update(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    else:
        config.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, head_dim=64, tie_word_embeddings=False)  # fmt: skip
    return config


def copy_config(args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads(Path(args.copy_config).read_text())
    config["num_hidden_layers"] = args.copy_layers
    if args.tiny:
        config.update(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=16, vocab_size=512)  # fmt: skip
    return config


def write_checkpoint(config: dict[str, Any], dtype: torch.dtype) -> str:
    """Rank 0 writes a random checkpoint into a temporary directory; every rank gets its path."""
    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    path = [None]
    if dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="mcore-zoo-layouts-job-")
        write_reference_checkpoint(mcore_zoo.lookup(config), config, path[0], seed=0, dtype=dtype)
    dist.broadcast_object_list(path, src=0)
    dist.barrier()
    return path[0]


def examples() -> Any:
    """``examples/rl_step.py`` (the PPO losses and the rollout batch)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import rl_step

    return rl_step


# ---------------------------------------------------------------------------- part 1: the job
def small_checkpoint(args: argparse.Namespace, dtype: torch.dtype) -> str:
    """The small random checkpoint of the job's parts, written once (removed by :func:`main`)."""
    if getattr(args, "checkpoint", None) is None:
        args.checkpoint = write_checkpoint(small_config(args), dtype)
    return args.checkpoint


def job(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    import mcore_zoo

    ex = examples()
    ckpt = small_checkpoint(args, dtype)
    build = {"backend": args.backend, "numerics": args.numerics, "params_dtype": dtype}
    value = {"head": "value", "value_head_init": "normal"}
    models = {
        "actor": mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(**ACTOR), load=ckpt, **build),
        "reference": mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(), load=ckpt, **build),
        "critic": mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(**CRITIC), load=ckpt, **value, **build),
        "critic-1gpu": mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(), load=ckpt, **value, **build),
    }
    # (model, its one-GPU counterpart, critic?): the reference at TP1 is the actor's one-GPU model
    pairs = {"actor": ("actor", "reference", False), "critic": ("critic", "critic-1gpu", True)}
    batch = ex.rollout_batch(mcore_zoo.handle_of(models["actor"]).arch_config.vocab_size, prompts=4, group=4)
    seqs = [s.to(args.device) for s in batch["sequences"]]
    arch = mcore_zoo.handle_of(models["actor"]).arch_config
    out: dict[str, Any] = {"lengths": [int(s.numel()) for s in seqs],
                           "model": f"hidden {arch.hidden_size}, {arch.num_layers} layers, vocab {arch.vocab_size}",
                           "own_groups": {k: mcore_zoo.handle_of(m).placement.own_groups for k, m in models.items()}}  # fmt: skip

    def forward(name: str) -> list[torch.Tensor]:
        with torch.no_grad():
            result = mcore_zoo.packed_forward(models[name], seqs, return_logits=False)
        return [t.float().cpu() for t in (result.values if name.startswith("critic") else result.logprobs)]

    found = {name: forward(name) for name in models}
    for name, (got, want, _) in pairs.items():
        out[f"{name}_forward_max_abs_diff"] = _max_diff(found[got], found[want])
        out[f"{name}_forward_max_abs"] = max(t.abs().max().item() for t in found[want])
    token_data = {
        False: {"old_logprobs": found["reference"], "ref_logprobs": found["reference"],
                "advantages": batch["advantages"], "loss_mask": batch["loss_mask"]},
        True: {"old_values": found["critic-1gpu"], "loss_mask": batch["loss_mask"],
               "returns": [torch.full((s.numel(),), r) for s, r in zip(seqs, batch["rewards"])]},
    }  # fmt: skip
    tokens = float(sum(m.sum() for m in batch["loss_mask"]))

    def step(model: Any, critic: bool) -> float:
        loss = ex.value_loss() if critic else ex.ppo_actor_loss()
        result = mcore_zoo.train_step(model, seqs, loss, token_data=token_data[critic], loss_normalizer=tokens,
                                      compute_entropy=not critic, max_tokens_per_microbatch=64)  # fmt: skip
        return result.loss.item()

    # gradients of the unwrapped models (train_step reduces them itself), gathered to rank 0
    for name, (got, want, critic) in pairs.items():
        losses, grads = {}, {}
        for key in (got, want):
            losses[key] = step(models[key], critic)
            grads[key] = {k: v.float().cpu() for k, v in mcore_zoo.iter_hf_weights(models[key], grads=True, ranks=[0])}
            for p in models[key].parameters():
                p.grad = None
        out[f"{name}_loss"], out[f"{name}_loss_1gpu"] = losses[got], losses[want]
        if grads[want]:
            diffs = [(grads[got][k] - g).abs().max().item() for k, g in grads[want].items()]
            out[f"{name}_grad_max_abs_diff"] = max(diffs)
            out[f"{name}_grad_max_abs"] = max(g.abs().max().item() for g in grads[want].values())
    # Megatron-Core's DDP and distributed optimizer on each model's groups: one clipped step
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=True,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype)  # fmt: skip
    setups = {name: mcore_zoo.wrap_for_training(models[name], config) for name in models}
    for name, (got, want, critic) in pairs.items():
        norms = {}
        for key in (got, want):
            setups[key].zero_grad()
            step(setups[key].model, critic)
            success, norms[key], _ = setups[key].optimizer.step()
            out[f"{key}_step_success"] = bool(success)
        out[f"{name}_grad_norm"], out[f"{name}_grad_norm_1gpu"] = (None if norms[k] is None else float(norms[k]) for k in (got, want))
        weights = [{k: v.float().cpu() for k, v in mcore_zoo.iter_hf_weights(setups[key].model, ranks=[0])} for key in (got, want)]
        if weights[1]:
            out[f"{name}_weights_after_step_max_abs_diff"] = max((weights[0][k] - v).abs().max().item() for k, v in weights[1].items())
    # the actor (now one step from the checkpoint) into the reference, bit for bit
    report = mcore_zoo.copy_weights(setups["actor"].model, setups["reference"].model, bucket_size="4MB")
    out["copy"] = {"buckets": report.buckets, "parameters": report.parameters, "seconds": report.seconds,
                   "bitwise": exports_equal(setups["actor"].model, setups["reference"].model)}  # fmt: skip
    # the actor's parameters, gradients and optimizer state to host memory and back
    out["offload"] = offload_round_trip(args, setups["actor"].model, setups["actor"].optimizer)
    return out


def part_of_job(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Beside the actor on every rank, a policy copy at TP2 on the last two ranks
    (``build_model(..., ranks=...)``): its log-probs against the one-GPU model where it is held,
    the refusal elsewhere, and the actor's weights copied into it (timed; bitwise)."""
    import mcore_zoo

    ex = examples()
    ckpt = small_checkpoint(args, dtype)
    build = {"backend": args.backend, "numerics": args.numerics, "params_dtype": dtype, "load": ckpt}
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = [world - 2, world - 1]
    actor = mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(**ACTOR), **build)
    one_gpu = mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(), **build)
    policy = mcore_zoo.build_model(ckpt, parallel=mcore_zoo.Parallelism(tp=2), ranks=ranks, **build)
    batch = ex.rollout_batch(mcore_zoo.handle_of(actor).arch_config.vocab_size, prompts=4, group=4)
    seqs = [s.to(args.device) for s in batch["sequences"]]
    out: dict[str, Any] = {"model_ranks": ranks, "holds_model": mcore_zoo.handle_of(policy).placement.holds_model}
    with torch.no_grad():
        want = [t.float().cpu() for t in mcore_zoo.packed_forward(one_gpu, seqs, return_logits=False).logprobs]
        if rank in ranks:
            got = [t.float().cpu() for t in mcore_zoo.packed_forward(policy, seqs, return_logits=False).logprobs]
            out["forward_max_abs_diff"] = _max_diff(got, want)
        else:
            try:
                mcore_zoo.packed_forward(policy, seqs)
                out["refused"] = None
            except mcore_zoo.NotOnThisRankError as exc:
                out["refused"] = str(exc)
        for p in actor.parameters():  # the actor moves off the checkpoint: the copy must carry it
            p.mul_(1.0 + 2.0**-4)
    dist.barrier()
    sync(args)
    start = time.perf_counter()
    report = mcore_zoo.copy_weights(actor, policy, bucket_size="4MB")
    sync(args)
    out["copy"] = {"seconds": time.perf_counter() - start, "parameters": report.parameters,
                   "bytes_received": report.bytes_received}  # fmt: skip
    source = {k: v.cpu().clone() for k, v in mcore_zoo.iter_hf_weights(actor, ranks=ranks)}
    if rank in ranks:
        copied = {k: v.cpu() for k, v in mcore_zoo.iter_hf_weights(policy)}
        out["copy"]["bitwise"] = set(copied) == set(source) and all(torch.equal(copied[k], source[k]) for k in source)
    return out


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def exports_equal(a: Any, b: Any) -> Optional[bool]:
    """Whether two models export the same HF tensors bit for bit (gathered to rank 0; ``None``
    elsewhere). Every rank calls it."""
    import mcore_zoo

    first = {k: v.cpu().clone() for k, v in mcore_zoo.iter_hf_weights(a, ranks=[0])}
    second = {k: v.cpu() for k, v in mcore_zoo.iter_hf_weights(b, ranks=[0])}
    if dist.get_rank() != 0:
        return None
    return set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


def training_tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The parameters, ``main_grad`` buffers and optimizer state of a wrapped model (what a round
    trip through host memory must bring back)."""
    out = []
    for p in model.parameters():
        out += [p.data] + ([p.main_grad] if getattr(p, "main_grad", None) is not None else [])
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", inner)
        for state in getattr(torch_optimizer, "state", {}).values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        for group in getattr(torch_optimizer, "param_groups", []):
            out += [p.data for p in group["params"]]
    return out


def offload_round_trip(args: argparse.Namespace, model: Any, optimizer: Any = None) -> dict[str, Any]:
    """``mcore_zoo.offload`` and ``restore`` of ``model`` (and ``optimizer``'s state), checked
    bitwise against copies taken before on the same device."""
    import mcore_zoo

    tensors = training_tensors(model, optimizer) if optimizer is not None else [p.data for p in model.parameters()]
    before = [t.clone() for t in tensors]
    sync(args)
    parked = mcore_zoo.offload(model, optimizer)
    offload_s = parked.seconds
    parked.restore()
    result = {"bytes": parked.nbytes, "offload_s": offload_s, "restore_s": parked.seconds,
              "bitwise": all(torch.equal(a, b) for a, b in zip(tensors, before))}  # fmt: skip
    del before
    release(args)
    return result


# ---------------------------------------------------------------------------- part 2: bandwidth
def timed(args: argparse.Namespace, fn: Callable[[], Any], repeat: int = 5, group: Any = None) -> float:
    """The median wall time of ``fn`` after one warm-up, synchronised (and barriered over ``group``
    when given) before each run."""
    runs = []
    for i in range(repeat + 1):
        if group is not None:
            dist.barrier(group=group)
        sync(args)
        start = time.perf_counter()
        fn()
        sync(args)
        if i:
            runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def bandwidth(args: argparse.Namespace, groups: dict[str, Any]) -> dict[str, Any]:
    """GB/s of the reference copies (bytes moved / s, 1e9 bytes per GB); ``groups``: name -> a
    process group of this rank, for the NCCL measurements."""
    nbytes = (16 << 20) if args.tiny else GIB
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    out: dict[str, Any] = {"bytes": nbytes, "device_copy": nbytes / timed(args, lambda: b.copy_(a)) / 1e9}
    dist.barrier()
    if args.device == "cuda" and torch.cuda.device_count() > 1 and dist.get_rank() == 0:
        peer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        seconds = timed(args, lambda: (peer.copy_(a), torch.cuda.synchronize(peer.device)))
        out["peer_copy_gpu0_to_gpu1"] = nbytes / seconds / 1e9
    dist.barrier()
    for name, group in groups.items():
        if group is None:
            continue
        src = dist.get_process_group_ranks(group)[0]
        out[f"nccl_broadcast_{name}"] = nbytes / timed(args, lambda: dist.broadcast(a, src=src, group=group), group=group) / 1e9
        size = dist.get_world_size(group)
        parts = list(torch.empty(nbytes, dtype=torch.uint8, device=device).chunk(size))
        piece = a[: parts[0].numel()]
        seconds = timed(args, lambda: dist.all_gather(parts, piece, group=group), group=group)
        out[f"nccl_all_gather_{name}"] = nbytes / seconds / 1e9  # the gathered bytes each rank ends with
    if args.device == "cuda":
        start = time.perf_counter()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["pin_1gib_s"] = time.perf_counter() - start
        out["pinned_device_to_host"] = nbytes / timed(args, lambda: host.copy_(a, non_blocking=True)) / 1e9
        out["pinned_host_to_device"] = nbytes / timed(args, lambda: a.copy_(host, non_blocking=True)) / 1e9
    return out


# ---------------------------------------------------------------------------- part 3: the 8B copy
def copy_8b(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    import mcore_zoo

    config = copy_config(args)
    build = {"backend": args.backend, "params_dtype": dtype}
    start = time.perf_counter()
    actor = mcore_zoo.build_model(config, parallel=mcore_zoo.Parallelism(**ACTOR), **build)
    reference = mcore_zoo.build_model(config, parallel=mcore_zoo.Parallelism(), **build)
    sync(args)
    out: dict[str, Any] = {
        "model": {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "vocab_size")},
        "build_s": time.perf_counter() - start,
        "bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "actor_bytes_per_rank": sum(p.numel() * p.element_size() for p in actor.parameters()),
        "bucket_size": args.bucket_size,
    }  # fmt: skip
    out["bitwise_before_copy"] = _all_ranks(shards_equal(actor, reference))  # random, independent: False
    runs = []
    for _ in range(2):
        dist.barrier()
        sync(args)
        start = time.perf_counter()
        report = mcore_zoo.copy_weights(actor, reference, bucket_size=args.bucket_size)
        sync(args)
        dist.barrier()
        runs.append({"seconds": time.perf_counter() - start, "buckets": report.buckets,
                     "bytes_received": report.bytes_received})  # fmt: skip
    out["copies"] = runs
    out["bitwise"] = _all_ranks(shards_equal(actor, reference))
    if args.device == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    # the reference to host memory and back on rank 0 alone, twice; then the actor on every rank at once
    rounds = []
    for _ in range(2):
        dist.barrier()
        if dist.get_rank() == 0:
            parked = mcore_zoo.offload(reference)
            offload_s = parked.seconds
            parked.restore()
            rounds.append({"bytes": parked.nbytes, "offload_s": offload_s, "restore_s": parked.seconds})
            del parked
        dist.barrier()
    out["reference_offload_rank0"] = rounds
    out["reference_offload_bitwise"] = _all_ranks(shards_equal(actor, reference))
    dist.barrier()
    out["actor_offload_every_rank"] = offload_round_trip(args, actor)
    dist.barrier()
    return out


def _all_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bool(flag))
    return all(gathered)


def shards_equal(actor: Any, reference: Any) -> bool:
    """Whether this rank's shards of ``actor`` (any TP x PP) are bit for bit the matching slices of
    ``reference`` (TP1 x PP1, the whole model on every rank): layers matched by their global number,
    tensor-parallel parameters cut along their ``partition_dim`` (``linear_fc1`` of a gated MLP: gate
    and up cut apart, as Megatron-Core lays them out per TP rank)."""
    import mcore_zoo

    placement = mcore_zoo.handle_of(actor).placement
    tp, rank = placement.tp, placement.tp_rank
    gated = bool(getattr(reference.config, "gated_linear_unit", False))
    ref_layers = {layer.layer_number: layer for layer in reference.decoder.layers}
    pairs = []
    for layer in actor.decoder.layers:
        theirs = dict(ref_layers[layer.layer_number].named_parameters())
        pairs += [(name, p, theirs[name]) for name, p in layer.named_parameters()]
    theirs = dict(reference.named_parameters())
    pairs += [(name, p, theirs[name]) for name, p in actor.named_parameters() if not name.startswith("decoder.layers.")]
    for name, mine, whole in pairs:
        if getattr(mine, "tensor_model_parallel", False) and tp > 1:
            dim = mine.partition_dim
            if gated and name.endswith("linear_fc1.weight"):
                whole = torch.cat([half.chunk(tp, dim)[rank] for half in whole.chunk(2, dim)], dim)
            else:
                whole = whole.chunk(tp, dim)[rank]
        if mine.shape != whole.shape or not torch.equal(mine, whole):
            return False
    return True


# ---------------------------------------------------------------------------- report
PARTS = {"job": job, "part-of-job": part_of_job, "bandwidth": None, "copy-8b": copy_8b}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    init(args)
    import mcore_zoo

    rank = dist.get_rank()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "world_size": dist.get_world_size(), "backend": args.backend, "numerics": args.numerics,
        "dtype": str(dtype).replace("torch.", ""), "versions": versions(), "parts": {},
    }  # fmt: skip
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            if part == "bandwidth":
                from mcore_zoo.parallel import ensure_model_parallel

                ensure_model_parallel(mcore_zoo.Parallelism(**ACTOR))  # the actor's groups: the copy's route
                from megatron.core import parallel_state as ps

                groups = {"job": dist.group.WORLD, "actor_pp": ps.get_pipeline_model_parallel_group(),
                          "actor_tp": ps.get_tensor_model_parallel_group()}  # fmt: skip
                entry = bandwidth(args, groups)
            else:
                entry = PARTS[part](args, dtype)
        except Exception as exc:  # recorded; the next part runs
            entry = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        entry["wall_s"] = time.perf_counter() - start
        release(args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry)
        results["parts"][part] = merge(gathered)
        if rank == 0:  # after every part: a later part that hangs leaves these
            print(f"{part}: {json.dumps(results['parts'][part], default=str)[:2000]}", flush=True)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "layouts_job.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
            (out / "layouts_job.md").write_text(markdown(results))
    if rank == 0:
        print(markdown(results))
        if getattr(args, "checkpoint", None):
            shutil.rmtree(args.checkpoint, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any("error" in e for e in results["parts"].values()) else 0


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's entry, with every rank's error (by rank) and the other ranks' entries under
    ``other_ranks``."""
    merged = dict(per_rank[0])
    errors = {str(r): e["error"] for r, e in enumerate(per_rank) if "error" in e}
    if errors:
        merged["error"] = errors
        merged["tracebacks"] = {str(r): e.get("traceback") for r, e in enumerate(per_rank) if "error" in e}
        merged.pop("traceback", None)
    merged["other_ranks"] = [{k: v for k, v in e.items() if k not in ("traceback",)} for e in per_rank[1:]]
    return merged


def versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    found = {}
    for name in ("torch", "megatron-core", "transformer-engine", "mcore-zoo"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__
    return found


def _fmt(value: Any, spec: str = ".3g") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def markdown(results: dict[str, Any]) -> str:
    parts = results["parts"]
    lines = [f"# Several models at several layouts in one job ({results['world_size']} x {results['device']})", "",
             f"Backend `{results['backend']}`, numerics `{results['numerics']}`, {results['dtype']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v), ""]  # fmt: skip
    for name, entry in parts.items():
        if "error" in entry:
            first = next(iter(entry["error"].values()))
            lines += [f"## {name}: failed", "", f"`{str(first)[:400]}`", ""]
    job_entry = parts.get("job", {})
    if "error" not in job_entry and job_entry:
        e = job_entry
        lines += ["## The job: actor TP2 x PP2, reference TP1 x DP4, critic PP2 x DP2 vs the same model on one GPU", "",
                  f"Random Llama ({e['model']}), {len(e['lengths'])} packed sequences of {e['lengths']} tokens.", "",
                  "| model | forward max abs diff (of max abs) | loss / one GPU | gradients max abs diff (of max abs) |"
                  " clipped grad norm / one GPU | weights after the step: max abs diff |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for m in ("actor", "critic"):
            lines.append(
                f"| {m} | {_fmt(e.get(f'{m}_forward_max_abs_diff'))} ({_fmt(e.get(f'{m}_forward_max_abs'))})"
                f" | {_fmt(e.get(f'{m}_loss'), '.6g')} / {_fmt(e.get(f'{m}_loss_1gpu'), '.6g')}"
                f" | {_fmt(e.get(f'{m}_grad_max_abs_diff'))} ({_fmt(e.get(f'{m}_grad_max_abs'))})"
                f" | {_fmt(e.get(f'{m}_grad_norm'), '.6g')} / {_fmt(e.get(f'{m}_grad_norm_1gpu'), '.6g')}"
                f" | {_fmt(e.get(f'{m}_weights_after_step_max_abs_diff'))} |"
            )
        c, o = e["copy"], e["offload"]
        lines += ["", f"Actor -> reference `copy_weights` after the step: bitwise {c['bitwise']}, {c['buckets']} buckets,"
                  f" {c['seconds']:.3f} s. Actor offload round trip (parameters, gradients, optimizer state,"
                  f" {o['bytes'] / 1e9:.3g} GB on rank 0): bitwise {o['bitwise']}, {o['offload_s']:.3f} s out,"
                  f" {o['restore_s']:.3f} s back.", ""]  # fmt: skip
    sub = parts.get("part-of-job", {})
    if "error" not in sub and sub:
        held = [r for r in [sub, *sub.get("other_ranks", [])] if "forward_max_abs_diff" in r]
        lines += [f"## A policy copy at TP2 on ranks {sub['model_ranks']} beside the actor on every rank", "",
                  f"Log-probs vs the one-GPU model: max abs diff {_fmt(max((r['forward_max_abs_diff'] for r in held), default=None))}"
                  f" on the model's ranks; elsewhere refused: `{str(sub.get('refused'))[:160]}`. Actor -> policy copy:"
                  f" bitwise {all(r['copy'].get('bitwise') for r in held) if held else None},"
                  f" {sub['copy']['seconds']:.3f} s on rank 0 (which receives nothing).", ""]  # fmt: skip
    bw = parts.get("bandwidth", {})
    if "error" not in bw and bw:
        lines += ["## Reference bandwidths (GB/s, rank 0)", "", "| copy | GB/s |", "| --- | --- |"]
        lines += [f"| {k} | {v:.1f} |" for k, v in bw.items() if isinstance(v, float) and k not in ("wall_s", "pin_1gib_s")]
        if "pin_1gib_s" in bw:
            lines.append(f"| (pinning {bw['bytes'] / GIB:.3g} GiB of host memory takes {bw['pin_1gib_s']:.3f} s) | |")
        lines.append("")
    cp = parts.get("copy-8b", {})
    if "error" not in cp and cp:
        m = cp["model"]
        gb = cp["bytes"] / 1e9
        lines += [f"## Actor (TP2 x PP2) -> reference (TP1 x DP4) copy of an 8B-shaped model ({gb:.3g} GB {results['dtype']})", "",
                  f"Hidden {m['hidden_size']}, FFN {m['intermediate_size']}, {m['num_hidden_layers']} layers,"
                  f" {m['num_attention_heads']}/{m['num_key_value_heads']} heads, vocab {m['vocab_size']}; random weights"
                  f" built on the devices in {cp['build_s']:.1f} s; buckets of {cp['bucket_size']}. Every rank receives"
                  f" the whole model. Bitwise after the copy: {cp['bitwise']} (before: {cp['bitwise_before_copy']}).", "",
                  "| run | seconds | GB/s (model bytes / s, per rank) | buckets |", "| --- | --- | --- | --- |"]  # fmt: skip
        for i, run in enumerate(cp["copies"]):
            lines.append(f"| {i + 1} | {run['seconds']:.3f} | {gb / run['seconds']:.1f} | {run['buckets']} |")
        lines += ["", "Offload round trips (`mcore_zoo.offload` / `restore`):", "",
                  "| what | GB | to host s | GB/s | back s | GB/s | bitwise |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for i, r in enumerate(cp["reference_offload_rank0"]):
            g = r["bytes"] / 1e9
            lines.append(f"| reference on rank 0, round {i + 1} | {g:.3g} | {r['offload_s']:.3f} | {g / r['offload_s']:.1f}"
                         f" | {r['restore_s']:.3f} | {g / r['restore_s']:.1f} | {cp['reference_offload_bitwise']} |")  # fmt: skip
        a = cp["actor_offload_every_rank"]
        g = a["bytes"] / 1e9
        lines.append(f"| actor shard, every rank at once (rank 0) | {g:.3g} | {a['offload_s']:.3f} | {g / a['offload_s']:.1f}"
                     f" | {a['restore_s']:.3f} | {g / a['restore_s']:.1f} | {a['bitwise']} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
