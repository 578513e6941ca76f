"""Whether vLLM's batch-invariant engine gives a sequence's rows the same bits alone and batched,
and where a ``vllm-exact`` forward parts from it, per decoder layer and sub-block.

Run on the GPU machine with vLLM (``source bench/gpu/vllm-env.sh``)::

    python3 bench/gpu/vllm_exact_batch_probe.py --arch DeepseekV3ForCausalLM --out /tmp/batch-probe.json

The GPU test's checkpoint and engine (tests/gpu/test_vllm_exact_gpu.py: its sizes, prompts and
engine arguments, ``VLLM_BATCH_INVARIANT=1``). Forward hooks on every engine decoder layer, its
attention and its MLP / MoE block keep the rows of one prefill step; the same on the zoo model.
Four prefills are compared, each prompt's rows cut out of each:

* ``engine_alone``: each prompt in a step of its own (``max_tokens=1``);
* ``engine_batched``: the four prompts in one step (the engine's order of requests is found from
  the step's token ids);
* ``zoo_alone`` / ``zoo_packed``: ``packed_forward`` of each prompt alone and of the four in one pack.

The JSON has, per prompt and layer, which pairs are bitwise equal for the attention output, the
MLP / MoE output and the layer output (vLLM: ``hidden + residual``), and the max |difference| of
the engine's two prefills. With ``--arch DeepseekV3ForCausalLM`` it also runs the absorbed MLA
kernels the way the engine's ``FLASH_ATTN_MLA`` backend calls them (FlashAttention-3 scheduler
metadata from ``get_scheduler_metadata``, as ``FlashAttnMLAMetadataBuilder`` computes it) against
the call without metadata, on prompts batched and alone.
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

import torch  # noqa: E402

SUBS = ("attn", "mlp", "layer")


def _engine_hooks(worker):
    """Hooks on the engine's decoder layers (a ``collective_rpc`` function): every call's outputs."""
    model = worker._zoo_model()
    inner = getattr(model, "model", model)
    store = {"ids": [], "rows": {}}
    hooks = [inner.embed_tokens.register_forward_hook(lambda _m, i, _o: store["ids"].append(i[0].detach().clone()))]
    for n, layer in enumerate(inner.layers):
        for sub, module in (("attn", layer.self_attn), ("mlp", layer.mlp), ("layer", layer)):
            def hook(_m, _i, out, key=(n, sub)):
                t = out[0] + out[1] if isinstance(out, tuple) else out
                store["rows"].setdefault(key, []).append(t.detach().clone())
            hooks.append(module.register_forward_hook(hook))
    worker._zoo_batch_probe = (store, hooks)
    return len(inner.layers)


def _engine_take(worker):
    store, hooks = worker._zoo_batch_probe
    for h in hooks:
        h.remove()
    return store


def _zoo_rows(model, seqs: list) -> dict:
    """``{(layer, sub): [T, H]}`` of one ``packed_forward`` of ``seqs``: attention output, MLP / MoE
    output, layer output (the residual stream)."""
    import mcore_zoo

    rows: dict = {}
    hooks = []
    for n, layer in enumerate(model.decoder.layers):
        for sub, module in (("attn", layer.self_attention), ("mlp", layer.mlp), ("layer", layer)):
            def hook(_m, _i, out, key=(n, sub)):
                t = out[0] if isinstance(out, tuple) else out
                rows[key] = t.detach().reshape(-1, t.shape[-1]).clone()
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        mcore_zoo.packed_forward(model, [s.cuda() for s in seqs])
    for h in hooks:
        h.remove()
    return rows


def _logits_hook(worker):
    """Keep every output of the engine's logits processor and final norm (a ``collective_rpc`` function)."""
    model = worker._zoo_model()
    inner = getattr(model, "model", model)
    store = {"logits": [], "norm": []}
    hooks = [model.logits_processor.register_forward_hook(lambda _m, _i, o: store["logits"].append(o.detach().clone())),
             inner.norm.register_forward_hook(
                 lambda _m, _i, o: store["norm"].append((o[0] if isinstance(o, tuple) else o).detach().clone()))]  # fmt: skip
    worker._zoo_batch_probe = (store, hooks)
    return True


