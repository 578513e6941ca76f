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
    ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2}),
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


def check(ckpt: str, arch: str, out_dir: str) -> dict:
    """One architecture, in a fresh process (one SGLang engine per process)."""
    import sglang
    from safetensors.torch import load_file

    from mcore_zoo.rollout import SGLangAdapter
    from mcore_zoo.testing.common import random_sequences

    result: dict = {"arch": arch, "sglang": sglang.__version__}
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
                           mem_fraction_static=0.3, disable_cuda_graph=True, log_level="error")  # fmt: skip
    try:
        readable = arch in READABLE
        want_lp = _logprobs(engine, seqs)
        want_w = _weights(engine, sorted(hf)) if readable else {}
        result["weights_read"] = len(want_w)
        result["weights_unequal_export"] = [n for n, w in want_w.items() if not _equal(w, hf[n])]

        def scramble(seed: int) -> None:
            gen = torch.Generator(device="cuda").manual_seed(seed)
            noise = [(n, torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype)) for n, t in hf.items()]
            ok, msg = engine.update_weights_from_tensor(noise, flush_cache=True)
            assert ok, msg

        scramble(1)
        result["scrambled_differs"] = any(not torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))
        stats = mcore_zoo.refit(model, SGLangAdapter(engine), dtype=torch.bfloat16, bucket_size="2MB")
        result["buckets"] = stats.buckets
        result["logprobs_bitwise"] = all(torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))
        got_w = _weights(engine, sorted(want_w))
        result["params_differ"] = [n for n in want_w if got_w[n] is None or not torch.equal(got_w[n], want_w[n])]

        class Skipping(SGLangAdapter):
            def load_bucket(self, bucket):
                if bucket.index != 1:
                    super().load_bucket(bucket)

        scramble(2)
        try:
            mcore_zoo.refit(model, Skipping(engine), dtype=torch.bfloat16, bucket_size="2MB")
            result["skipped_bucket_error"] = None
        except ZooError as exc:
            result["skipped_bucket_error"] = str(exc)
        result["skipped_bucket_logprobs_differ"] = any(not torch.equal(a, b) for a, b in zip(_logprobs(engine, seqs), want_lp))

        # parity after refit: SGLang vs the mcore model, per token
        stats = mcore_zoo.refit(model, SGLangAdapter(engine), dtype=torch.bfloat16, bucket_size="2MB")
        lp = _logprobs(engine, seqs)
        out = mcore_zoo.packed_forward(model, [s.cuda() for s in seqs], seq_format="bshd")  # local: no THD
        d = torch.cat([(a - b.double().cpu()).abs() for a, b in zip(lp, out.logprobs)])
        result["token_mult_prob_error"] = float(d.exp().mean())
        result["max_abs_dlogp"] = float(d.max())
        result["refit_mb"], result["refit_ms"] = stats.nbytes / 1e6, stats.seconds * 1e3
    finally:
        engine.shutdown()
    return result


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_refit_into_sglang_is_bitwise(reference_checkpoint, arch, overrides, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ckpt = reference_checkpoint(arch, {**SIZES, **overrides})
    from .conftest import run_check  # here: this file also runs as a script

    r = run_check(__file__, str(ckpt), arch, str(tmp_path))
    print(f"\n{arch}: SGLang {r['sglang']} after refit vs mcore local bf16: token_mult_prob_error {r['token_mult_prob_error']:.6f},"
          f" max |dlogp| {r['max_abs_dlogp']:.3e}; refit {r['refit_mb']:.1f} MB in {r['refit_ms']:.1f} ms")  # fmt: skip
    assert r["scrambled_differs"] and r["buckets"] > 2
    assert r["logprobs_bitwise"]
    if arch in READABLE:
        assert r["weights_read"] > 0 and r["weights_unequal_export"] == []
        assert r["params_differ"] == []
    assert r["skipped_bucket_error"] is not None and "refit incomplete" in r["skipped_bucket_error"]
    assert r["skipped_bucket_logprobs_differ"]


if __name__ == "__main__":
    print(json.dumps(check(*sys.argv[1:4])))
