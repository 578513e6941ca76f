"""Per-sequence overhead of the ``training`` profile on a THD pack of many short sequences.

A tiny random Llama (``portable`` backend on the CPU, ``te`` with ``--device cuda``), the
``training`` profile, one pack of ``--batch`` sequences of ``--seq`` tokens, forward + backward of
the summed logits. Two forms, taking turns, after a warm-up:

* ``whole-pack``: the zoo as it is - the ``sdpa`` attention on contiguous slices of the pack
  (:meth:`mcore_zoo.specs.portable.PortableAttention._thd_sdpa_slices`), Megatron-Core's unfused
  THD RoPE over the whole pack (:mod:`mcore_zoo.specs.thd_rope`);
* ``per-sequence``: the same model with both switched back to the per-sequence forms they replace
  (each sequence's rows gathered with an index tensor and scattered back; Megatron-Core's own
  ``_apply_rotary_pos_emb_thd``). The pack's bounds are read to the host once per pack in both
  (before, the attention read them in every layer: a device sync on CUDA that this form leaves out).

Both must give the same logits and gradients bit for bit (checked before timing; on CUDA, where
FlashAttention's backward accumulates with atomics, the gradients' gap between the forms must not
exceed the gap between two runs of one form). Reported: the number of tensor ops one forward +
backward dispatches (a ``TorchDispatchMode`` count: on a GPU roughly the kernel launches), the
median and minimum wall time of forward + backward per form, and their ratios (on a shared machine
the minimum is the steadier figure).

    PYTHONPATH=src python bench/thd_pack_overhead.py [--batch 16 --seq 64 --layers 4 --repeat 20]
    PYTHONPATH=src python bench/thd_pack_overhead.py --device cuda --hidden 4096 --heads 32 --kv-heads 8 \
        --ffn 14336 --batch 16 --seq 512     # te backend, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any, Iterator

import torch


def llama(layers: int, hidden: int, heads: int = 8, kv_heads: int = 4, ffn: int = 0) -> dict[str, Any]:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=hidden,
                intermediate_size=ffn or 2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=hidden // heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=10000.0)  # fmt: skip


@contextlib.contextmanager
def per_sequence() -> Iterator[None]:
    """The per-sequence forms the whole-pack ones replaced, inside the block."""
    from megatron.core.models.common.embeddings import rope_utils

    from mcore_zoo.specs.portable import PortableAttention

    rope = rope_utils._apply_rotary_pos_emb_thd
    slices = PortableAttention._thd_sdpa_slices
    rope_utils._apply_rotary_pos_emb_thd = getattr(rope, "__wrapped__", rope)
    PortableAttention._thd_sdpa_slices = lambda self, *args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_thd = rope
        PortableAttention._thd_sdpa_slices = slices  # type: ignore[method-assign]


def count_ops(fn: Any) -> int:
    """How many tensor ops ``fn()`` dispatches (views included), forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=0, help="intermediate size (default: 2 x hidden)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    import mcore_zoo
    from mcore_zoo.parallel import ensure_model_parallel

    ensure_model_parallel()
    cuda = args.device == "cuda"
    model = mcore_zoo.build_model(llama(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn),
                                  backend="te" if cuda else "portable",
                                  numerics="training", params_dtype=torch.bfloat16 if cuda else torch.float32)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (args.seq,), generator=gen) for _ in range(args.batch)]
    pack = mcore_zoo.pack_sequences(seqs).to(args.device)
    params = pack.packed_seq_params()

    def step(keep: bool = False) -> Any:
        model.zero_grad(set_to_none=True)
        logits = model(pack.input_ids, pack.position_ids, None, packed_seq_params=params)
        logits.float().sum().backward()
        return (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]) if keep else None

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    def grad_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))

    new, again = step(keep=True), step(keep=True)
    with per_sequence():
        old = step(keep=True)
    if not torch.equal(new[0], old[0]):
        print("whole-pack and per-sequence forms give other logits: not timing", file=sys.stderr)
        return 1
    grads = "gradients bitwise equal"
    if not all(map(torch.equal, new[1], old[1])):
        # CUDA: FlashAttention's backward accumulates dq with atomics, so two runs of one form may
        # differ too; the gap between the forms must then stay within that run-to-run gap
        gap, noise = grad_gap(new[1], old[1]), grad_gap(new[1], again[1])
        grads = f"gradients differ by up to {gap:.3g} (two runs of the whole-pack form: {noise:.3g})"
        if not cuda or gap > noise:
            print(f"whole-pack and per-sequence forms: {grads}: not timing", file=sys.stderr)
            return 1
    ops = {"whole-pack": count_ops(step)}
    with per_sequence():
        ops["per-sequence"] = count_ops(step)
    times: dict[str, list[float]] = {"whole-pack": [], "per-sequence": []}
    for _ in range(2):
        timed()
        with per_sequence():
            timed()
    for _ in range(args.repeat):
        times["whole-pack"].append(timed())
        with per_sequence():
            times["per-sequence"].append(timed())
    print(f"{args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}: tiny Llama ({args.layers} layers,"
          f" hidden {args.hidden}), training profile, THD pack {args.batch} x {args.seq}, forward + backward")  # fmt: skip
    for name, values in times.items():
        print(f"  {name:13s} {ops[name]:6d} ops   median {statistics.median(values):8.2f} ms   min {min(values):8.2f} ms")
    ratio = statistics.median(times["per-sequence"]) / statistics.median(times["whole-pack"])
    best = min(times["per-sequence"]) / min(times["whole-pack"])
    print(f"  per-sequence / whole-pack: {ratio:.2f}x median, {best:.2f}x minimum (logits bitwise equal, {grads})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
