"""Refit into a real ``sglang.Engine`` on the GPU (``SGLangAdapter``), bit for bit.

For each architecture, in its own process: the zoo model (bf16, ``local`` backend) is exported
with ``save_hf_checkpoint`` and SGLang loads that export with its own loaders; its prompt
log-probs (and, where SGLang's model class has ``get_weights_by_name``, every parameter) are the
reference. Every engine tensor is then overwritten with noise through SGLang's own
``update_weights_from_tensor``, and ``mcore_zoo.refit(model, SGLangAdapter(engine))`` must bring
back every log-prob (and parameter) bitwise: the engine's processes read the trainer's buckets
through CUDA IPC and load them with ``load_weights``. A refit that skips one bucket must fail and
leave the engine off the reference. token_mult_prob_error of SGLang vs the mcore model is printed
per architecture (``-s``).

``broadcast`` (two GPUs): the engine runs on GPU 1 and the same checks go through
``SGLangBroadcastAdapter`` - SGLang's ``update_weights_from_distributed``, one NCCL broadcast per
bucket from the trainer on GPU 0 into a weight-update group the engine joins.

Needs CUDA and SGLang (``STACK=sglang bench/gpu/vllm-setup.sh``, then ``source
bench/gpu/sglang-env.sh``); one GPU:

    python3 -m pytest tests/gpu/test_refit_sglang_gpu.py -q -s
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

if importlib.util.find_spec("sglang") is None:  # before any fixture builds a checkpoint
    pytestmark = pytest.mark.skip(reason="needs SGLang (STACK=sglang bench/gpu/vllm-setup.sh, source bench/gpu/sglang-env.sh)")

ARCHS = [
    ("LlamaForCausalLM", {}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
    ("MistralForCausalLM", {"sliding_window": None}),
    # head_dim 64: SGLang's Qwen3-MoE writes the KV cache inside its fused RoPE kernel, which it has
    # for head sizes 64 / 128 / 256 / 512 only (another size asserts in the forward)
    ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "head_dim": 64}),
]
#: SGLang's model classes with ``get_weights_by_name`` (the others: log-probs only)
READABLE = {"LlamaForCausalLM", "MistralForCausalLM"}
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 4, "vocab_size": 1000}  # fmt: skip


def _logprobs(engine, seqs) -> list[torch.Tensor]:
    """Prompt log-probs of ``seqs`` (the first token has none), as SGLang computes them."""
    outs = engine.generate(input_ids=[s.tolist() for s in seqs], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                           return_logprob=True, logprob_start_len=0)  # fmt: skip
    return [torch.tensor([e[0] for e in o["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64) for o in outs]


def _readable(names: list[str], config: dict) -> list[str]:
    """The tensors SGLang 0.5.17's ``get_weights_by_name`` reads right: it cuts q / k / v out of
    ``qkv_proj`` with a head size of ``hidden_size // num_attention_heads``, so where the config
    sets another ``head_dim`` (the Mistral case's 16 against 256 / 8) their reads are other rows."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim == config["hidden_size"] // config["num_attention_heads"]:
        return names
    return [n for n in names if not any(f".{p}_proj." in n for p in "qkv")]


def _weights(engine, names: list[str]) -> dict[str, torch.Tensor]:
    """The engine's values of HF tensors (fp32: exact for bf16), q / k / v and gate / up read from
    their fused parameters by SGLang; ``None`` where SGLang cannot read one."""
    out = {}
    for n in names:
        w = engine.get_weights_by_name(n, truncate_size=1 << 30)
        out[n] = None if w is None else torch.tensor(w, dtype=torch.float32)
    return out


def _equal(engine_value, hf_tensor: torch.Tensor) -> bool:
    """An engine tensor against an HF one; rows the engine pads on (its vocabulary) are left out."""
    if engine_value is None:
        return False
    w, t = engine_value, hf_tensor.float()
    if w.dim() == t.dim() and w.shape[1:] == t.shape[1:] and w.shape[0] > t.shape[0]:
        w = w[: t.shape[0]]
    return w.shape == t.shape and torch.equal(w, t)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(ckpt: str, arch: str, out_dir: str, transport: str = "ipc") -> dict:
    """One architecture, in a fresh process (one SGLang engine per process). ``transport``:
    ``ipc`` (``SGLangAdapter``, the engine on this GPU) or ``broadcast``
    (``SGLangBroadcastAdapter``, the engine on GPU 1)."""
    import sglang
    from safetensors.torch import load_file

    from mcore_zoo.numerics.metrics import Predictions, logprob_metrics
    from mcore_zoo.parity.runners import run_hf
    from mcore_zoo.registry import get_registry
    from mcore_zoo.rollout import SGLangAdapter, SGLangBroadcastAdapter
    from mcore_zoo.testing.common import random_sequences

    result: dict = {"arch": arch, "sglang": sglang.__version__, "transport": transport}
    adapters: list = []

    def adapter(cls=None):
        """A new adapter of the transport (``cls``: a subclass of its adapter class)."""
        if transport == "ipc":
            return (cls or SGLangAdapter)(engine)
        made = (cls or SGLangBroadcastAdapter)(engine, host="127.0.0.1", port=_free_port(),
                                               group_name=f"zoo-refit-{len(adapters)}", timeout=300)  # fmt: skip
        adapters.append(made)
        return made

    model = mcore_zoo.build_model(ckpt, backend="local", params_dtype=torch.bfloat16, load=ckpt)
    export = os.path.join(out_dir, "export")
    mcore_zoo.save_hf_checkpoint(model, export, dtype=torch.bfloat16)
    hf = {}
    for f in sorted(os.listdir(export)):
        if f.endswith(".safetensors"):
            hf.update(load_file(os.path.join(export, f)))
    vocab = mcore_zoo.handle_of(model).arch_config.vocab_size
    seqs = random_sequences([37, 64, 100], vocab, seed=3)
    engine = sglang.Engine(model_path=export, dtype="bfloat16", skip_tokenizer_init=True, random_seed=0, context_length=256,
                           mem_fraction_static=0.3, disable_cuda_graph=True, log_level="error",
                           base_gpu_id=1 if transport == "broadcast" else 0)  # fmt: skip
    try:
        readable = arch in READABLE
        want_lp = _logprobs(engine, seqs)
        with open(os.path.join(ckpt, "config.json")) as f:
            readable_names = _readable(sorted(hf), json.load(f))
        result["weights_not_readable"] = sorted(set(hf) - set(readable_names)) if readable else sorted(hf)
        want_w = _weights(engine, readable_names) if readable else {}
        result["weights_read"] = len(want_w)
        result["weights_unequal_export"] = [n for n, w in want_w.items() if not _equal(w, hf[n])]

        def scramble(seed: int) -> None:
            # on another GPU than the engine's, the noise goes as CPU tensors (no CUDA IPC across devices)
            device = "cuda" if transport == "ipc" else "cpu"
            gen = torch.Generator(device=device).manual_seed(seed)
            noise = [(n, torch.randn(t.shape, generator=gen, device=device).to(t.dtype)) for n, t in hf.items()]
            ok, msg = engine.update_weights_from_tensor(noise, flush_cache=True)
            assert ok, msg

        scramble(1)
        result["scrambled_differs"] = any(not torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))
        main = adapter()
        stats = mcore_zoo.refit(model, main, dtype=torch.bfloat16, bucket_size="2MB")
        result["buckets"] = stats.buckets
        result["logprobs_bitwise"] = all(torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))
        got_w = _weights(engine, sorted(want_w))
        result["params_differ"] = [n for n in want_w if got_w[n] is None or not torch.equal(got_w[n], want_w[n])]

        class Skipping(SGLangAdapter if transport == "ipc" else SGLangBroadcastAdapter):
            def load_bucket(self, bucket):
                if bucket.index != 1:
                    super().load_bucket(bucket)

        scramble(2)
        try:
            mcore_zoo.refit(model, adapter(Skipping), dtype=torch.bfloat16, bucket_size="2MB")
            result["skipped_bucket_error"] = None
        except ZooError as exc:
            result["skipped_bucket_error"] = str(exc)
        result["skipped_bucket_logprobs_differ"] = any(not torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))

        # parity after refit: SGLang vs the mcore model, per token
        stats = mcore_zoo.refit(model, main, dtype=torch.bfloat16, bucket_size="2MB")
        lp = _logprobs(engine, seqs)
        out = mcore_zoo.packed_forward(model, [s.cuda() for s in seqs], seq_format="bshd")  # local: no THD
        engine_lp, trainer_lp = Predictions(tokens=seqs, logprobs=lp), Predictions(tokens=seqs, logprobs=[b.cpu() for b in out.logprobs])
        m = logprob_metrics(trainer_lp, engine_lp)
        result["token_mult_prob_error"], result["max_abs_dlogp"] = m["token_mult_prob_error"], m["max_abs_dlogp"]
        # which side a distance is on: both against transformers in fp32 (the export, each sequence
        # alone, on the CPU - the parity harness's reference run)
        hf = run_hf(get_registry().get(arch), export, seqs, dtype=torch.float32, capture=False).predictions
        result["sglang_vs_hf_fp32"] = logprob_metrics(hf, engine_lp)["token_mult_prob_error"]
        result["mcore_vs_hf_fp32"] = logprob_metrics(hf, trainer_lp)["token_mult_prob_error"]
        result["refit_mb"], result["refit_ms"] = stats.nbytes / 1e6, stats.seconds * 1e3
        big = mcore_zoo.refit(model, main, dtype=torch.bfloat16, bucket_size="1GB")  # one bucket: the rate
        result["refit_1gb_bucket_ms"] = big.seconds * 1e3
    finally:
        for made in adapters:
            made.close()
        engine.shutdown()
    return result


