"""How far a model's bf16 gradients move under any change of rounding: transformers itself, run
in fp32, in bf16 (eager attention) and in bf16 (sdpa), on the vLLM GPU test's random checkpoint
and sequences (CPU)::

    python bench/cpu/grad_noise_floor.py DeepseekV3ForCausalLM Qwen3MoeForCausalLM [--json out.json]

The checkpoint is the one ``tests/gpu/test_vllm_exact_gpu.py`` and ``bench/gpu/vllm_exact_tp.py``
write (``write_reference_checkpoint``, seed 0, bf16, the test's sizes); the sequences are its four
prompts with 48 more tokens each (the length of prompt + continuation; random tokens, seed 7). The
loss is ``-sum`` of the log-probs of every next token, one sequence at a time, gradients summed.
Prints, per architecture, the relative L2 distance (all parameters together; and the worst single
parameter) of the bf16 eager gradients to the fp32 ones and of the bf16 sdpa gradients to the bf16
eager ones: the spread any bf16 backward of the same forward has for this model, against which a
``vllm-exact`` / ``hf-exact`` or a TP2 / TP1 gradient distance can be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))


def _gradients(ckpt: str, seqs: list[torch.Tensor], dtype: torch.dtype, attention: str) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attention)
    for seq in seqs:
        logits = model(seq[None]).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, seq[1:, None]).squeeze(-1)
        (-logprobs.sum()).backward()
    return {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


def _distance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    den = sum(float(want[k].pow(2).sum()) for k in want)
    worst = max(float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want)
    return {"rel_l2": (num / den) ** 0.5, "worst_param": worst}


def measure(arch: str, workdir: str) -> dict[str, Any]:
    from test_vllm_exact_gpu import ARCHS, PROMPTS, SIZES, NEW_TOKENS

    import mcore_zoo
    from mcore_zoo.parity.reference import write_reference_checkpoint
    from mcore_zoo.testing.common import case_config, random_sequences

    config = case_config(arch, {**SIZES, **dict(ARCHS)[arch]})
    ckpt = str(Path(workdir) / arch)
    write_reference_checkpoint(mcore_zoo.lookup(arch), config, ckpt, seed=0, dtype=torch.bfloat16)
    seqs = random_sequences([p + NEW_TOKENS for p in PROMPTS], config["vocab_size"], seed=7)
    fp32 = _gradients(ckpt, seqs, torch.float32, "eager")
    eager = _gradients(ckpt, seqs, torch.bfloat16, "eager")
    sdpa = _gradients(ckpt, seqs, torch.bfloat16, "sdpa")
    return {"arch": arch, "tokens": sum(len(s) - 1 for s in seqs), "bf16_eager_vs_fp32": _distance(eager, fp32),
            "bf16_sdpa_vs_bf16_eager": _distance(sdpa, eager), "torch": torch.__version__}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archs", nargs="+")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for arch in args.archs:
            results.append(measure(arch, workdir))
            print(json.dumps(results[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