def _logprob_positions(llm, model, prompts: list) -> dict:
    """The GPU test's sampling (four prompts, one batch, 48 tokens each, sampled and prompt
    log-probs) against the zoo's log-probs of prompt + continuation in one pack and of the prompts
    alone in one pack: per prompt, the positions whose log-probs differ, and for the prefill step
    whether the engine's final-norm rows and prompt logits equal the zoo's."""
    import mcore_zoo
    from test_vllm_exact_gpu import _sample

    llm.collective_rpc(_logits_hook)
    sampled = _sample(llm, prompts)
    store = llm.collective_rpc(_engine_take)[0]
    full = [torch.cat([p, g]) for p, (g, _, _) in zip(prompts, sampled)]
    norm_rows = {}
    with torch.no_grad():
        out = mcore_zoo.packed_forward(model, [s.cuda() for s in full], return_logits=True)
        hook = model.decoder.final_layernorm.register_forward_hook(lambda _m, _i, o: norm_rows.setdefault("x", o.detach().clone()))
        only = mcore_zoo.packed_forward(model, [p.cuda() for p in prompts], return_logits=True)  # its final norm kept
        hook.remove()
    result: dict = {"engine_logits_calls": [list(t.shape) for t in store["logits"][:6]],
                    "engine_norm_calls": [list(t.shape) for t in store["norm"][:6]]}  # fmt: skip
    zoo_norm = norm_rows["x"].reshape(-1, norm_rows["x"].shape[-1])
    first_norm = store["norm"][0] if store["norm"] else None
    if first_norm is not None and first_norm.shape == zoo_norm.shape:
        result["prefill_final_norm_rows_bitwise"] = int((first_norm == zoo_norm).all(-1).sum())
        result["prefill_final_norm_rows"] = int(zoo_norm.shape[0])
    per = []
    for i, (p, (g, gen_lp, prompt_lp)) in enumerate(zip(prompts, sampled)):
        lp = out.logprobs[i].float().cpu()
        lp_only = only.logprobs[i].float().cpu()
        d_prompt = (lp[: len(p) - 1] - prompt_lp).abs()
        d_only = (lp_only - prompt_lp).abs()
        d_gen = (lp[len(p) - 1 :] - gen_lp).abs()
        per.append({"prompt": len(p), "prompt_mismatch_full_pack": torch.nonzero(d_prompt).flatten().tolist(),
                    "prompt_mismatch_prompt_pack": torch.nonzero(d_only).flatten().tolist(),
                    "prompt_max_abs": float(d_prompt.max()) if d_prompt.numel() else 0.0,
                    "generated_mismatch": torch.nonzero(d_gen).flatten().tolist(),
                    "generated_max_abs": float(d_gen.max()),
                    "full_vs_prompt_pack_logits_bitwise": bool(torch.equal(out.logits[i][: len(p)], only.logits[i]))})  # fmt: skip
    result["per_prompt"] = per
    return result


def _slices(lengths: list) -> list:
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out


