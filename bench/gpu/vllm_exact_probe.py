"""Where a ``vllm-exact`` forward and vLLM's batch-invariant forward part: one prefill, layer 0 op by op.

Run on the GPU machine with vLLM (``source bench/gpu/vllm-env.sh``) and ``VLLM_BATCH_INVARIANT=1``::

    VLLM_BATCH_INVARIANT=1 python3 bench/gpu/vllm_exact_probe.py --arch LlamaForCausalLM --out /tmp/probe.json

Builds a random checkpoint at the GPU test's sizes, the zoo model (``vllm-exact``, ``local``), an
in-process engine from its export; hooks layer 0's modules on both sides (norms, QKV GEMM - the
zoo's per-group layout re-ordered to vLLM's ``[q | k | v]`` - RoPE'd q / k, attention, output
projection, MLP) and the decoder layers' outputs, runs one sequence, and writes which match
bitwise, the max |difference| of those that do not, and how vLLM dispatched (custom-op forward,
attention backend, FlashAttention version).
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="LlamaForCausalLM")
    ap.add_argument("--length", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()

    import vllm
    from test_vllm_exact_gpu import ARCHS, SIZES
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

        for name, mod in (("input_norm", layer.input_layernorm), ("qkv", layer.self_attn.qkv_proj),
                          ("o_proj", layer.self_attn.o_proj), ("post_norm", layer.post_attention_layernorm),
                          ("gate_up", layer.mlp.gate_up_proj), ("act", layer.mlp.act_fn), ("down", layer.mlp.down_proj)):  # fmt: skip
            hooks.append(mod.register_forward_hook(_keep(store, name)))
        hooks.append(layer.self_attn.attn.register_forward_pre_hook(_keep_inputs(store, "attn_in")))
        hooks.append(layer.self_attn.attn.register_forward_hook(_keep(store, "attn")))
        for i, lyr in enumerate(inner.layers):
            hooks.append(lyr.register_forward_hook(_keep(store, f"layer{i}")))
        worker._probe = (store, hooks)
        attn = layer.self_attn.attn
        impl = getattr(attn, "impl", None)
        return {
            "input_norm_forward": getattr(getattr(layer.input_layernorm, "_forward_method", None), "__name__", "?"),
            "act_forward": getattr(getattr(layer.mlp.act_fn, "_forward_method", None), "__name__", "?"),
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

    for name, mod in (("input_norm", zl.input_layernorm), ("qkv", zl.self_attention.linear_qkv),
                      ("o_proj", zl.self_attention.linear_proj), ("post_norm", zl.pre_mlp_layernorm),
                      ("gate_up", zl.mlp.linear_fc1), ("down", zl.mlp.linear_fc2)):  # fmt: skip
        hooks.append(mod.register_forward_hook(_keep(mine, name)))
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
    compare("gate_up", mine["gate_up"][0], engine["gate_up"][0])
    compare("down", mine["down"][0], engine["down"][0])
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
