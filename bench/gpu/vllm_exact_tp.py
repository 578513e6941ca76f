"""``vllm-exact`` at tensor parallel size 2 (or 4): the trainer (TP2) against a TP2 vLLM engine in
batch-invariant mode, on two GPUs::

    source bench/gpu/vllm-env.sh
    torchrun --standalone --nproc_per_node 2 bench/gpu/vllm_exact_tp.py --arch LlamaForCausalLM --out /tmp/tp2-llama.json

The GPU test's setup (tests/gpu/test_vllm_exact_gpu.py: random checkpoint at head size 128, four
prompts, 48 sampled tokens each), with both sides split over two GPUs: the zoo model built with
``Parallelism(tp=2)`` and exported, a ``vllm.LLM`` with ``tensor_parallel_size=2`` under
``external_launcher`` (engine rank = trainer rank, one process per GPU). The zoo then runs one
THD pack of prompt + continuation; its log-probs of the sampled and the prompt tokens are compared
bit for bit with the engine's (every rank computes them; rank 0 writes the JSON). ``--tp 1``
runs the same comparison in one process (the single-GPU reference of this script). ``--tp 4
--kv-heads 4`` on four GPUs: the same with four key-value heads (one per rank). Above TP2 the JSON
also has ``allreduce_probe``: the engine's TP all-reduce against the zoo's row-parallel sum (NCCL's
tree order, which vLLM's batch-invariant mode pins) on the same partials, and which chain orders
of the ranks reproduce it.

Gradients: one ``train_step`` of ``-sum(log-probs)`` on the same pack, gathered over TP under HF
names (``iter_hf_weights(grads=True)``), against an ``hf-exact`` model of the same layout
(relative L2, as the GPU test reports at TP1). ``--grads FILE`` saves them with the pack's tokens
(safetensors) when it does not exist, and otherwise takes the saved tokens (two engines may sample
differently) and compares with the saved gradients: run ``--tp 1 --grads F`` first, then TP2 with
the same ``F`` for the distance of the TP2 backward to the TP1 one (bf16: only the row-parallel
partial sums and the all-reduces add in another order).

Qwen3-MoE (the GPU test's MoE case: 8 experts, top-2)::

    torchrun --standalone --nproc_per_node 2 bench/gpu/vllm_exact_tp.py --arch Qwen3MoeForCausalLM --out /tmp/tp2-moe.json
    torchrun --standalone --nproc_per_node 2 bench/gpu/vllm_exact_tp.py --arch Qwen3MoeForCausalLM --ep 2 --out /tmp/ep2-moe.json

DeepSeek-V3 (``--arch DeepseekV3ForCausalLM``, the test's engine arguments: ``FLASH_ATTN_MLA``,
``long_prefill_token_threshold=512``) runs the same way (TP2 and TP2 x EP2 bitwise on two H200s,
docs/parity/vllm-gpu/vllm-exact/README.md).

At TP2 the engine splits every expert's intermediate dimension over the two ranks and the trainer
is built with ``Parallelism(tp=2)`` (expert-TP follows TP); ``--ep 2`` starts the engine with
``enable_expert_parallel=True`` (four whole experts per rank) and builds the trainer with
``Parallelism(tp=2, ep=2, etp=1)``. The JSON then has ``moe_dispatch`` (the engine's MoE classes,
as the GPU test reports them at TP1: TritonExperts and the no-DP/EP prepare / finalize are the
path the zoo reproduces) and ``engine_expert_map`` (each rank's global -> local expert map).
Megatron-Core's own MoE layer does not train at TP > 1 without sequence parallelism, so the
``hf-exact`` gradient reference of an MoE model at TP > 1 is built with ``sequence_parallel=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_BATCH_INVARIANT"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="LlamaForCausalLM", help="one of the GPU test's dense built-ins (one engine per process)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size of an MoE model: 1, or --tp (the engine with"
                    " enable_expert_parallel=True, the trainer with Parallelism(tp=TP, ep=TP, etp=1))")
    ap.add_argument("--out")
    ap.add_argument("--kv-heads", type=int, help="num_key_value_heads (the test's 2 by default; at TP4 give 4 to both "
                    "the --tp 1 reference and the TP4 run: Megatron-Core splits whole key-value heads)")
    ap.add_argument("--grads", help="safetensors file: written if absent, else the reference the gradients are compared with")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import vllm
    from test_vllm_exact_gpu import ARCHS, ENGINE_ARGS, PROMPTS, SIZES, _sample

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint
    from mcore_zoo.placement import Parallelism
    from mcore_zoo.rollout import VLLM_WORKER_EXTENSION
    from mcore_zoo.testing.common import case_config, random_sequences

    rank = int(os.environ.get("RANK", "0"))
    if args.ep not in (1, args.tp):
        raise SystemExit(f"--ep {args.ep}: vLLM's expert parallelism at data parallel 1 splits the experts over"
                         f" the TP ranks: give --ep 1 or --ep {args.tp}")  # fmt: skip
    parallel = Parallelism(tp=args.tp, ep=args.ep, etp=1) if args.ep > 1 else Parallelism(tp=args.tp)
    kv_heads = {"num_key_value_heads": args.kv_heads} if args.kv_heads else {}
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    results = []
    for arch in [args.arch]:
        tmp = os.path.join(tempfile.gettempdir(), f"vllm-exact-tp{args.tp}-ep{args.ep}-{arch}")
        ckpt = os.path.join(tmp, f"ckpt-rank{rank}")  # the same seed on every rank: the same bytes
        write_reference_checkpoint(mcore_zoo.lookup(arch), case_config(arch, {**SIZES, **dict(ARCHS)[arch], **kv_heads}), ckpt,
                                   seed=0, dtype=torch.bfloat16)  # fmt: skip
        model = mcore_zoo.build_model(ckpt, backend="local", numerics="vllm-exact", params_dtype=torch.bfloat16, load=ckpt,
                                      parallel=parallel)  # fmt: skip
        export = os.path.join(tmp, "export")
        mcore_zoo.save_hf_checkpoint(model, export, overwrite=True)  # the parameters' dtypes, as a refit sends them
        if dist.is_initialized():
            dist.barrier()
        kwargs = dict(model=export, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                      max_model_len=512, gpu_memory_utilization=0.3, enable_prefix_caching=False, block_size=16,
                      worker_extension_cls=VLLM_WORKER_EXTENSION, tensor_parallel_size=args.tp,
                      **{"attention_backend": "FLASH_ATTN", **ENGINE_ARGS.get(arch, {})})  # fmt: skip
        if args.tp > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if args.ep > 1:
            kwargs["enable_expert_parallel"] = True
        llm = vllm.LLM(**kwargs)
        moe = _moe_report(llm) if mcore_zoo.handle_of(model).arch_config.moe is not None else {}
        if moe and rank == 0:
            print(json.dumps(moe), flush=True)
        probe = _allreduce_probe(model) if args.tp > 2 else {}
        if probe and rank == 0:
            print(json.dumps({"allreduce_probe": probe}), flush=True)
        vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
        prompts = random_sequences(PROMPTS, vocab, seed=7)
        sampled = _sample(llm, prompts)
        full = [torch.cat([p, g]) for p, (g, _, _) in zip(prompts, sampled)]
        out = mcore_zoo.packed_forward(model, [s.cuda() for s in full])
        r = {"arch": arch, "tp": args.tp, "ep": args.ep, **moe, "generated": 0, "generated_bitwise": 0, "prompt": 0, "prompt_bitwise": 0,
             "generated_max_abs": 0.0, "prompt_max_abs": 0.0, "generated_mean_abs": 0.0}  # fmt: skip
        diffs = []
        for p, (g, gen_lp, prompt_lp), lp in zip(prompts, sampled, out.logprobs):
            lp = lp.float().cpu()
            mine_gen, mine_prompt = lp[len(p) - 1 :], lp[: len(p) - 1]
            r["generated"] += gen_lp.numel()
            r["generated_bitwise"] += int((mine_gen == gen_lp).sum())
            r["generated_max_abs"] = max(r["generated_max_abs"], float((mine_gen - gen_lp).abs().max()))
            diffs.append((mine_gen - gen_lp).abs())
            r["prompt"] += prompt_lp.numel()
            r["prompt_bitwise"] += int((mine_prompt == prompt_lp).sum())
            if prompt_lp.numel():
                r["prompt_max_abs"] = max(r["prompt_max_abs"], float((mine_prompt - prompt_lp).abs().max()))
        r["generated_mean_abs"] = float(torch.cat(diffs).mean())
        # token_mult_prob_error as the RL frameworks gate it: exp(mean |dlogp|) over the sampled tokens
        r["token_mult_prob_error"] = float(torch.exp(torch.cat(diffs).mean()))
        if probe:
            r["allreduce_probe"] = probe
        if rank == 0:
            print(json.dumps(r), flush=True)
        r.update(_gradients(model, ckpt, [s.cuda() for s in full], args, parallel))
        if rank == 0:
            print(json.dumps({k: v for k, v in r.items() if k.startswith("grad")}), flush=True)
        results.append(r)
        del llm, model
        torch.cuda.empty_cache()
    if rank == 0:
        payload = {"gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "results": results}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(payload, f, indent=1)


def _moe_report(llm) -> dict:
    """The engine's MoE path on this rank: ``moe_dispatch`` (tests/gpu/test_vllm_exact_gpu.py) and
    ``engine_expert_map`` (the first MoE layer's ``expert_map``: global -> local expert, -1 for
    another rank's; ``None`` without expert parallelism)."""
    from test_vllm_exact_gpu import moe_dispatch

    report: dict = {}
    for key, fn in (("moe_dispatch", moe_dispatch), ("engine_expert_map", _engine_expert_map)):
        try:
            report[key] = llm.collective_rpc(fn)[0]
        except Exception as exc:  # reported, not fatal: the log-prob comparison still runs
            report[key] = {"error": repr(exc)[:300]}
    return report


def _engine_expert_map(worker):
    """The ``expert_map`` of the engine model's first fused-MoE layer (a ``collective_rpc`` function):
    a list (global -> local expert, -1 for another rank's), ``None`` (that layer has no map: no
    expert parallelism), or ``"no fused-MoE layer found"``."""
    for module in worker._zoo_model().modules():
        if hasattr(module, "expert_map_manager"):  # vLLM 0.26: the MoE runner and its routed experts
            mapping = module.expert_map_manager.expert_map  # (both forward to the manager's map)
            return None if mapping is None else mapping.tolist()
    return "no fused-MoE layer found"


def _allreduce_probe(model, shape: tuple = (398, 1024)) -> dict:
    """The engine's tensor-parallel all-reduce (``tensor_model_parallel_all_reduce``, what vLLM's
    ``RowParallelLinear`` calls) against the zoo's row-parallel sum on the same bf16 partials: whether
    the zoo's tree order (:func:`mcore_zoo.distributed.collectives.chain_all_reduce`) gives the
    engine's bits, which chain orders of the ranks do (share of elements equal for each order, the
    root first), and a plain all-reduce on the trainer's communicator next to them."""
    import itertools

    import torch
    import torch.distributed as dist
    from vllm.distributed import tensor_model_parallel_all_reduce

    import mcore_zoo
    from mcore_zoo.distributed.collectives import chain_all_reduce, chain_sum

    group = mcore_zoo.handle_of(model).placement.groups.tp
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator(device="cuda").manual_seed(5)
    partials = (torch.randn((size, *shape), device="cuda", generator=g)
                * torch.logspace(-3, 1, shape[-1], device="cuda")).to(torch.bfloat16)  # fmt: skip
    engine = tensor_model_parallel_all_reduce(partials[rank].clone())
    zoo = chain_all_reduce(partials[rank].clone(), group)
    plain = partials[rank].clone()
    dist.all_reduce(plain, group=group)

    def share(t: torch.Tensor) -> float:
        return float((t == engine).float().mean())

    orders = {"".join(map(str, o)): share(chain_sum(partials[list(o)])) for o in itertools.permutations(range(size))}
    return {
        "shape": list(shape), "zoo_tree_order_bitwise": bool(torch.equal(zoo, engine)), "zoo_tree_order_share": share(zoo),
        "trainer_all_reduce_share": share(plain), "fp32_sum_share": share(partials.float().sum(0).to(torch.bfloat16)),
        "chain_orders_bitwise": sorted(o for o, v in orders.items() if v == 1.0), "chain_order_share": orders,
        "nccl_env": {k: os.environ.get(k) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS")},
    }  # fmt: skip


def _gradients(model, ckpt: str, seqs: list, args, parallel) -> dict:
    """Gradients of ``-sum(log-probs)`` against ``hf-exact``'s at the same layout (an MoE model at
    TP > 1: with sequence parallelism, which Megatron-Core's MoE layer needs to train), and against
    the saved ones of ``--grads`` (see the module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    from test_vllm_exact_gpu import _loss, grad_rel_l2

    import mcore_zoo

    def grads(m) -> dict:
        m.zero_grad(set_to_none=True)  # train_step adds to what .grad holds
        mcore_zoo.train_step(m, seqs, _loss)
        return {n: g.detach().float().cpu() for n, g in mcore_zoo.iter_hf_weights(m, grads=True)}  # gathered: every rank

    saved: dict = {}
    if args.grads and os.path.exists(args.grads):
        saved = load_file(args.grads)  # the reference's sequences too: the engines may sample differently
        seqs = [saved.pop(f"tokens.{i}").cuda() for i in range(sum(k.startswith("tokens.") for k in saved))]
    mine = grads(model)
    moe = mcore_zoo.handle_of(model).arch_config.moe is not None
    ref_parallel = parallel.replace(sequence_parallel=True) if moe and args.tp > 1 else parallel
    r: dict = {}
    try:
        ref = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact", params_dtype=torch.bfloat16, load=ckpt,
                                    parallel=ref_parallel)  # fmt: skip
        r["grad_rel_l2_vs_hf_exact"], r["grad_rel_l2_worst_param"] = grad_rel_l2(mine, grads(ref))
        del ref
    except Exception as exc:  # the reference is a report, not the comparison this script exists for
        r["grad_vs_hf_exact_error"] = repr(exc)[:300]
    if args.grads:
        if saved:
            assert set(saved) == set(mine), sorted(set(saved) ^ set(mine))[:5]
            r["grad_reference"] = args.grads
            r["grad_rel_l2_vs_reference"], r["grad_rel_l2_vs_reference_worst_param"] = grad_rel_l2(mine, saved)
            r["grad_bitwise_vs_reference"] = sum(int(torch.equal(mine[n], saved[n])) for n in saved)
            r["grad_tensors"] = len(saved)
        elif int(os.environ.get("RANK", "0")) == 0:
            tokens = {f"tokens.{i}": t.cpu().contiguous() for i, t in enumerate(seqs)}
            save_file({**{n: g.contiguous() for n, g in mine.items()}, **tokens}, args.grads)
    return r


if __name__ == "__main__":
    main()