def mla_schedule_check(seed: int = 1) -> dict:
    """The absorbed MLA kernels (``VLLMKernels.mla_absorbed_attention``'s FlashAttention-3 call) with
    and without the scheduler metadata vLLM's ``FLASH_ATTN_MLA`` backend computes, at DeepSeek-V3's
    head sizes (16 heads) on a batch of prompts (37, 64, 100, 5 tokens) and each alone: which rows
    have the same bits."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    from mcore_zoo.kernels import vllm_ops

    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, rope, rank = 16, 64, 512
    lengths = [37, 64, 100, 5]

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    t = sum(lengths)
    q_pe, ql, kv_c, k_pe = rand(t, heads, rope), rand(t, heads, rank), rand(t, rank), rand(t, rope)
    scale = 192**-0.5

    def call(idx: list, metadata: bool) -> torch.Tensor:
        lens = torch.tensor([lengths[i] for i in idx], device="cuda", dtype=torch.int32)
        rows = torch.cat([torch.arange(sum(lengths[:i]), sum(lengths[: i + 1])) for i in idx]).cuda()
        cache, table, seqused, cu = vllm_ops._paged(torch.cat([kv_c[rows], k_pe[rows]], -1)[:, None, :], lengths=lens)
        cache = cache[:, :, 0, :]
        sched = None
        if metadata:
            sched = get_scheduler_metadata(batch_size=len(idx), max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()),
                                           num_heads_q=heads, num_heads_kv=1, headdim=rope, cache_seqlens=seqused,
                                           qkv_dtype=torch.bfloat16, headdim_v=rank, page_size=vllm_ops.PAGE_SIZE,
                                           cu_seqlens_q=cu, causal=True, num_splits=1)  # fmt: skip
        return flash_attn_varlen_func(
            q=q_pe[rows], k=cache[..., rank:].unsqueeze(-2), v=cache[..., :rank].unsqueeze(-2), q_v=ql[rows],
            max_seqlen_q=int(lens.max()), cu_seqlens_q=cu, max_seqlen_k=int(lens.max()), seqused_k=seqused,
            block_table=table, softmax_scale=scale, causal=True, fa_version=3, scheduler_metadata=sched, num_splits=1,
        )  # fmt: skip

    out = {}
    for metadata in (False, True):
        batched = call(list(range(len(lengths))), metadata)
        alone = torch.cat([call([i], metadata) for i in range(len(lengths))])
        out[f"metadata={metadata}"] = {"rows": t, "batched_vs_alone_rows_bitwise": int((batched == alone).reshape(t, -1).all(-1).sum()),
                                       "batched_vs_alone_max_abs": float((batched.float() - alone.float()).abs().max())}  # fmt: skip
        out[f"metadata={metadata}"]["_batched"] = batched
    a, b = out["metadata=False"].pop("_batched"), out["metadata=True"].pop("_batched")
    out["metadata_vs_none_rows_bitwise"] = int((a == b).reshape(t, -1).all(-1).sum())
    out["metadata_vs_none_max_abs"] = float((a.float() - b.float()).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="DeepseekV3ForCausalLM")
    ap.add_argument("--out")
    args = ap.parse_args()

    import vllm
    from test_vllm_exact_gpu import ARCHS, ENGINE_ARGS, PROMPTS, SIZES
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint
    from mcore_zoo.rollout import VLLM_WORKER_EXTENSION
    from mcore_zoo.testing.common import case_config, random_sequences

    report: dict = {"arch": args.arch}
    if args.arch == "DeepseekV3ForCausalLM":
        report["mla_kernel_schedule"] = mla_schedule_check()
        print(json.dumps(report["mla_kernel_schedule"]), flush=True)
    work = tempfile.mkdtemp()
    ckpt, export = os.path.join(work, "ckpt"), os.path.join(work, "export")
    write_reference_checkpoint(mcore_zoo.lookup(args.arch), case_config(args.arch, {**SIZES, **dict(ARCHS)[args.arch]}), ckpt,
                               seed=0, dtype=torch.bfloat16)  # fmt: skip
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="vllm-exact", params_dtype=torch.bfloat16, load=ckpt)
    mcore_zoo.save_hf_checkpoint(model, export, dtype=torch.bfloat16)
    engine_args = {"attention_backend": "FLASH_ATTN", **ENGINE_ARGS.get(args.arch, {})}
    llm = vllm.LLM(model=export, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                   max_model_len=512, gpu_memory_utilization=0.3, enable_prefix_caching=False, block_size=16,
                   worker_extension_cls=VLLM_WORKER_EXTENSION, **engine_args)  # fmt: skip
    vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
    prompts = random_sequences(PROMPTS, vocab, seed=7)
    one = SamplingParams(max_tokens=1, detokenize=False)

    def engine_step(batch: list) -> tuple:
        llm.collective_rpc(_engine_hooks)
        llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in batch], [one] * len(batch), use_tqdm=False)
        store = llm.collective_rpc(_engine_take)[0]
        ids = store["ids"][0].cpu()  # the prefill step's tokens (the first forward)
        return ids, {k: v[0] for k, v in store["rows"].items()}

    engine_alone = []
    for p in prompts:
        ids, rows = engine_step([p])
        assert torch.equal(ids[: len(p)], p), "the engine's prefill step is not the prompt"
        engine_alone.append({k: v[: len(p)] for k, v in rows.items()})
    ids, rows = engine_step(prompts)
    engine_batched = []
    for p in prompts:  # the engine may order the requests its own way: find each prompt's rows
        starts = [i for i in range(len(ids) - len(p) + 1) if torch.equal(ids[i : i + len(p)], p)]
        assert starts, "a prompt's tokens are not in the batched step"
        engine_batched.append({k: v[starts[0] : starts[0] + len(p)] for k, v in rows.items()})
    report["engine_batched_order"] = [int(next(i for i in range(len(ids)) if torch.equal(ids[i : i + len(p)], p))) for p in prompts]
    zoo_alone = [_zoo_rows(model, [p]) for p in prompts]
    packed = _zoo_rows(model, prompts)
    zoo_packed = [{k: v[s] for k, v in packed.items()} for s in _slices([len(p) for p in prompts])]
    layers = len(model.decoder.layers)
    pairs = {"engine_alone=engine_batched": (engine_alone, engine_batched), "zoo_alone=zoo_packed": (zoo_alone, zoo_packed),
             "zoo_alone=engine_alone": (zoo_alone, engine_alone), "zoo_packed=engine_batched": (zoo_packed, engine_batched)}  # fmt: skip
    per_prompt = []
    for i, p in enumerate(prompts):
        entry: dict = {"length": len(p)}
        for name, (a, b) in pairs.items():
            entry[name] = {sub: [bool(torch.equal(a[i][(n, sub)], b[i][(n, sub)])) for n in range(layers)] for sub in SUBS}
        entry["engine_alone_vs_batched_max_abs"] = {
            sub: [float((engine_alone[i][(n, sub)].float() - engine_batched[i][(n, sub)].float()).abs().max()) for n in range(layers)]
            for sub in SUBS}  # fmt: skip
        per_prompt.append(entry)
    report["per_prompt"] = per_prompt
    report["logprobs"] = _logprob_positions(llm, model, prompts)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
