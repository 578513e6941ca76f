"""FP8 block-quantized checkpoints (``quant_method: fp8``, DeepSeek-V3 style): the format, its
dequantization on load and its quantization on export. Pure torch, no collectives.

Format
    A quantized linear ``X`` is stored as ``X.weight`` (``F8_E4M3``, shape ``[..., M, N]``) and
    ``X.weight_scale_inv`` (``F32``, shape ``[..., ceil(M/bm), ceil(N/bn)]``) for a block of
    ``weight_block_size = [bm, bn]`` (``[128, 128]`` in every published checkpoint). Element
    ``(i, j)`` belongs to block ``(i // bm, j // bn)``; the blocks on the bottom and right edges
    are partial when ``bm`` or ``bn`` does not divide the shape (DeepSeek-V3's
    ``kv_a_proj_with_mqa`` is ``[576, 7168]`` with a ``[5, 56]`` grid).

Dequantization (:func:`dequantize_block`)
    ``w = (float32(q) * s).to(dtype)``: the fp8 value is widened exactly to fp32, multiplied by
    its block's fp32 ``scale_inv`` in fp32 (one rounding), then cast once to the training dtype
    (a second rounding unless ``dtype`` is fp32). This is the op order of transformers
    (``transformers/integrations/finegrained_fp8.py``, ``Fp8Dequantize._dequantize_one``, used
    when an FP8 checkpoint is loaded on CPU or with ``dequantize=True``) and of DeepSeek-V3's
    ``inference/kernel.py`` ``weight_dequant`` (fp32 product stored into the default dtype). The
    result is bitwise equal to both. transformers derives the block size from the grid
    (``rows // scale_rows``) and so rejects or mis-blocks partial edge blocks; here the block size
    is explicit and partial edge blocks follow DeepSeek's indexing (``i // bm``). The bf16
    multiply of transformers' backward helper ``_dequantize_fp8_weight`` (``bf16(q) * bf16(s)``)
    is a different op order and is not used.

Reference quantization (:func:`quantize_block`)
    transformers' ``Fp8Quantize._quantize_one``, op for op, on fp32 values::

        amax = max |w| over the block                 (0 for an all-zero block)
        scale = 448.0 / amax                          (torch: reciprocal(amax) * 448, two roundings)
        scale = 1 where amax == 0                     (zero blocks: scale_inv 1)
        scale_inv = 1.0 / scale                       (fp32, one rounding)
        q = clamp(w * scale, -448, 448).to(float8_e4m3fn)   (round to nearest even)

    extended to partial edge blocks (transformers passes a tensor whose shape the block does not
    divide through unquantized; here the edge block's amax is taken over its own elements).

Round trip (:func:`requantize_block`), measured facts
    * The reference quantizer is not idempotent on its own scales. Re-quantizing the fp32
      dequantization of a block whose largest fp8 magnitude is 448 (every non-zero block it
      writes) recomputes ``amax = fl(448 * s)`` and from it a new scale that differs from ``s`` by
      1 or 2 ulp for 11.8% of all amax values of a binade (22.7% of all forward scales, 38.2% of
      all fp32 scales). The fp8 bytes never change.
    * No formula of ``amax`` alone can do better: ``s -> fl(448 * s)`` is not injective (in the
      upper part of each binade, 7*s steps by 7 ulp onto a grid of 8), so some distinct scales
      give bit-identical dequantized blocks.
    * :func:`requantize_block` (the export quantizer) therefore uses the whole block: it runs the
      reference quantizer, then searches the ``scale_inv`` within ``SCALE_WINDOW`` (8) ulp of the
      reference one for a scale under which the reference fp8 values dequantize (in the weight's
      own dtype) bit for bit to the given weights; the reference scale is preferred, then the
      nearest (the smaller on a tie). Blocks the window does not settle get a second search (the
      middle of the scale interval all elements allow, verified the same way). Blocks that no
      scale reproduces keep the reference result, so on weights that are not exact
      dequantizations it equals :func:`quantize_block` (trained 128x128 blocks in practice; a
      block of one or a few elements may be reproducible and then gets such a scale).

    Guarantees for a checkpoint written by the reference quantizer (or with DeepSeek's
    ``scale_inv = amax / 448``), for scales ``2^-117 <= s <= 2^119`` (every product ``q * s`` a
    normal fp32 number; fp32 rounding is invariant under powers of two in that range, so one
    binade measured exhaustively covers all of them; ``bench/fp8_roundtrip.py``):

    * fp32 training dtype: ``requantize_block(dequantize_block(q, s, float32))`` returns the fp8
      bytes exactly, always; the recomputed reference scale is within 2 ulp of ``s``, so ``s``
      is among the candidates, and the export dequantizes bit for bit to what was loaded. It
      returns ``s`` itself whenever the block's values determine it - provably whenever the block
      holds a power-of-two fp8 magnitude (``fl(2^k * s)`` is exact, so one scale fits); measured:
      all 2^23 scales of a binade for a block holding the 254 finite e4m3 values, and every block
      of random weights quantized with blocks of 128x128, 16x16 and 4x4 (1x8: all but 1 of 65,536;
      1x1: 95.3%). A block whose dequantization is the same under several scales (e.g. only +-448
      and zeros: 89.3% of the scales of a binade come back) cannot be told apart from another
      checkpoint; the export still dequantizes to the same values.
    * bf16 (and fp16) training dtype: the fp8 bytes come back exactly (the relative error of the
      scaled values stays near 2^-8, while the nearest e4m3 rounding boundary is at least 2^-5
      away), and the export dequantizes bit for bit to what was loaded whenever a second search,
      over the intersection of the scale intervals each element allows, finds a scale that
      reproduces the block (measured: every random block, 128x128 down to 1x1). The scale bytes cannot come back: e4m3 values carry 8 mantissa patterns, so a bf16
      128x128 block is consistent with 2,185 to 58,254 consecutive fp32 scales (median 14,043;
      fp16: 252 to 4,096, median 993) and nothing in it singles out the original (measured: 1 of
      2,048 random 128x128 blocks got its scale back). Passing the checkpoint's own ``scale_inv`` (``requantize_block(w, scale_inv=s)``) returns ``(q, s)``
      exactly in bf16 too.
    * Zero blocks always get ``scale_inv = 1`` (the reference convention); a checkpoint storing
      another scale for an all-zero block is reproduced only with ``scale_inv=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import (
    CheckpointFormatError,
    ShapeMismatchError,
    ZooError,
)
from ..config.quantization import FMT_DTYPES as _FMT_DTYPES
from ..config.quantization import Fp8BlockFormat
from .io import copy_into
from .rules import TPSlice

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_WINDOW = 8  # ulp searched around the reference scale_inv by requantize_block
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ---------------------------------------------------------------------------- the format


def scale_grid(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (leading dims kept)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


# ---------------------------------------------------------------------------- blocked views


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(n, int) and n > 0 for n in block):
        raise ZooError(f"block must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[..., M, N]`` -> ``[L, Rb, bm, Cb, bn]`` (a view when the block divides, else a
    zero-padded copy)."""
    *_, rows, cols = x.shape
    bm, bn = block
    rb, cb = -(-rows // bm), -(-cols // bn)
    x = x.reshape(-1, rows, cols)
    if rows % bm or cols % bn:
        x = torch.nn.functional.pad(x, (0, cb * bn - cols, 0, rb * bm - rows))
    return x.reshape(x.shape[0], rb, bm, cb, bn)


def _from_blocks(xb: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    *_, rows, cols = shape
    L, rb, bm, cb, bn = xb.shape
    return xb.reshape(L, rb * bm, cb * bn)[:, :rows, :cols].reshape(shape).contiguous()


def _check_pair(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], what: str = "weight"
) -> None:
    if weight.dim() < 2:
        raise ShapeMismatchError(
            what,
            ("...", "M", "N"),
            tuple(weight.shape),
            context="an FP8 block-quantized weight is at least 2-D",
        )
    expected = scale_grid(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ShapeMismatchError(
            f"{what} scale_inv",
            expected,
            tuple(scale_inv.shape),
            context=f"block {list(block)} grid of a {list(weight.shape)} weight",
        )
    if scale_inv.dtype != torch.float32:
        raise ZooError(f"{what}: scale_inv must be float32, got {scale_inv.dtype}")


# ---------------------------------------------------------------------------- dequantization


def dequantize_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: Sequence[int] = (128, 128),
) -> torch.Tensor:
    """``(float32(weight) * scale_inv[i // bm, j // bn]).to(dtype)``: the reference dequantization.

    ``weight``: ``[..., M, N]`` float8 (e4m3fn or e5m2); ``scale_inv``: ``[..., ceil(M/bm),
    ceil(N/bn)]`` float32. Raises :class:`ShapeMismatchError` for any other grid shape."""
    block = _check_block(block)
    if weight.dtype not in _FP8_DTYPES:
        raise ZooError(f"dequantize_block expects a float8 weight, got {weight.dtype}")
    _check_pair(weight, scale_inv, block)
    shape = weight.shape
    *_, rows, cols = shape
    bm, bn = block
    out = weight.to(torch.float32).reshape(-1, rows, cols)
    s = scale_inv.reshape(out.shape[0], *scale_inv.shape[-2:])
    rows_scale = s.repeat_interleave(bm, dim=1)[:, :rows]  # [L, M, Cb]: scales expanded over rows only
    full, rem = divmod(cols, bn)
    if full:
        out[..., : full * bn].unflatten(-1, (full, bn)).mul_(rows_scale[..., :full, None])
    if rem:
        out[..., full * bn :].mul_(rows_scale[..., full:])
    return out.reshape(shape).to(dtype)


# ---------------------------------------------------------------------------- quantization


def _fmt_dtype(fmt: str) -> torch.dtype:
    try:
        return _FMT_DTYPES[fmt]
    except KeyError:
        raise ZooError(
            f"FP8 format {fmt!r} is not supported for quantization (supported: {sorted(_FMT_DTYPES)})"
        ) from None


def _reference(wb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference quantization of fp32 blocks ``[L, Rb, bm, Cb, bn]``: (q fp8, scale_inv, amax)."""
    max_abs = wb.abs().amax(dim=(-3, -1))  # [L, Rb, Cb]
    if not torch.isfinite(max_abs).all():
        bad = (~torch.isfinite(max_abs)).nonzero()[0].tolist()
        raise ZooError(f"cannot quantize a block holding inf or NaN (block index {bad})")
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_E4M3_MAX / safe_max_abs  # written as in transformers: torch evaluates reciprocal(x) * 448
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv_scales = (1.0 / scales).to(torch.float32)
    q = _round(wb, scales)
    return q, inv_scales, max_abs


def _round(wb: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    scaled = wb * scales[..., :, None, :, None]
    return torch.clamp(scaled, min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_block(
    weight: torch.Tensor, block: Sequence[int] = (128, 128), fmt: str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference FP8 block quantizer (transformers' ``Fp8Quantize``, bitwise; partial edge
    blocks included): returns ``(weight_fp8 [..., M, N], scale_inv [..., ceil(M/bm), ceil(N/bn)] fp32)``.

    Raises for blocks holding inf or NaN."""
    block = _check_block(block)
    _fmt_dtype(fmt)
    if weight.dim() < 2:
        raise ShapeMismatchError(
            "weight", ("...", "M", "N"), tuple(weight.shape), context="FP8 block quantization needs 2-D"
        )
    wb = _to_blocks(weight.detach().to(torch.float32), block)
    q, inv, _ = _reference(wb)
    return _from_blocks(q, weight.shape), inv.reshape(scale_grid(weight.shape, block))


def _nudge(x: torch.Tensor, ulps: int) -> torch.Tensor:
    """``x`` (positive finite fp32) moved by ``ulps`` units in the last place."""
    return (x.view(torch.int32) + ulps).view(torch.float32)


def _interval_stage(
    idx: torch.Tensor,
    qf: torch.Tensor,
    target: torch.Tensor,
    native: torch.Tensor,
    int_dtype: torch.dtype,
    dtype: torch.dtype,
    flat_inv: torch.Tensor,
    found: torch.Tensor,
) -> None:
    """Second search, for blocks the window did not settle (a bf16 or fp16 dequantization moves
    the reference scale by up to ~2^-8, far beyond the window): every element ``w = dtype(q * c)``
    confines ``c`` to ``[lo / |q|, hi / |q|]``, ``[lo, hi]`` being the values that round to ``|w|``
    in ``dtype``; the block's intersection of those intervals holds the scale the block was
    dequantized with. Its midpoint (rounded to fp32, then +-1, +-2 ulp) is verified bit for bit
    like every window candidate; blocks with an empty intersection (trained weights) are left."""
    bsize = qf.shape[1]
    for start in range(0, idx.numel(), max(1, (1 << 22) // bsize)):  # bounded float64 temporaries
        part = idx[start : start + max(1, (1 << 22) // bsize)]
        qa = qf[part].abs().double()
        wbits = target[part]
        wabs = native.permute(0, 1, 3, 2, 4).reshape(-1, bsize)[part].abs()
        abits = wabs.view(int_dtype)
        v = wabs.double()
        prev = (abits - 1).clamp(min=0).view(dtype).double()
        nxt = (abits + 1).view(dtype).double()
        lo, hi = (v + prev) / 2, (v + nxt) / 2
        nonzero = qa > 0
        inf = torch.full_like(v, float("inf"))
        low = torch.where(nonzero, lo / qa.clamp(min=1e-30), -inf).amax(dim=1)
        high = torch.where(nonzero, hi / qa.clamp(min=1e-30), inf).amin(dim=1)
        possible = (low <= high) & torch.isfinite(low) & torch.isfinite(high) & (low > 0)
        possible &= ~((qa == 0) & (v != 0)).any(dim=1)
        if not possible.any():
            continue
        mid = ((low + high) / 2).to(torch.float32)
        undecided = possible.clone()
        for k in (0, -1, 1, -2, 2):
            if not undecided.any():
                break
            rows = undecided.nonzero().flatten()
            cand = _nudge(mid[rows], k) if k else mid[rows]
            back = (qf[part[rows]] * cand[:, None]).to(dtype).view(int_dtype)
            ok = (back == wbits[rows]).all(dim=1)
            hit = rows[ok]
            flat_inv[part[hit]] = cand[ok]
            found[part[hit]] = True
            undecided[hit] = False


def requantize_block(
    weight: torch.Tensor,
    block: Sequence[int] = (128, 128),
    fmt: str = "e4m3",
    *,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The export quantizer: :func:`quantize_block`, except that each block which is an exact
    dequantization (in ``weight.dtype``) of the reference fp8 values under some ``scale_inv`` gets
    such a scale: within :data:`SCALE_WINDOW` ulp of the reference one (the reference scale first,
    then the nearest, the smaller on a tie), else the middle of the interval the elements allow. So ``dequantize_block(*requantize_block(w), w.dtype) == w``
    for such blocks, and a reference-quantized checkpoint loaded in fp32 comes back byte for byte
    (see the module docstring for the exact statement).

    ``scale_inv``: use these scales as given (the source checkpoint's): ``q = clamp(w *
    (1 / scale_inv)).to(e4m3)``; values beyond ``448 * scale_inv`` saturate.
    """
    block = _check_block(block)
    _fmt_dtype(fmt)
    if weight.dim() < 2:
        raise ShapeMismatchError(
            "weight", ("...", "M", "N"), tuple(weight.shape), context="FP8 block quantization needs 2-D"
        )
    grid = scale_grid(weight.shape, block)
    wb = _to_blocks(weight.detach().to(torch.float32), block)
    if scale_inv is not None:
        _check_pair(weight, scale_inv, block)
        inv = scale_inv.reshape(wb.shape[0], wb.shape[1], wb.shape[3])
        return _from_blocks(_round(wb, 1.0 / inv), weight.shape), scale_inv.clone()
    q, inv, max_abs = _reference(wb)
    inv = inv.clone()
    dtype = weight.dtype
    native = _to_blocks(weight.detach(), block) if dtype != torch.float32 else wb
    # Bits of the weights in their own dtype, block-major: [nblocks, bm * bn].
    int_dtype = {4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}[native.element_size()]
    target = native.permute(0, 1, 3, 2, 4).reshape(-1, block[0] * block[1]).view(int_dtype)
    qf = q.to(torch.float32).permute(0, 1, 3, 2, 4).reshape(-1, block[0] * block[1])
    flat_inv, flat_amax = inv.reshape(-1), max_abs.reshape(-1)
    amax_q = qf.abs().amax(dim=1)  # the fp8 magnitude of each block's largest element
    live = (flat_amax > 0) & (flat_inv > 0) & torch.isfinite(flat_inv)
    undecided = live.clone()
    found = torch.zeros_like(live)
    reference_inv = flat_inv.clone()
    offsets = [0] + [k for d in range(1, SCALE_WINDOW + 1) for k in (-d, d)]
    for k in offsets:
        if not undecided.any():
            break
        cand = _nudge(reference_inv, k) if k else reference_inv
        # cheap filter on the block's largest element, then the whole block bit for bit
        maybe = undecided & ((amax_q * cand).to(dtype).to(torch.float32) == flat_amax)
        idx = maybe.nonzero().flatten()
        if idx.numel() == 0:
            continue
        back = (qf[idx] * cand[idx, None]).to(dtype).view(int_dtype)
        ok = (back == target[idx]).all(dim=1)
        hit = idx[ok]
        flat_inv[hit] = cand[hit]
        found[hit] = True
        undecided[hit] = False
    if undecided.any():
        _interval_stage(undecided.nonzero().flatten(), qf, target, native, int_dtype, dtype, flat_inv, found)
    # q is recomputed for blocks whose scale moved: the same values (asserted), kept explicit.
    moved = found & (flat_inv != reference_inv)
    if moved.any():
        idx = moved.nonzero().flatten()
        wflat = wb.permute(0, 1, 3, 2, 4).reshape(-1, block[0] * block[1])[idx]
        again = torch.clamp(wflat * (1.0 / flat_inv[idx, None]), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(
            torch.float8_e4m3fn
        )
        if not torch.equal(again.view(torch.uint8), qf[idx].to(torch.float8_e4m3fn).view(torch.uint8)):
            raise ZooError("FP8 requantization: a recovered scale changed the fp8 values (please report)")
    return _from_blocks(q, weight.shape), flat_inv.reshape(grid)


# ---------------------------------------------------------------------------- checkpoint tensors


@dataclass
class Fp8TensorPlan:
    """Which tensors of an FP8 checkpoint are quantized.

    ``quantized``: ``X.weight`` -> ``X.weight_scale_inv`` for every F8 weight (load: dequantize the
    pair into the parameter's dtype; export: quantize those tensors back). ``not_converted``: the
    tensors of modules in ``modules_to_not_convert`` (must stay unquantized on export). ``plain``:
    every other tensor (norms, biases, embeddings, gates ...), stored unquantized.
    """

    quantized: dict[str, str] = field(default_factory=dict)
    not_converted: list[str] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)

    def scale_of(self, name: str) -> str | None:
        return self.quantized.get(name)


def plan_fp8_tensors(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    fmt: Fp8BlockFormat,
    *,
    source: str = "checkpoint",
) -> Fp8TensorPlan:
    """Pair every F8 ``X.weight`` with its ``X.weight_scale_inv`` (name -> ``(dtype, shape)``, e.g.
    ``{k: (ckpt.dtype(k), ckpt.shape(k)) for k in ckpt.keys()}`` of an :class:`HFCheckpoint`).

    Fails closed, naming the tensor: an F8 weight without its scale, a scale without an F8 weight,
    a scale that is not F32 or whose grid is not ``ceil(shape / block)``, an F8 tensor in
    ``modules_to_not_convert`` or one that is not a ``.weight``, an fp8 format other than ``fmt``'s."""
    plan = Fp8TensorPlan()
    scales = {n for n in tensors if n.endswith(".weight" + SCALE_SUFFIX)}
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        if name in scales:
            continue
        module = name.rsplit(".", 1)[0]
        if dtype in _FP8_DTYPES:
            where = f"{source}: tensor {name!r}"
            if dtype != fmt.dtype:
                raise CheckpointFormatError(
                    source, f"tensor {name!r} is {dtype}, the config says fmt {fmt.fmt!r}"
                )
            if not name.endswith(".weight"):
                raise CheckpointFormatError(source, f"tensor {name!r} is FP8 but not a .weight")
            if fmt.is_skipped(module):
                raise CheckpointFormatError(
                    source, f"tensor {name!r} is FP8 but its module is in modules_to_not_convert"
                )
            scale = name + SCALE_SUFFIX
            if scale not in tensors:
                raise CheckpointFormatError(source, f"tensor {name!r} is FP8 but {scale!r} is missing")
            s_dtype, s_shape = tensors[scale]
            if s_dtype != torch.float32:
                raise CheckpointFormatError(
                    source, f"tensor {scale!r} is {s_dtype}, expected float32 (scale_fmt 'float')"
                )
            expected = scale_grid(tuple(shape), fmt.block)
            if len(shape) < 2 or tuple(s_shape) != expected:
                raise ShapeMismatchError(
                    scale,
                    expected,
                    tuple(s_shape),
                    context=f"{where}: block {list(fmt.block)} grid of {list(shape)}",
                )
            plan.quantized[name] = scale
        elif name.endswith(".weight") and fmt.is_skipped(module):
            plan.not_converted.append(name)
        else:
            plan.plain.append(name)
    orphans = sorted(scales - set(plan.quantized.values()))
    if orphans:
        raise CheckpointFormatError(source, f"scale tensor(s) without an FP8 weight: {orphans}")
    return plan


# ---------------------------------------------------------------------------- loading and export


class Fp8Checkpoint:
    """A dequantizing view of an FP8 block-quantized checkpoint, read like an
    :class:`~mcore_zoo.weights.io.HFCheckpoint` by the weight table's loader.

    ``keys()`` hides the ``X.weight_scale_inv`` tensors (each is consumed by its ``X.weight``);
    reading a quantized ``X.weight`` (whole, a ``select`` range or a TP chunk) returns
    ``float32(q) * scale_inv`` of the whole tensor (:func:`dequantize_block`'s fp32 product), then the
    requested part: copied into a parameter of any dtype it is rounded once, which is
    ``dequantize_block(q, s, param.dtype)`` bit for bit. ``scales`` holds every weight's
    ``weight_scale_inv`` (read once, for byte-exact export with ``fp8_scales="source"`` on any rank).
    """

    def __init__(self, inner: Any, fmt: Fp8BlockFormat) -> None:
        self.inner = inner
        self.fmt = fmt
        self.path = inner.path
        self.plan = plan_fp8_tensors({k: (inner.dtype(k), inner.shape(k)) for k in inner.keys()}, fmt,
                                     source=str(inner.path))  # fmt: skip
        self._scale_names = set(self.plan.quantized.values())
        # every weight's scales (1/16384 of its elements), also those of tensors other ranks load:
        # the export's writer rank needs them all for fp8_scales="source"
        self.scales: dict[str, torch.Tensor] = {w: inner.read(s) for w, s in self.plan.quantized.items()}

    def keys(self) -> set[str]:
        return self.inner.keys() - self._scale_names

    def __contains__(self, name: str) -> bool:
        return name in self.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.plan.quantized else self.inner.dtype(name)

    def entry(self, name: str) -> Any:
        return None if name in self.plan.quantized else self.inner.entry(name)

    def read(self, name: str, *, axis: Optional[int] = None, rank: int = 0, size: int = 1,
             select: Optional[tuple[int, int, int]] = None) -> torch.Tensor:  # fmt: skip
        if name not in self.plan.quantized:
            return self.inner.read(name, axis=axis, rank=rank, size=size, select=select)
        scale = self.scales[name]
        full = dequantize_block(self.inner.read(name), scale, torch.float32, self.fmt.block)
        index = TPSlice(axis, rank, size, select).index(tuple(full.shape), f"tensor {name!r}")
        return full if index is None else full[index].clone()

    def read_into(self, name: str, out: torch.Tensor, **kwargs: Any) -> int:
        if name not in self.plan.quantized:
            return self.inner.read_into(name, out, **kwargs)
        tensor = self.read(name, **kwargs)
        copy_into(name, out, tensor)
        return tensor.numel() + self.scales[name].numel() * 4  # fp8 bytes + fp32 scales

    def queued_reads(self) -> Any:
        """The inner checkpoint's (:meth:`~mcore_zoo.weights.io.HFCheckpoint.queued_reads`): the
        tensors that are not quantized are read into their destinations as they are."""
        return self.inner.queued_reads()

    def finish_reads(self) -> None:
        self.inner.finish_reads()

    def close(self) -> None:
        self.inner.close()


def fp8_export(source: Any, fp8_scales: str = "fresh") -> Callable[[Any], Any]:
    """The quantization of export items into the FP8 block format of ``source`` (the
    :class:`Fp8Checkpoint` view a model was loaded through: which tensors were quantized, their
    block format and scales): :func:`quantize_for_export` with fresh scales (``"fresh"``) or the
    loaded ones (``"source"``). Raises before anything is exported for another ``fp8_scales``, or
    for a model that was not loaded from an FP8 block-quantized checkpoint (``source`` ``None``)."""
    if fp8_scales not in ("fresh", "source"):
        raise ValueError(f"fp8_scales={fp8_scales!r}; use 'fresh' or 'source'")
    if source is None:
        raise ZooError("save_hf_checkpoint(fp8=True) writes the FP8 format of the checkpoint the model was loaded"
                       " from; this model was not loaded from an FP8 block-quantized checkpoint")  # fmt: skip
    scales = source.scales if fp8_scales == "source" else None
    return lambda items: quantize_for_export(items, source.plan.quantized, source.fmt, scales=scales)


def fp8_scale_names(source: Any) -> set[str]:
    """The ``X.weight_scale_inv`` tensors an FP8 export of ``source``'s format writes."""
    return set(source.plan.quantized.values())


def quantize_for_export(items: Any, quantized: Mapping[str, str], fmt: Fp8BlockFormat, *,
                        scales: Optional[Mapping[str, torch.Tensor]] = None) -> Any:  # fmt: skip
    """``(hf_name, tensor)`` items -> the FP8 block format: each name in ``quantized`` (``X.weight``
    -> ``X.weight_scale_inv``) becomes its e4m3 tensor and fp32 scales (:func:`requantize_block`;
    with ``scales``, the given source scales), every other tensor passes unchanged."""
    for name, tensor in items:
        scale_name = quantized.get(name)
        if scale_name is None:
            yield name, tensor
            continue
        given = None if scales is None else scales.get(name)
        if scales is not None and given is None:
            raise ZooError(f"FP8 export with the source scales: no weight_scale_inv kept for {name!r}")
        q, inv = requantize_block(tensor, fmt.block, fmt.fmt, scale_inv=given)
        yield name, q
        yield scale_name, inv
