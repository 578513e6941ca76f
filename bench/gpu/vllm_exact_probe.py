"""Where a ``vllm-exact`` forward and vLLM's batch-invariant forward part: one prefill, layer 0 op by op.

Run on the GPU machine with vLLM (``source bench/gpu/vllm-env.sh``) and ``VLLM_BATCH_INVARIANT=1``::

    VLLM_BATCH_INVARIANT=1 python3 bench/gpu/vllm_exact_probe.py --arch LlamaForCausalLM --out /tmp/probe.json

Builds a random checkpoint at the GPU test's sizes, the zoo model (``vllm-exact``, ``local``), an
in-process engine from its export; hooks layer 0's modules on both sides (norms, QKV GEMM - the
zoo's per-group layout re-ordered to vLLM's ``[q | k | v]`` - RoPE'd q / k, attention, output
projection, MLP) and the decoder layers' outputs, runs one sequence, and writes which match
bitwise, the max |difference| of those that do not, and how vLLM dispatched (custom-op forward,
attention backend, FlashAttention version; for an MoE model the ``FusedMoE`` layer's router,
experts kernel and unquantized backend, and its fused-MoE tile config).

For an MoE layer 0 (``--arch Qwen3MoeForCausalLM``) the MoE block is compared op by op: its input,
the weights (router, stacked ``w13`` / ``w2``), then router logits, top-k weights and experts,
the two fused-MoE GEMMs, the activation and the sum over k - the zoo's on its own input and
weights against vLLM's kernels on the engine's captured input and weights - the chain on the
engine's input against the engine's block output (which checks that the op list is what the
engine ran), and the zoo's block output against the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))


def _keep(store: dict, name: str):
    """A forward hook storing copies of the module's first outputs under ``name`` (first call only)."""

    def hook(_m, _inputs, out):
        outs = out if isinstance(out, tuple) else (out,)
        store.setdefault(name, [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in outs])

    return hook


def _keep_inputs(store: dict, name: str):
    """A forward pre-hook storing copies of the first three inputs (q, k, v); returns ``None`` so
    the inputs are left as they are."""

    def hook(_m, inputs):
        store.setdefault(name, [t.detach().clone() for t in inputs[:3]])

    return hook


