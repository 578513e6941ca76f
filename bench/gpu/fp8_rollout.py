"""FP8 rollout from bf16 training on the GPU, per family: a bf16 trainer model's export served by
vLLM 0.26 in bf16 and in FP8 (128 x 128 blocks), the FP8 engine loaded from the saved checkpoint
and refit from the trainer, and what the FP8 weights cost in log-probs.

    python3 bench/gpu/fp8_rollout.py --out OUT [--family llama --family qwen3-moe --family deepseek-v3]

Families (published widths, layers / experts cut to fit one GPU next to the trainer):

* ``llama``: Llama-3.1-8B's widths, 2 layers;
* ``qwen3-moe``: Qwen3-30B-A3B's widths (128 experts, 768 expert rows), 2 layers;
* ``deepseek-v3``: DeepSeek-V3's widths (MLA, q_lora_rank 1536, kv_lora_rank 512), 2 layers (one
  dense, one MoE), 8 routed experts (one group), no MTP layer.

Per family, each stage in a fresh process (one vLLM engine per process), on one GPU:

1. ``prepare``: an HF checkpoint with random sharp-attention weights (the parity suite's
   ``write_reference_checkpoint``, bf16), the zoo model (``local`` backend, bf16) loaded from it,
   the trainer's log-probs of fixed random prompts (``packed_forward``), the bf16 export and the
   FP8 block export (``save_hf_checkpoint(fp8="block")``).
2. ``fp8``: vLLM on the FP8 export (a fresh load): its parameters and prompt log-probs; then the
   trainer model is built in the same process, the engine's parameters overwritten with noise, and
   ``mcore_zoo.refit(model, VLLMFp8Adapter(llm, mode=...))`` run in mode ``reload`` (vLLM's
   layerwise reload) and ``direct`` (in-place copies; refused with the kernel named where an FP8
   kernel changes its tensors after loading - recorded, not a failure): after each, every engine
   parameter and every prompt log-prob compared bit for bit with the fresh load.
3. ``bf16``: vLLM on the bf16 export: its prompt log-probs (for scale; after the FP8 stage, which
   matters more where the time is short).

``token_mult_prob_error`` (mean over prompt tokens of ``exp(|logp_engine - logp_trainer|)``) of the
FP8 engine and, for scale, of the bf16 engine against the bf16 trainer; max |dlogp| too. Results:
``OUT/fp8-rollout.json`` and ``OUT/fp8-rollout.md`` (and each stage's JSON under ``OUT/<family>/``).
Exit status 1 when a check fails: refit not bitwise equal to the fresh load (parameters or
log-probs), a direct refit that neither refused nor matched, a noise fill that did not change the
engine, an FP8 error that is not finite or exceeds ``--max-fp8-error`` (default 1.5).

Needs vLLM (bench/gpu/vllm-setup.sh; ``source bench/gpu/vllm-env.sh``); run_all.sh phase
``fp8-rollout``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: GPU-to-GPU refit
# vLLM's start-up DeepGEMM warmup JIT-compiles its FP8 GEMMs for every token count up to the batch
# budget (minutes for DeepSeek-V3's shapes); the prompts here need a few of them, compiled on first use
os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")

FAMILIES = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu", "num_hidden_layers": 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "hidden_act": "silu", "router_aux_loss_coef": 0.001, "output_router_logits": False,
        "num_hidden_layers": 2,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "num_hidden_layers": 2, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "num_nextn_predict_layers": 0,
    },
}  # fmt: skip
LENGTHS = [37, 64, 100, 128]  # prompt lengths (random tokens, seed 3)
#: the prompts (329 tokens) fit one step of 512 tokens: a small batch budget keeps the engine's
#: start-up profile run (and the kernels it compiles) to that size
ENGINE = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0, max_model_len=256,
              max_num_batched_tokens=512, max_num_seqs=8, enable_prefix_caching=False)  # fmt: skip


def _seqs(vocab: int):
    from mcore_zoo.testing.common import random_sequences

    return random_sequences(LENGTHS, vocab, seed=3)


def _logprobs(llm, seqs):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs], params, use_tqdm=False)
    return [torch.tensor([e[int(s[j + 1])].logprob for j, e in enumerate(o.prompt_logprobs[1:])]) for s, o in zip(seqs, outs)]


def _params(llm) -> dict:
    def read(worker):
        return {n: p.detach().clone() for n, p in worker._zoo_model().named_parameters()}

    return llm.collective_rpc(read)[0]


def _scramble(llm, seed: int) -> None:
    def fill(worker, seed=seed):
        import torch

        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for p in worker._zoo_model().parameters():
                p.data.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype))

    llm.collective_rpc(fill)


def _same(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
        return False
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def _differing(got: dict, want: dict) -> list:
    return sorted(set(got) ^ set(want)) + [n for n in want if n in got and not _same(got[n], want[n])]


def _error(engine, trainer) -> dict:
    import torch

    d = torch.cat([(a.double() - b.double()).abs() for a, b in zip(engine, trainer)])
    return {"token_mult_prob_error": float(d.exp().mean()), "max_abs_dlogp": float(d.max()),
            "mean_abs_dlogp": float(d.mean()), "tokens": int(d.numel())}  # fmt: skip


def _model(ckpt: str):
    import torch

    import mcore_zoo

    return mcore_zoo.build_model(ckpt, backend="local", params_dtype=torch.bfloat16, load=ckpt)


def stage_prepare(family: str, work: str) -> dict:
    import torch

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint

    config = FAMILIES[family]
    t0 = time.perf_counter()
    ckpt = os.path.join(work, "trainer")
    write_reference_checkpoint(mcore_zoo.lookup(config["architectures"][0]), dict(config), ckpt, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    model = _model(ckpt)
    seqs = _seqs(config["vocab_size"])
    out = mcore_zoo.packed_forward(model, [s.cuda() for s in seqs], seq_format="bshd")
    torch.save([lp.float().cpu() for lp in out.logprobs], os.path.join(work, "trainer-logprobs.pt"))
    mcore_zoo.save_hf_checkpoint(model, os.path.join(work, "bf16"), dtype=torch.bfloat16, overwrite=True)
    t2 = time.perf_counter()
    mcore_zoo.save_hf_checkpoint(model, os.path.join(work, "fp8"), dtype=torch.bfloat16, fp8="block", overwrite=True)
    t3 = time.perf_counter()
    with open(os.path.join(work, "fp8", "config.json")) as f:
        quant = json.load(f)["quantization_config"]
    params = sum(p.numel() for chunk in mcore_zoo.handle_of(model).chunks for p in chunk.parameters())
    return {"family": family, "params": params, "checkpoint_seconds": t1 - t0, "fp8_export_seconds": t3 - t2,
            "quantization_config": quant}  # fmt: skip


def stage_bf16(family: str, work: str) -> dict:
    import torch
    import vllm

    llm = vllm.LLM(model=os.path.join(work, "bf16"), gpu_memory_utilization=0.5, **ENGINE)
    lp = _logprobs(llm, _seqs(FAMILIES[family]["vocab_size"]))
    trainer = torch.load(os.path.join(work, "trainer-logprobs.pt"))
    return {"bf16_engine": _error(lp, trainer)}


def stage_fp8(family: str, work: str) -> dict:
    import torch
    import vllm

    import mcore_zoo
    from mcore_zoo.errors import ZooError
    from mcore_zoo.rollout import FP8_WORKER_EXTENSION, VLLMFp8Adapter

    result: dict = {}
    seqs = _seqs(FAMILIES[family]["vocab_size"])
    t0 = time.perf_counter()
    llm = vllm.LLM(model=os.path.join(work, "fp8"), gpu_memory_utilization=0.45, worker_extension_cls=FP8_WORKER_EXTENSION,
                   **ENGINE)  # fmt: skip
    result["engine_start_seconds"] = time.perf_counter() - t0
    fresh = _params(llm)
    fresh_lp = _logprobs(llm, seqs)
    trainer = torch.load(os.path.join(work, "trainer-logprobs.pt"))
    result["fp8_engine"] = _error(fresh_lp, trainer)
    result["fp8_parameters"] = sum(1 for p in fresh.values() if p.dtype == torch.float8_e4m3fn)
    result["scale_parameters"] = sorted({n.rsplit(".", 2)[-1] for n in fresh if "scale" in n})

    def kernels(worker):
        from mcore_zoo.rollout.vllm_fp8 import fp8_relayout

        found: dict = {}  # kernel -> FP8 layers running it
        for _, module in worker._zoo_model().named_modules():
            method = getattr(module, "quant_method", None)
            kind = type(method).__name__
            key = None
            if kind == "Fp8LinearMethod":
                key = f"linear: {type(getattr(method, 'fp8_linear', None)).__name__}"
            elif kind == "Fp8MoEMethod":
                key = f"moe: {getattr(getattr(method, 'fp8_backend', None), 'name', '?')}"
            if key is not None:
                key += " (changes its tensors after loading)" if fp8_relayout(module) else ""
                found[key] = found.get(key, 0) + 1
        return found

    result["fp8_kernels"] = llm.collective_rpc(kernels)[0]
    model = _model(os.path.join(work, "trainer"))
    for mode in ("reload", "direct"):
        entry: dict = {}
        _scramble(llm, 7)
        entry["noise_changed"] = len(_differing(_params(llm), fresh))
        try:
            adapter = VLLMFp8Adapter(llm, mode=mode)
            for i in range(2):  # the second refit reuses the plan, its FP8 form and the engine's binding
                stats = mcore_zoo.refit(model, adapter, bucket_size="1GB")
                entry[f"refit_{i}_seconds"] = stats.seconds
            entry.update(refused=None, buckets=stats.buckets, bf16_bytes=stats.nbytes, source=stats.source)
            entry["params_differ"] = _differing(_params(llm), fresh)[:16]
            lp = _logprobs(llm, seqs)
            entry["logprobs_bitwise"] = all(torch.equal(a, b) for a, b in zip(lp, fresh_lp))
        except ZooError as exc:
            entry["refused"] = str(exc)
        result[mode] = entry
    return result


STAGES = {"prepare": stage_prepare, "bf16": stage_bf16, "fp8": stage_fp8}


def _run_stage(stage: str, family: str, work: str, timeout: int) -> dict:
    """One stage in a fresh process; its output goes to ``<work>/<stage>.log`` as it runs (a stage
    cut short by a timeout leaves what it printed)."""
    log = os.path.join(work, f"{stage}.log")
    with open(log, "w") as f:
        try:
            proc = subprocess.run([sys.executable, __file__, "--stage", stage, "--family", family, "--work", work],
                                  stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"stage {stage} timed out after {timeout} s (its output: {log})"}
        f.seek(0, os.SEEK_END)  # after what the stage wrote to the file itself
        f.write("\n--- stdout ---\n" + proc.stdout)
    if proc.returncode != 0:
        with open(log) as f:
            return {"error": f"stage {stage} exit {proc.returncode}: " + f.read()[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checks(r: dict, max_fp8_error: float) -> list:
    """What failed for one family's result (empty: every check passed)."""
    import math

    bad = [v for k, v in r.items() if k == "error"]
    if bad:
        return bad
    fp8 = r.get("fp8_engine", {}).get("token_mult_prob_error", float("nan"))
    if not (math.isfinite(fp8) and 1.0 <= fp8 <= max_fp8_error):
        bad.append(f"FP8 engine token_mult_prob_error {fp8} outside [1, {max_fp8_error}]")
    if not r.get("fp8_parameters"):
        bad.append("the FP8 engine holds no float8 parameter")
    for mode in ("reload", "direct"):
        e = r.get(mode, {})
        if mode == "reload" and e.get("refused"):
            bad.append(f"reload refit refused: {e['refused']}")
        if e.get("refused"):
            continue
        if not e.get("noise_changed"):
            bad.append(f"{mode}: the noise fill changed no parameter")
        if e.get("params_differ"):
            bad.append(f"{mode}: parameters differ from the fresh load: {e['params_differ'][:4]}")
        if not e.get("logprobs_bitwise"):
            bad.append(f"{mode}: log-probs differ from the fresh load")
    return bad