#: (transport, architectures): the engine-side GPU path is the same for every model, so the
#: broadcast transport runs a dense and an MoE model
TRANSPORTS = [("ipc", [a for a, _ in ARCHS]), ("broadcast", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])]
CASES = [(t, a, o) for t, archs in TRANSPORTS for a, o in ARCHS if a in archs]


@pytest.mark.parametrize("transport,arch,overrides", CASES, ids=[f"{t}-{a}" for t, a, _ in CASES])
def test_refit_into_sglang_is_bitwise(reference_checkpoint, transport, arch, overrides, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if transport == "broadcast" and torch.cuda.device_count() < 2:
        pytest.skip("the broadcast transport needs two GPUs (trainer on GPU 0, engine on GPU 1)")
    ckpt = reference_checkpoint(arch, {**SIZES, **overrides})
    from .conftest import run_check  # here: this file also runs as a script

    r = run_check(__file__, str(ckpt), arch, str(tmp_path), transport)
    results = os.environ.get("MCORE_ZOO_GPU_RESULTS")
    if results:
        with open(os.path.join(results, f"refit-sglang-{transport}-{arch}.json"), "w") as f:
            json.dump(r, f, indent=1)
    print(f"\n{arch} ({transport}): SGLang {r['sglang']} after refit vs mcore local bf16: token_mult_prob_error"
          f" {r['token_mult_prob_error']:.6f}, max |dlogp| {r['max_abs_dlogp']:.3e}; refit {r['refit_mb']:.1f} MB in"
          f" {r['refit_ms']:.1f} ms (2 MB buckets), {r['refit_1gb_bucket_ms']:.1f} ms (one bucket); against transformers"
          f" fp32: SGLang {r['sglang_vs_hf_fp32']:.6f}, mcore {r['mcore_vs_hf_fp32']:.6f}")  # fmt: skip
    assert r["scrambled_differs"] and r["buckets"] > 2
    assert r["logprobs_bitwise"]
    if arch in READABLE:
        assert r["weights_read"] > 0 and r["weights_unequal_export"] == []
        assert r["params_differ"] == []
    assert r["skipped_bucket_error"] is not None and "refit incomplete" in r["skipped_bucket_error"]
    assert r["skipped_bucket_logprobs_differ"]


if __name__ == "__main__":
    print(json.dumps(check(*sys.argv[1:5])))