def moe_steps(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> dict:  # fmt: skip
    """A MoE block's intermediates on vLLM's kernels (``mcore_zoo.kernels.vllm_ops.VLLMKernels``,
    the ops ``VLLMMoELayer`` calls, in ``TritonExperts``' order) for the block input ``x [n, H]``:
    router logits, top-k weights and experts, the first GEMM ``h``, the activation, the weighted
    second GEMM ``y`` and the sum over k."""
    from mcore_zoo.kernels import vllm_ops

    table = vllm_ops.kernels()
    n = x.shape[0]
    logits = table.linear(x, gate_weight)
    weights, ids = table.moe_topk_softmax(logits, top_k, renormalize)
    config = table.moe_config(tuple(w13.shape), tuple(w2.shape), top_k, n)
    h = table.moe_gemm(x, w13, ids, None, False, config)
    act = table.silu_and_mul(h.reshape(n * top_k, -1))
    y = table.moe_gemm(act, w2, ids, weights, True, config)
    return {"router_logits": logits, "topk_weights": weights, "topk_ids": ids, "w13_gemm": h, "act": act,
            "w2_gemm_weighted": y, "moe_sum": table.moe_sum(y)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="LlamaForCausalLM")
    ap.add_argument("--length", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()

    import vllm
    from test_vllm_exact_gpu import ARCHS, SIZES, moe_dispatch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint
    from mcore_zoo.rollout import VLLM_WORKER_EXTENSION
    from mcore_zoo.testing.common import case_config, random_sequences

    tmp = tempfile.mkdtemp()
    ckpt = os.path.join(tmp, "ckpt")
    write_reference_checkpoint(mcore_zoo.lookup(args.arch), case_config(args.arch, {**SIZES, **dict(ARCHS)[args.arch]}),
                               ckpt, seed=0, dtype=torch.bfloat16)  # fmt: skip
    model = mcore_zoo.build_model(ckpt, backend="local", numerics="vllm-exact", params_dtype=torch.bfloat16, load=ckpt)
    export = os.path.join(tmp, "export")
    mcore_zoo.save_hf_checkpoint(model, export, dtype=torch.bfloat16)
    cfg = mcore_zoo.handle_of(model).transformer_config
    seq = random_sequences([args.length], SIZES["vocab_size"], seed=3)[0]
    llm = vllm.LLM(model=export, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0,
                   max_model_len=512, gpu_memory_utilization=0.3, enable_prefix_caching=False, block_size=16,
                   attention_backend="FLASH_ATTN", worker_extension_cls=VLLM_WORKER_EXTENSION)  # fmt: skip

    def install(worker):
        inner = getattr(worker._zoo_model(), "model", worker._zoo_model())
        layer = inner.layers[0]
        store: dict = {}
        hooks = []

        moe = getattr(layer.mlp, "experts", None)
        mlp_modules = ((("moe_gate", layer.mlp.gate), ("moe_out", layer.mlp)) if moe is not None else
                       (("gate_up", layer.mlp.gate_up_proj), ("act", layer.mlp.act_fn), ("down", layer.mlp.down_proj)))  # fmt: skip
        for name, mod in (("input_norm", layer.input_layernorm), ("qkv", layer.self_attn.qkv_proj),
                          ("o_proj", layer.self_attn.o_proj), ("post_norm", layer.post_attention_layernorm), *mlp_modules):  # fmt: skip
            hooks.append(mod.register_forward_hook(_keep(store, name)))
        if moe is not None:  # the block's input, and the weights the fused kernels read
            hooks.append(layer.mlp.register_forward_pre_hook(_keep_inputs(store, "moe_in")))
            store["moe_weights"] = [layer.mlp.gate.weight.detach().clone(), moe.w13_weight.detach().clone(),
                                    moe.w2_weight.detach().clone()]  # fmt: skip
        hooks.append(layer.self_attn.attn.register_forward_pre_hook(_keep_inputs(store, "attn_in")))
        hooks.append(layer.self_attn.attn.register_forward_hook(_keep(store, "attn")))
        for i, lyr in enumerate(inner.layers):
            hooks.append(lyr.register_forward_hook(_keep(store, f"layer{i}")))
        worker._probe = (store, hooks)
        attn = layer.self_attn.attn
        impl = getattr(attn, "impl", None)
        return {
            "input_norm_forward": getattr(getattr(layer.input_layernorm, "_forward_method", None), "__name__", "?"),
            "act_forward": getattr(getattr(getattr(layer.mlp, "act_fn", None), "_forward_method", None), "__name__", "?"),
            "moe": moe_dispatch(worker),
            "rope_forward": getattr(getattr(layer.self_attn.rotary_emb, "_forward_method", None), "__name__", "?"),
            "attention_impl": type(impl).__name__ if impl is not None else type(attn).__name__,
            "fa_version": getattr(impl, "vllm_flash_attn_version", None),
            "block_size": worker.cache_config.block_size if hasattr(worker, "cache_config") else None,
        }

    def collect(worker):
        store, hooks = worker._probe
        for h in hooks:
            h.remove()
        return store

    dispatch = llm.collective_rpc(install)[0]
    llm.generate([TokensPrompt(prompt_token_ids=seq.tolist())], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    engine = llm.collective_rpc(collect)[0]

    mine: dict = {}
    zl = model.decoder.layers[0]
    hooks = []

    zoo_moe = hasattr(zl.mlp, "router")
    mlp_modules = ((("moe_router", zl.mlp.router), ("moe_out", zl.mlp)) if zoo_moe else
                   (("gate_up", zl.mlp.linear_fc1), ("down", zl.mlp.linear_fc2)))  # fmt: skip
    for name, mod in (("input_norm", zl.input_layernorm), ("qkv", zl.self_attention.linear_qkv),
                      ("o_proj", zl.self_attention.linear_proj), ("post_norm", zl.pre_mlp_layernorm), *mlp_modules):  # fmt: skip
        hooks.append(mod.register_forward_hook(_keep(mine, name)))
    if zoo_moe:
        hooks.append(zl.mlp.register_forward_pre_hook(_keep_inputs(mine, "moe_in")))
    hooks.append(zl.self_attention.core_attention.register_forward_pre_hook(_keep_inputs(mine, "attn_in")))
    hooks.append(zl.self_attention.core_attention.register_forward_hook(_keep(mine, "attn")))
    for i, lyr in enumerate(model.decoder.layers):
        hooks.append(lyr.register_forward_hook(_keep(mine, f"layer{i}")))
    with torch.no_grad():
        mcore_zoo.packed_forward(model, [seq.cuda()])
    for h in hooks:
        h.remove()

    T = seq.numel()
    heads, groups, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    rep = heads // groups

    def flat(t):
        return t.reshape(-1, t.shape[-1])[:T] if t.dim() > 1 else t

    def zoo_qkv_to_vllm(t):  # [T, g * (rep + 2) * hd] per group -> [q | k | v]
        t = t.reshape(T, groups, rep + 2, hd)
        return torch.cat([t[:, :, :rep].reshape(T, -1), t[:, :, rep].reshape(T, -1), t[:, :, rep + 1].reshape(T, -1)], -1)

    result = {"arch": args.arch, "tokens": T, "dispatch": dispatch, "compare": {}}

    def compare(name, a, b):
        a, b = flat(a), flat(b)
        if a.shape != b.shape:
            result["compare"][name] = f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
            return
        result["compare"][name] = "bitwise" if torch.equal(a, b) else float((a.float() - b.float()).abs().max())

    compare("input_norm", mine["input_norm"][0], engine["input_norm"][0])
    compare("qkv", zoo_qkv_to_vllm(flat(mine["qkv"][0])), engine["qkv"][0])
    q, k, v = (flat(t.reshape(T, -1)) for t in mine["attn_in"])
    eq, ek, ev = engine["attn_in"]
    compare("q_roped", q, eq.reshape(T, -1))
    compare("k_roped", k, ek.reshape(T, -1))
    compare("v", v, ev.reshape(T, -1))
    compare("attn", mine["attn"][0], engine["attn"][0].reshape(T, -1))
    compare("o_proj", mine["o_proj"][0], engine["o_proj"][0])
    compare("post_norm", mine["post_norm"][0], engine["post_norm"][0])
    if not zoo_moe:
        compare("gate_up", mine["gate_up"][0], engine["gate_up"][0])
        compare("down", mine["down"][0], engine["down"][0])
    else:  # the MoE block op by op: the zoo's ops on its input and weights, vLLM's on the engine's
        moe_cfg = mcore_zoo.handle_of(model).arch_config.moe
        x_zoo, x_engine = flat(mine["moe_in"][0]), flat(engine["moe_in"][0])
        w13_zoo, w2_zoo = zl.mlp.stacked_expert_weights()
        gate_engine, w13_engine, w2_engine = engine["moe_weights"]
        compare("moe_in", x_zoo, x_engine)
        compare("moe_gate_weight", zl.mlp.router.weight.detach().to(gate_engine.dtype).reshape(-1), gate_engine.reshape(-1))
        compare("moe_w13", w13_zoo.detach().reshape(-1), w13_engine.reshape(-1))
        compare("moe_w2", w2_zoo.detach().reshape(-1), w2_engine.reshape(-1))
        with torch.no_grad():
            ours = moe_steps(x_zoo, zl.mlp.router.weight.to(x_zoo.dtype), w13_zoo, w2_zoo, moe_cfg.top_k, moe_cfg.normalize_topk)
            theirs = moe_steps(x_engine, gate_engine, w13_engine, w2_engine, moe_cfg.top_k, moe_cfg.normalize_topk)
        for name in ours:  # whole tensors (flat() keeps T rows; these have n * k)
            compare(f"moe_{name}", ours[name].reshape(-1), theirs[name].reshape(-1))
        compare("moe_router_logits_vs_engine_gate", ours["router_logits"], flat(engine["moe_gate"][0]))
        weights, _, ids = mine["moe_router"]
        compare("moe_router_weights_vs_ops", weights.reshape(-1), ours["topk_weights"].reshape(-1))
        compare("moe_router_ids_vs_ops", ids.reshape(-1), ours["topk_ids"].reshape(-1))
        # the chain recomputed on the engine's input is the engine's block (validates the op list),
        # and the zoo's block output is the engine's
        compare("moe_ops_on_engine_input_vs_engine_block", theirs["moe_sum"], flat(engine["moe_out"][0]))
        compare("moe_out", mine["moe_out"][0], engine["moe_out"][0])
    for i in range(len(model.decoder.layers)):
        e = engine.get(f"layer{i}")
        if e:
            compare(f"layer{i}", mine[f"layer{i}"][0], e[0] + e[1])
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