def markdown(results: dict) -> str:
    rows = ["| family | bf16 engine vs trainer | FP8 engine vs trainer | max \\|dlogp\\| (FP8) | refit reload | refit direct |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for family, r in results.items():
        if "error" in r:
            rows.append(f"| {family} | {r['error'][:200]} | | | | |")
            continue

        def mode(m, r=r):
            e = r.get(m, {})
            if e.get("refused"):
                return "refused: " + e["refused"][:160]
            ok = not e.get("params_differ") and e.get("logprobs_bitwise")
            return f"{'bitwise' if ok else 'DIFFERS'}, {e.get('refit_1_seconds', float('nan')) * 1e3:.1f} ms"

        bf16 = r.get("bf16_engine", {}).get("token_mult_prob_error", float("nan"))
        rows.append(f"| {family} | {bf16:.5f} |"
                    f" {r['fp8_engine']['token_mult_prob_error']:.5f} | {r['fp8_engine']['max_abs_dlogp']:.3f} |"
                    f" {mode('reload')} | {mode('direct')} |")  # fmt: skip
    kernels = {f: r.get("fp8_kernels") for f, r in results.items() if "error" not in r}
    return "\n".join(rows) + "\n\nFP8 kernels per family: " + json.dumps(kernels) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results folder (driver)")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    ap.add_argument("--stage", choices=sorted(STAGES), help="run one stage in this process (internal)")
    ap.add_argument("--work", help="the family's working folder (with --stage)")
    ap.add_argument("--max-fp8-error", type=float, default=1.5)
    ap.add_argument("--stage-timeout", type=int, default=900)
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(STAGES[args.stage](args.family[0], args.work)))
        return 0
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    results, failures = {}, {}
    for family in args.family or list(FAMILIES):
        work = os.path.join(args.out, family)
        os.makedirs(work, exist_ok=True)
        r: dict = {}
        for stage in ("prepare", "fp8", "bf16"):  # the FP8 engine first: the bf16 one is for scale
            part = _run_stage(stage, family, work, args.stage_timeout)
            r.update(part)
            with open(os.path.join(work, f"{stage}.json"), "w") as f:
                json.dump(part, f, indent=1)
            if "error" in part:
                break
        results[family] = r
        failures[family] = checks(r, args.max_fp8_error)
        print(f"{family}: " + ("ok" if not failures[family] else "; ".join(failures[family])), flush=True)
        for folder in ("trainer", "bf16", "fp8"):  # the checkpoints are large: keep the results, not the weights
            shutil.rmtree(os.path.join(work, folder), ignore_errors=True)
    with open(os.path.join(args.out, "fp8-rollout.json"), "w") as f:
        json.dump({"results": results, "failures": failures}, f, indent=1)
    with open(os.path.join(args.out, "fp8-rollout.md"), "w") as f:
        f.write(markdown(results))
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
