"""Refit into a real in-process ``vllm.LLM`` on the GPU, bit for bit.

For each architecture: the zoo model (bf16, ``local`` backend) is exported with
``save_hf_checkpoint``; vLLM loads that export (its own loaders) - the reference parameters and
prompt log-probs are taken; every engine parameter is then overwritten with noise, and
``mcore_zoo.refit`` (direct mode: the zoo's fused, pre-split shards written by name) must bring
back every parameter and every log-prob bitwise - with the fused copies (one Triton launch per
bucket, asserted to have run) and again with one ``copy_`` per shard, and once more with the fused
copies' tables reused. A refit that skips one bucket must fail (the
worker's completeness check) and leave parameters that differ. Finally token_mult_prob_error of
vLLM vs the mcore model is printed per architecture (``-s`` shows it). Each architecture runs in
its own process (one vLLM engine per process).

Needs CUDA and vLLM (bench/gpu/vllm-setup.sh, then ``source bench/gpu/vllm-env.sh``); one GPU:

    python3 -m pytest tests/gpu/test_refit_gpu.py -q -s
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: GPU-to-GPU

if importlib.util.find_spec("vllm") is None:  # before any fixture builds a checkpoint
    pytestmark = pytest.mark.skip(reason="needs vLLM (bench/gpu/vllm-setup.sh, source bench/gpu/vllm-env.sh)")

MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64,
       "qk_head_dim": 192, "num_key_value_heads": 8, "moe_intermediate_size": 128, "n_routed_experts": 8,
       "num_experts_per_tok": 2}  # fmt: skip
ARCHS = [
    ("LlamaForCausalLM", {}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
    ("MistralForCausalLM", {"sliding_window": None}),
    ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2}),
    ("MixtralForCausalLM", {"intermediate_size": 128, "num_local_experts": 8, "num_experts_per_tok": 2}),
    ("Qwen2MoeForCausalLM", {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 8,
                             "num_experts_per_tok": 2}),  # fmt: skip
    ("Glm4MoeForCausalLM", {"moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2}),
    # MLA: vLLM's Hopper MLA kernels take DeepSeek's own widths (kv_lora_rank 512, rope 64, nope / v 128)
    ("DeepseekV2ForCausalLM", {**MLA, "q_lora_rank": None}),  # V2-Lite's shape: q_proj, kv_a_proj_with_mqa apart
    ("DeepseekV3ForCausalLM", {**MLA, "q_lora_rank": 128}),  # fused_qkv_a_proj
]
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 4, "vocab_size": 1000}  # fmt: skip  (1000: vLLM pads the vocabulary to 1024)


def _vllm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("vllm", reason="needs vLLM (bench/gpu/vllm-setup.sh, source bench/gpu/vllm-env.sh)")


def _params(llm) -> dict[str, torch.Tensor]:
    """Every engine parameter (CPU copies; with several workers ``"<rank>:<name>"``)."""

    def read(worker):
        model = worker._zoo_model()  # the zoo's worker extension (either model runner)
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    per_worker = llm.collective_rpc(read)
    if len(per_worker) == 1:
        return per_worker[0]
    return {f"{rank}:{n}": t for rank, params in enumerate(per_worker) for n, t in params.items()}


def _scramble(llm, seed: int) -> None:
    def fill(worker, seed=seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for p in worker._zoo_model().parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype))

    llm.collective_rpc(fill)


def _logprobs(llm, seqs) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs], params, use_tqdm=False)
    return [torch.tensor([e[int(s[j + 1])].logprob for j, e in enumerate(o.prompt_logprobs[1:])]) for s, o in zip(seqs, outs)]


def check(ckpt: str, arch: str, out_dir: str, llm_kwargs: str = "{}") -> dict:
    """One architecture, in a fresh process (one vLLM engine per process); ``llm_kwargs``: JSON of
    further ``vllm.LLM`` arguments (``{"language_model_only": true}`` for a vision-language export)."""
    import vllm

    from mcore_zoo.numerics.metrics import Predictions, logprob_metrics
    from mcore_zoo.rollout import VLLM_WORKER_EXTENSION, VLLMAdapter
    from mcore_zoo.testing.common import random_sequences

    result: dict = {"arch": arch}
    model = mcore_zoo.build_model(ckpt, backend="local", params_dtype=torch.bfloat16, load=ckpt)
    export = os.path.join(out_dir, "export")
    mcore_zoo.save_hf_checkpoint(model, export, dtype=torch.bfloat16)
    vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
    seqs = random_sequences([37, 64, 100], vocab, seed=3)
    settings = dict(dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, seed=0, max_model_len=128,
                    gpu_memory_utilization=0.3, enable_prefix_caching=False, worker_extension_cls=VLLM_WORKER_EXTENSION)  # fmt: skip
    llm = vllm.LLM(model=export, **{**settings, **json.loads(llm_kwargs)})
    want = _params(llm)
    want_lp = _logprobs(llm, seqs)
    adapter = VLLMAdapter(llm)
    result["transport"], result["tp"] = adapter.transport, adapter.tp_size
    result["engine_format"] = adapter.engine_format.name

    _scramble(llm, 1)
    result["scrambled_differs"] = any(not torch.equal(p, want[n]) for n, p in _params(llm).items())
    stats = mcore_zoo.refit(model, adapter, dtype=torch.bfloat16, bucket_size="2MB")
    got = _params(llm)
    result["buckets"] = stats.buckets
    result["names_equal"] = sorted(got) == sorted(want)
    result["params_differ"] = [n for n in want if not torch.equal(got[n], want[n])]
    got_lp = _logprobs(llm, seqs)
    result["logprobs_bitwise"] = all(torch.equal(a, b) for a, b in zip(got_lp, want_lp))
    result["fused"] = all(llm.collective_rpc("zoo_refit_fused"))  # one launch per bucket (Triton)
    _scramble(llm, 3)  # the same refit with one copy_ per shard
    mcore_zoo.refit(model, VLLMAdapter(llm, fused_copies=False), dtype=torch.bfloat16, bucket_size="2MB")
    result["per_shard_params_differ"] = [n for n, p in _params(llm).items() if not torch.equal(p, want[n])]

    # one bucket skipped: the worker refuses, and the parameters are not those of the export
    class Skipping(VLLMAdapter):
        def load_bucket(self, bucket):
            if bucket.index != 1:
                super().load_bucket(bucket)

    _scramble(llm, 2)
    try:
        mcore_zoo.refit(model, Skipping(llm), dtype=torch.bfloat16, bucket_size="2MB")
        result["skipped_bucket_error"] = None
    except ZooError as exc:
        result["skipped_bucket_error"] = str(exc)
    result["skipped_bucket_params_differ"] = len([n for n, p in _params(llm).items() if not torch.equal(p, want[n])])

    # parity after refit: vLLM vs the mcore model, per token
    stats = mcore_zoo.refit(model, adapter, dtype=torch.bfloat16, bucket_size="2MB")
    result["reused_tables_params_differ"] = [n for n, p in _params(llm).items() if not torch.equal(p, want[n])]
    lp = _logprobs(llm, seqs)
    out = mcore_zoo.packed_forward(model, [s.cuda() for s in seqs], seq_format="bshd")  # local: no THD
    trainer_lp = Predictions(tokens=seqs, logprobs=[b.cpu() for b in out.logprobs])
    m = logprob_metrics(trainer_lp, Predictions(tokens=seqs, logprobs=lp))
    result["token_mult_prob_error"], result["max_abs_dlogp"] = m["token_mult_prob_error"], m["max_abs_dlogp"]
    result["refit_mb"], result["refit_ms"] = stats.nbytes / 1e6, stats.seconds * 1e3
    return result


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_refit_into_vllm_is_bitwise(reference_checkpoint, arch, overrides, tmp_path):
    _vllm()
    sizes = dict(SIZES)
    ckpt = reference_checkpoint(arch, {**sizes, **overrides})
    from .conftest import check_vllm_refit, run_check  # here: this file also runs as a script

    r = run_check(__file__, str(ckpt), arch, str(tmp_path))
    check_vllm_refit(r, arch)
    assert r["fused"], "the refit did not run the fused copies (Triton missing?)"
    assert r["skipped_bucket_params_differ"] > 0


#: vLLM with expert parallelism over TP2 (``enable_expert_parallel``): each rank's experts whole
EP_ARCHS = [a for a in ARCHS if a[0] in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")]


@pytest.mark.parametrize("arch,overrides", EP_ARCHS, ids=[a for a, _ in EP_ARCHS])
def test_refit_into_an_expert_parallel_vllm_engine_is_bitwise(reference_checkpoint, arch, overrides, tmp_path):
    """The same checks into an engine of TP2 with ``enable_expert_parallel=True`` (two GPUs; its
    workers in their own processes: CUDA IPC): the adapter plans with the ``vllm-ep`` format and
    every parameter of both ranks and every prompt log-prob comes back bitwise."""
    _vllm()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (an engine of TP2)")
    ckpt = reference_checkpoint(arch, {**SIZES, **overrides})
    from .conftest import run_check

    r = run_check(__file__, str(ckpt), arch, str(tmp_path), json.dumps({"tensor_parallel_size": 2, "enable_expert_parallel": True}))
    results = os.environ.get("MCORE_ZOO_GPU_RESULTS")
    if results:
        with open(os.path.join(results, f"refit-ep2-{arch}.json"), "w") as f:
            json.dump(r, f, indent=1)
    print(f"\n{arch} (engine TP2, expert parallel): token_mult_prob_error {r['token_mult_prob_error']:.6f};"
          f" refit {r['refit_mb']:.1f} MB in {r['refit_ms']:.1f} ms")  # fmt: skip
    assert r["tp"] == 2 and r["engine_format"] == "vllm-ep"
    assert r["scrambled_differs"] and r["buckets"] > 2
    assert r["names_equal"] and r["params_differ"] == []
    assert r["logprobs_bitwise"]
    assert r["per_shard_params_differ"] == [] and r["reused_tables_params_differ"] == []
    assert r["skipped_bucket_error"] is not None and "refit incomplete" in r["skipped_bucket_error"]


if __name__ == "__main__":
    print(json.dumps(check(*sys.argv[1:5])))
