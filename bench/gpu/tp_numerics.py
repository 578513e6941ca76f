"""Tensor parallel and exactness (GPU, bf16): how far is TP=2 from TP=1 (= HF eager under hf-exact)?

Run under ``torchrun --nproc_per_node 2``. Rank 0 writes a random Llama-like checkpoint (sharp
attention); every rank builds the TP=2 model (``hf-exact`` on ``local``, and ``te`` default) and
loads it; rank 0 compares the gathered logits with transformers eager on one GPU (which ``hf-exact``
at TP=1 reproduces bit for bit) and checks run-to-run determinism of TP=2.

    torchrun --nproc_per_node 2 bench/gpu/tp_numerics.py --out OUT

Writes ``OUT/tp_numerics.json`` and ``.md``. ``--device cpu`` runs the logic with gloo in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=1024,
              intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)  # fmt: skip


def logit_metrics(ours: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    ours, ref = ours.float(), ref.float()
    lo, lr = torch.log_softmax(ours, -1), torch.log_softmax(ref, -1)
    tgt = ids[:, 1:].unsqueeze(-1)
    d = (lo[:, :-1].gather(-1, tgt) - lr[:, :-1].gather(-1, tgt)).abs()
    return {
        "bitwise": bool(torch.equal(ours, ref)),
        "max_dlogit": float((ours - ref).abs().max()),
        "mean_dlogp": float(d.mean()),
        "max_dlogp": float(d.max()),
        "top1": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import mcore_zoo
    from mcore_zoo.config.arch import Parallelism
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.parity.reference import load_reference, write_reference_checkpoint

    dtype = torch.bfloat16 if cuda else torch.float32
    config = dict(CONFIG, **({} if cuda else TINY))
    ensure_model_parallel(Parallelism(tp=dist.get_world_size()))
    arch = mcore_zoo.lookup("LlamaForCausalLM")
    shared = [tempfile.mkdtemp(prefix="tpnum-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    ckpt = shared[0]
    if rank == 0:
        write_reference_checkpoint(arch, config, ckpt, dtype=dtype)
    dist.barrier()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    B, S = (4, 512) if cuda else (2, 32)
    ids = torch.randint(0, config["vocab_size"], (B, S), generator=gen).to(device)
    positions = torch.arange(S, device=device).expand(B, -1)
    report: dict[str, Any] = {"tp": dist.get_world_size(), "device": torch.cuda.get_device_name() if cuda else "cpu", "variants": {}}
    ref = None
    if rank == 0:
        hf = load_reference(arch, ckpt, dtype=dtype, attn_implementation="eager", device=device)
        with torch.no_grad():
            ref = hf(ids).logits
        del hf
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    for name, backend, profile in (("local/hf-exact", "local", "hf-exact"), ("te/default", "te", "default")):
        entry: dict[str, Any] = {}
        try:
            if backend == "te" and not cuda:
                raise RuntimeError("te needs CUDA")
            model = mcore_zoo.build_model(ckpt, backend=backend, numerics=profile, params_dtype=dtype, load=ckpt).eval()
            with torch.no_grad():
                first = gather_from_tensor_model_parallel_region(model(ids, positions, None))
                second = gather_from_tensor_model_parallel_region(model(ids, positions, None))
            if rank == 0:
                entry = logit_metrics(first, ref, ids)
                entry["run_to_run_bitwise"] = bool(torch.equal(first, second))
            del model
        except Exception as exc:
            entry = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        report["variants"][name] = entry
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tp_numerics.json"), "w") as f:
            json.dump(report, f, indent=1)
        lines = [f"# TP={report['tp']} vs transformers eager ({report['device']}, {dtype})", "",
                 "| variant | bitwise | max dlogit | mean dlogp | max dlogp | top-1 | TP run-to-run bitwise |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, e in report["variants"].items():
            if "error" in e:
                lines.append(f"| {name} | error: `{e['error'][:80]}` | | | | | |")
            else:
                lines.append(f"| {name} | {e['bitwise']} | {e['max_dlogit']:.3g} | {e['mean_dlogp']:.3g} | "
                             f"{e['max_dlogp']:.3g} | {e['top1'] * 100:.1f}% | {e['run_to_run_bitwise']} |")  # fmt: skip
        with open(os.path.join(args.out, "tp_numerics.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
