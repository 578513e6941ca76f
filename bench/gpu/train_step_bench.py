"""The training forward + backward on one GPU: ``train_step`` against GPTModel's own ``labels`` path
(Megatron-Core's vocab-parallel cross entropy) and the naive full-logits path, same model and pack.

    PYTHONPATH=src python bench/gpu/train_step_bench.py --out OUT [--tokens 8192,32768] [--layers 4]

The model: random weights at Qwen3-8B width (hidden 4096, FFN 12288, 32 / 8 heads of 128, vocab
151936), ``--layers`` layers, ``te`` backend, bf16; packs of 1024-token sequences. Each path runs
the same loss (the sum of next-token log-probs, i.e. minus the cross-entropy) and its backward:

* ``train_step``: ``mcore_zoo.train_step`` with the chunked vocab-parallel head (no [T, V] fp32);
* ``labels``: ``model(ids, pos, None, labels=..., packed_seq_params=...)`` - Megatron-Core's loss;
* ``naive``: ``mcore_zoo.packed_forward`` (full logits, fp32 log-softmax per sequence).

Timings are medians over ``--repeat`` steps after warm-up; peak memory is
``torch.cuda.max_memory_allocated`` over one step, minus what was allocated before it. Writes
``train_step_bench.json`` / ``.md`` to ``--out``. ``--profile NAME`` picks the numerics profile
(``default``, ``training``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN3_8B_WIDTH = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="8192,32768", help="pack sizes (tokens), comma-separated")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--profile", default="default")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    import transformer_engine.pytorch  # noqa: F401 - before any other CUDA op (two cuDNNs; see shared/gpu)

    import mcore_zoo
    from mcore_zoo.packing import pack_sequences
    from mcore_zoo.parity.reference import write_reference_checkpoint

    config = dict(QWEN3_8B_WIDTH, num_hidden_layers=args.layers)
    ckpt = tempfile.mkdtemp(prefix="train-bench-")
    write_reference_checkpoint(mcore_zoo.lookup(config), config, ckpt, seed=0, dtype=torch.bfloat16)
    model = mcore_zoo.build_model(ckpt, backend="te", numerics=args.profile, params_dtype=torch.bfloat16, load=ckpt)
    vocab = config["vocab_size"]

    def loss_fn(t):  # minus the cross-entropy, summed: the same loss on every path
        return (t.logprobs * t.mask).sum(), {}

    results = {"device": torch.cuda.get_device_name(), "layers": args.layers, "profile": args.profile,
               "width": "Qwen3-8B", "vocab": vocab, "runs": {}}  # fmt: skip
    for total in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(total)
        seqs = [torch.randint(0, vocab, (1024,), generator=gen) for _ in range(total // 1024)]
        batch = pack_sequences(seqs).to("cuda")
        labels = torch.full_like(batch.input_ids, -100)
        for start, n in zip(batch.cu_seqlens_padded.tolist(), batch.lengths):
            labels[0, start : start + n - 1] = batch.input_ids[0, start + 1 : start + n]
        params = batch.packed_seq_params()

        def zoo() -> None:
            mcore_zoo.train_step(model, seqs, loss_fn, max_tokens_per_microbatch=total)

        def labels_path() -> None:
            loss = model(batch.input_ids, batch.position_ids, None, labels=labels.clamp(min=0), packed_seq_params=params)
            (loss * (labels >= 0)).sum().backward()

        def naive() -> None:
            out = mcore_zoo.packed_forward(model, seqs)
            sum(lp.sum() for lp in out.logprobs).backward()

        entry = {}
        for name, fn in (("train_step", zoo), ("labels", labels_path), ("naive", naive)):
            try:
                entry[name] = measure(model, fn, args.repeat)
            except torch.OutOfMemoryError as exc:
                entry[name] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
                torch.cuda.empty_cache()
        base = entry["labels"]
        for name, e in entry.items():
            if "ms" in e and "ms" in base:
                e["time_vs_labels"] = e["ms"] / base["ms"]
                e["peak_vs_labels"] = e["peak_gib"] / base["peak_gib"]
        results["runs"][str(total)] = entry
        print(json.dumps({total: entry}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "train_step_bench.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def measure(model: torch.nn.Module, fn, repeat: int) -> dict:
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    model.zero_grad(set_to_none=True)
    return {"ms": statistics.median(times), "min_ms": min(times), "peak_gib": peak}


def markdown(results: dict) -> str:
    lines = [f"# Training forward + backward ({results['device']}, {results['layers']} layers at"
             f" {results['width']} width, vocab {results['vocab']}, te bf16, profile `{results['profile']}`)", "",
             "| tokens | path | ms | peak GiB (above weights) | time vs labels | peak vs labels |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for total, entry in results["runs"].items():
        for name, e in entry.items():
            if "error" in e:
                lines.append(f"| {total} | {name} | {e['error']} | | | |")
                continue
            lines.append(f"| {total} | {name} | {e['ms']:.1f} | {e['peak_gib']:.2f} | {e.get('time_vs_labels', 1):.3f}x"
                         f" | {e.get('peak_vs_labels', 1):.3f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
