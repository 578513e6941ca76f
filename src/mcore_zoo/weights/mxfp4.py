"""MXFP4 checkpoints (gpt-oss as published): the routed experts' stacked tensors stored as FP4
blocks with a shared power-of-two scale per 32 values, dequantized as read, exactly as
transformers' ``integrations/mxfp4.py`` dequantizes them.

A projection ``X`` (``...experts.gate_up_proj``, ``...experts.down_proj``) is stored as
``X_blocks [E, out, G, 16]`` (uint8, two FP4 codes a byte: the low nibble is the even element, the
high nibble the odd one) and ``X_scales [E, out, G]`` (uint8, an E8M0 exponent biased by 127), with
``G = in / 32``. Element ``k`` of block ``g`` is ``FP4_VALUES[code] * 2 ** (scale - 127)``; the
dequantized ``[E, out, in]`` is transposed to transformers' ``X [E, in, out]``. Every such value has
at most two significant bits, so it is exact in fp32 and in bf16 alike (within their exponent
range): dequantizing in fp32 and rounding into the parameter's dtype gives transformers'
dequantization in that dtype, bit for bit.

:func:`quantize_mxfp4` is the inverse on values that are already on the FP4 grid (a checkpoint
written back byte for byte, and the tests' way of building an MXFP4 checkpoint).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..errors import ShapeMismatchError, ZooError
from .io import copy_into
from .rules import TPSlice

#: transformers' FP4 (E2M1) code -> value table
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: values per scale
BLOCK = 32
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``X [E, in, out]`` from ``X_blocks [E, out, G, 16]`` and ``X_scales [E, out, G]``, in
    transformers' op order (lookup of the low and the high nibbles, ``ldexp`` by the unbiased
    exponent, transpose)."""
    blocks = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - 127
    if tuple(blocks.shape[:-1]) != tuple(exponents.shape):
        raise ShapeMismatchError("MXFP4 scales", tuple(blocks.shape[:-1]), tuple(exponents.shape), context="blocks[:-1]")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, width = blocks.shape
    rows = blocks.reshape(-1, width)
    out = torch.empty(rows.shape[0], width * 2, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(rows & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(rows >> 4).to(torch.int)]
    torch.ldexp(out, exponents.reshape(-1, 1), out=out)
    return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()


def quantize_mxfp4(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X_blocks, X_scales)`` of ``X [E, in, out]`` whose every block of 32 values (along ``in``)
    is ``FP4_VALUES * 2 ** k`` for one ``k`` (as an MXFP4 checkpoint's dequantization is): the
    exponent is the smallest that puts the block's largest magnitude within 6 (zero blocks take
    exponent -127). Raises :class:`~mcore_zoo.errors.ZooError` for a value off that grid."""
    rows = tensor.detach().float().transpose(1, 2).contiguous()  # [E, out, in]
    *prefix, width = rows.shape
    if width % BLOCK:
        raise ZooError(f"MXFP4: the input dimension {width} is not a multiple of {BLOCK}")
    groups = rows.reshape(*prefix, width // BLOCK, BLOCK)
    peak = groups.abs().amax(dim=-1)
    exponent = torch.where(peak > 0, torch.ceil(torch.log2(peak / 6.0)), torch.full_like(peak, -127.0))
    exponent = exponent.clamp(-127, 127)
    scaled = torch.ldexp(groups, -exponent.to(torch.int32).unsqueeze(-1))
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)
    if not torch.equal(lut[codes], scaled.abs()):
        raise ZooError("MXFP4: the tensor has values off the FP4 grid of its blocks (not an MXFP4 dequantization)")
    codes = codes + 8 * torch.signbit(scaled).to(torch.int64)
    codes = codes.to(torch.uint8).reshape(*prefix, width // BLOCK, BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    scales = (exponent.to(torch.int32) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def read_mxfp4_config(quantization_config: Any) -> Optional[dict[str, Any]]:
    """The ``quantization_config`` of an MXFP4 checkpoint as data (``None`` for another method)."""
    if not isinstance(quantization_config, dict) or quantization_config.get("quant_method") != "mxfp4":
        return None
    return dict(quantization_config)


class Mxfp4Checkpoint:
    """A dequantizing view of an MXFP4 checkpoint, read like an
    :class:`~mcore_zoo.weights.io.HFCheckpoint` by the weight table's loader: each
    ``X_blocks`` / ``X_scales`` pair is the tensor ``X [E, in, out]`` (fp32). Reading a ``select``
    range of experts reads only those experts' blocks and scales, so an expert-parallel rank reads
    only its own experts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.path = inner.path
        names = inner.keys()
        self.quantized = {n[: -len(BLOCKS_SUFFIX)] for n in names
                          if n.endswith(BLOCKS_SUFFIX) and n[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in names}  # fmt: skip

    def keys(self) -> set[str]:
        hidden = {n + s for n in self.quantized for s in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
        return (self.inner.keys() - hidden) | self.quantized

    def __contains__(self, name: str) -> bool:
        return name in self.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self.inner.shape(name)
        experts, out, groups, width = self.inner.shape(name + BLOCKS_SUFFIX)
        return (experts, groups * width * 2, out)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.quantized else self.inner.dtype(name)

    def entry(self, name: str) -> Any:
        return None if name in self.quantized else self.inner.entry(name)

    def read(self, name: str, *, axis: Optional[int] = None, rank: int = 0, size: int = 1,
             select: Optional[tuple[int, int, int]] = None) -> torch.Tensor:  # fmt: skip
        if name not in self.quantized:
            return self.inner.read(name, axis=axis, rank=rank, size=size, select=select)
        experts = select if select is not None and select[0] == 0 else None  # the experts' range: read only those
        blocks = self.inner.read(name + BLOCKS_SUFFIX, select=experts)
        scales = self.inner.read(name + SCALES_SUFFIX, select=experts)
        full = dequantize_mxfp4(blocks, scales)
        rest = None if experts is not None else select
        index = TPSlice(axis, rank, size, rest).index(tuple(full.shape), f"tensor {name!r}")
        return full if index is None else full[index].clone()

    def read_into(self, name: str, out: torch.Tensor, **kwargs: Any) -> int:
        if name not in self.quantized:
            return self.inner.read_into(name, out, **kwargs)
        tensor = self.read(name, **kwargs)
        copy_into(name, out, tensor)
        return tensor.numel() // 2 + tensor.numel() // BLOCK  # FP4 codes + scales

    def close(self) -> None:
        self.inner.close()


def mxfp4_export(source: Any) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]:
    """The re-quantization of export items into the MXFP4 checkpoint ``source`` (the
    :class:`Mxfp4Checkpoint` view a model was loaded through): each tensor that was stored as
    blocks becomes ``X_blocks`` / ``X_scales`` again (:func:`quantize_mxfp4`), the rest pass as they
    are. Raises before anything is exported for a model not loaded from an MXFP4 checkpoint."""
    if source is None:
        raise ZooError("save_hf_checkpoint(mxfp4=True) writes the MXFP4 format of the checkpoint the model was loaded"
                       " from; this model was not loaded from an MXFP4 checkpoint")  # fmt: skip
    quantized = set(source.quantized)

    def quantize(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            if name not in quantized:
                yield name, tensor
                continue
            try:
                blocks, scales = quantize_mxfp4(tensor)
            except ZooError as exc:
                raise ZooError(f"save_hf_checkpoint(mxfp4=True): {name!r}: {exc}") from exc
            yield name + BLOCKS_SUFFIX, blocks
            yield name + SCALES_SUFFIX, scales

    return quantize


def mxfp4_names(names: set[str], source: Any) -> set[str]:
    """The HF tensor names an MXFP4 export of ``source``'s format writes, from the unquantized ones."""
    if source is None:
        return set(names)
    quantized = set(source.quantized) & names
    return (names - quantized) | {n + s for n in quantized for s in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
