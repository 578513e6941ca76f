"""Refit into an engine that serves FP8 block-quantized weights, from a model trained in bf16.

The trainer's refit is unchanged - the same :class:`~mcore_zoo.rollout.plan.RefitPlan` in the
engine's names and TP shards, the same data paths (``local``, ``tp-local``, ``stream``) - and an
:class:`Fp8BlockAdapter` in front of the engine's adapter quantizes on the way::

    adapter = Fp8BlockAdapter(DictAdapter(tp_size=2))      # or vllm_fp8.VLLMFp8Adapter(llm)
    mcore_zoo.refit(model, adapter)

For every shard of a quantized tensor (:class:`~mcore_zoo.weights.fp8_quantize.Fp8BlockScheme`:
the linear layers; embeddings, LM head, routers and norms pass in bf16) it sends two: the shard
in float8_e4m3fn and its ``weight_scale_inv`` shard (fp32, one per block), quantized with vLLM's
block quantizer on the device the shard is on - the trainer's. The engine's adapter sees the plan
of those tensors (:func:`fp8_refit_plan`): every quantized slot in fp8 and, after each HF tensor's
slots, a slot of its scales in the engine's name (``qkv_proj.weight`` ->
``qkv_proj.weight_scale_inv``, ``w13_weight`` -> ``w13_weight_scale_inv``), cut in block units.

Why per shard equals per tensor: every slot of a quantized tensor is cut on block boundaries
(its cuts and its row offset inside a fused engine tensor are multiples of the block; only a cut
that ends at the tensor's edge may be shorter, and only at engine TP 1), so the shard's blocks are
the whole tensor's and ``quantize(shard) == cut(quantize(tensor))`` bit for bit - the tensors of a
checkpoint written by ``save_hf_checkpoint(fp8="block")`` and loaded by the engine. A plan whose
slots are not so cut is refused when the adapter gets it, naming the tensor: vLLM refuses the same
layouts when it builds the FP8 model (``validate_fp8_block_shape``: a column-parallel output or
row-parallel input per rank that is not a multiple of the block; ``Fp8MoEMethod.create_weights``:
an expert intermediate size per rank that is not).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..errors import LayoutError, ZooError
from ..weights.fp8_quantize import Fp8BlockScheme
from .adapter import EngineAdapter, RefitBucket
from .plan import EngineTensor, RefitPlan, Slot, _check_tiling

if TYPE_CHECKING:  # pragma: no cover
    from .engine_format import EngineFormat


def fp8_refit_plan(plan: RefitPlan, scheme: Optional[Fp8BlockScheme] = None) -> RefitPlan:
    """The plan an FP8 engine receives for ``plan`` (module docstring): quantized slots in
    float8_e4m3fn, each HF tensor's scale slots after its own, scale tensors among the engine
    tensors. ``scheme``: the FP8 block format (default 128 x 128 blocks, fp32 scales). Raises
    :class:`LayoutError` naming the tensor when a slot is not cut on block boundaries (the
    engine's TP splits a quantized tensor inside a block)."""
    scheme = scheme or Fp8BlockScheme()
    block = scheme.block
    quantized = {name for name, shape, _ in plan.hf if scheme.quantizes(name, shape)}
    hf: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    slots: dict[str, list[list[Slot]]] = {}
    for name, shape, dtype in plan.hf:
        if name not in quantized:
            hf.append((name, shape, dtype))
            slots[name] = plan.slots[name]
            continue
        scale = scheme.scale_name(name)
        hf += [(name, shape, torch.float8_e4m3fn), (scale, scheme.scale_shape(shape), torch.float32)]
        slots[name] = [[replace(s, dtype=torch.float8_e4m3fn) for s in per] for per in plan.slots[name]]
        slots[scale] = [[_scale_slot(s, shape, scheme, plan.target_tp) for s in per] for per in plan.slots[name]]
    fp8_engine = {s.name for name in quantized for per in plan.slots[name] for s in per}
    plain_engine = {s.name for name in plan.slots if name not in quantized for per in plan.slots[name] for s in per}
    mixed = sorted(fp8_engine & plain_engine)
    if mixed:
        raise ZooError(f"FP8 refit: engine tensor(s) {mixed[:4]} fuse quantized and unquantized HF tensors")
    engine_tensors = []
    for tensors in plan.engine_tensors:
        out: list[EngineTensor] = []
        for t in tensors:
            if t.name not in fp8_engine:
                out.append(t)
                continue
            *lead, rows, cols = t.shape
            out.append(EngineTensor(t.name, t.shape, torch.float8_e4m3fn))
            grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
            out.append(EngineTensor(scheme.scale_name(t.name), grid, torch.float32))
        engine_tensors.append(out)
    buckets = [[n for name in names for n in ((name, scheme.scale_name(name)) if name in quantized else (name,))]
               for names in plan.buckets]  # fmt: skip
    fp8 = RefitPlan(plan.architecture, plan.engine_format, plan.target_tp, plan.dtype, plan.bucket_size, hf, slots,
                    buckets, engine_tensors)  # fmt: skip
    _check_tiling(fp8)  # every engine tensor, scales included, filled once; every HF tensor in one bucket
    return fp8


def _scale_slot(slot: Slot, shape: tuple[int, ...], scheme: Fp8BlockScheme, tp: int) -> Slot:
    """The slot of ``slot``'s scales: its cuts, offset and rows in block units. Refuses a slot
    whose cuts or offset do not fall on block boundaries (module docstring)."""
    if len(shape) != 2 or slot.pad or slot.expert_slice:
        raise ZooError(f"FP8 refit: {slot.hf_name!r} {list(shape)} is not a 2-D weight the engine quantizes per block")
    block = scheme.block
    cuts, size = [], list(shape)
    for axis, start, length in slot.cuts:
        b = block[axis]
        edge = start + length == size[axis] and tp == 1  # a ragged last block, only where vLLM allows it
        if start % b or (length % b and not edge):
            raise LayoutError(
                f"FP8 refit: engine TP{tp} cuts {slot.hf_name!r} {list(shape)} at [{start}, {start + length}) along"
                f" axis {axis}, not on a boundary of the {list(block)} blocks (the engine tensor {slot.name!r}'s"
                f" shard would hold parts of blocks; vLLM refuses this layout when it builds the FP8 model:"
                f" each rank's share of a quantized dimension must be a multiple of the block)")  # fmt: skip
        cuts.append((axis, start // b, -(-length // b)))
        size[axis] = length
    if slot.offset % block[0]:
        raise LayoutError(f"FP8 refit: {slot.hf_name!r} starts at row {slot.offset} of the engine tensor {slot.name!r},"
                          f" not on a boundary of the {block[0]}-row blocks (vLLM refuses this layout)")  # fmt: skip
    grid = scheme.scale_shape(slot.shape)
    return Slot(scheme.scale_name(slot.name), scheme.scale_name(slot.hf_name), slot.expert, slot.offset // block[0],
                grid, torch.float32, tuple(cuts), 0, -(-slot.rows // block[0]))  # fmt: skip


class Fp8BlockAdapter(EngineAdapter):
    """An engine adapter in front of ``inner`` that quantizes every shard of a quantized tensor
    (module docstring). ``inner`` receives :func:`fp8_refit_plan` of the trainer's plan and, per
    bucket, each quantized shard as ``(fp8 slot, q)`` followed by its tensor's scale shards.

    It takes shards in their slots' shape and dtype (``raw_shards`` off), plans with ``inner``'s
    engine format and TP size, and feeds ``inner``'s engine rank where it names one.
    """

    raw_shards = False

    def __init__(self, inner: EngineAdapter, scheme: Optional[Fp8BlockScheme] = None) -> None:
        self.inner = inner
        self.scheme = scheme or Fp8BlockScheme()
        self._plan: Optional[tuple["weakref.ref[RefitPlan]", RefitPlan]] = None
        self._slots: dict[Slot, tuple[Slot, Slot]] = {}

    @property
    def engine_format(self) -> "EngineFormat":  # type: ignore[override]
        return self.inner.engine_format

    @property
    def tp_size(self) -> int:  # type: ignore[override]
        return self.inner.tp_size

    @property
    def engine_rank(self) -> Optional[int]:  # type: ignore[override]
        return getattr(self.inner, "engine_rank", None)

    def plan_for(self, plan: RefitPlan) -> RefitPlan:
        """The FP8 plan of ``plan`` (made once, kept while ``plan`` is the trainer's plan)."""
        if self._plan is None or self._plan[0]() is not plan:
            fp8 = fp8_refit_plan(plan, self.scheme)
            pairs: dict[Slot, tuple[Slot, Slot]] = {}  # a trainer slot -> (its fp8 slot, its scale slot)
            for name, per_rank in plan.slots.items():
                scale = self.scheme.scale_name(name)
                if scale in fp8.slots:
                    for old, new, sc in zip(per_rank, fp8.slots[name], fp8.slots[scale]):
                        pairs.update({o: (n, s) for o, n, s in zip(old, new, sc)})
            self._plan, self._slots = (weakref.ref(plan), fp8), pairs
        return self._plan[1]

    def begin(self, plan: RefitPlan) -> None:
        self.inner.begin(self.plan_for(plan))

    def load_bucket(self, bucket: RefitBucket) -> None:
        self.inner.load_bucket(RefitBucket(bucket.index, [self._quantized(items) for items in bucket.items]))

    def _quantized(self, items: list[tuple[Slot, torch.Tensor]]) -> list[tuple[Slot, torch.Tensor]]:
        """One engine rank's shards with each quantized one replaced by its fp8 shard, and each
        HF tensor's scale shards after its last shard (the plan's order)."""
        out: list[tuple[Slot, torch.Tensor]] = []
        scales: list[tuple[Slot, torch.Tensor]] = []
        for i, (slot, shard) in enumerate(items):
            pair = self._slots.get(slot)
            if pair is None:
                out.append((slot, shard))
                continue
            q, scale_inv = self.scheme.quantize(shard)
            out.append((pair[0], q))
            scales.append((pair[1], scale_inv))
            if i + 1 == len(items) or items[i + 1][0].hf_name != slot.hf_name:
                out += scales
                scales = []
        return out

    def end(self) -> None:
        self.inner.end()

    def __getattr__(self, name: str) -> Any:  # the inner adapter's own attributes (``llm``, ``mode`` ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


__all__ = ["Fp8BlockAdapter", "fp8_refit_plan"]
