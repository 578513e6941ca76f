"""A THD pack's GEMMs one sequence at a time (the numerics knob ``pack_gemms="each"``).

A GEMM's result for one row can depend on how many rows the GEMM has: the CPU BLAS and cuBLAS pick
their kernel (blocking, vector paths, split of the reduction) by shape. transformers runs a
sequence alone, so each of its GEMMs has that sequence's rows; a THD pack gives every GEMM the rows
of all its sequences. With ``pack_gemms="each"`` the zoo's own linears
(:mod:`mcore_zoo.specs.linears`) and the MoE block (:class:`~mcore_zoo.families.moe.spec.hf_moe_layer_class`)
compute a pack one sequence at a time - the reference's ops on the reference's shapes.

The bounds come from the ``packed_seq_params`` of the decoder layer running on this thread
(:func:`sequence_bounds_layer_class` records them and its row count around its forward);
:func:`sequence_segments` turns them into row ranges for a tensor of the layer's rows, or ``None``
for any other tensor (BSHD, a rank holding part of the pack under sequence or context
parallelism, expert rows in dispatch order). The LM head runs after the layers:
:func:`install_output_layer` gives it the model's pack (a forward pre-hook on the ``GPTModel``)
and the same per-sequence GEMM.

A pack's bounds are read to the host (a device sync on CUDA) once per ``cu_seqlens`` tensor, not
once per layer: :func:`host_bounds` keeps the list it read for that tensor object while the tensor
lives and is not changed in place, and :func:`pack_positions` the per-token positions derived from
it (:mod:`mcore_zoo.specs.thd_rope`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

_LOCAL = threading.local()


#: how many ``cu_seqlens`` tensors :func:`host_bounds` remembers (the oldest is forgotten first)
_HOST_ENTRIES = 64
_HOST: "collections.OrderedDict[int, tuple[Any, int, dict]]" = collections.OrderedDict()
_HOST_LOCK = threading.Lock()


def _forget(key: int, ref: Any) -> None:
    """Drop the entry of a tensor that died (a weakref callback: no lock, only its own entry)."""
    entry = _HOST.get(key)
    if entry is not None and entry[0] is ref:
        _HOST.pop(key, None)


def _derived(tensor: torch.Tensor, what: Any, make: Callable[[torch.Tensor], Any]) -> Any:
    """``make(tensor)``, computed once for this tensor object: kept while the tensor lives and its
    version counter (bumped by every in-place change autograd sees) is unchanged, dropped when it
    dies. Inference tensors, which keep no version counter, are computed every time."""
    try:
        version = tensor._version
    except RuntimeError:  # inference tensors
        return make(tensor)
    key = id(tensor)
    with _HOST_LOCK:
        entry = _HOST.get(key)
        if entry is None or entry[0]() is not tensor or entry[1] != version:
            entry = (weakref.ref(tensor, functools.partial(_forget, key)), version, {})
            _HOST[key] = entry
            while len(_HOST) > _HOST_ENTRIES:
                _HOST.popitem(last=False)
        else:
            _HOST.move_to_end(key)
        values = entry[2]
    if what not in values:
        values[what] = make(tensor)
    return values[what]


def per_pack(cu_seqlens: torch.Tensor, what: Any, make: Callable[[torch.Tensor], Any]) -> Any:
    """``make(cu_seqlens)`` computed once per pack: kept under the key ``what`` for this tensor
    object while it lives and is not changed in place (:func:`_derived`), so every layer of one
    forward shares the value (and the tensor objects in it)."""
    return _derived(cu_seqlens, what, make)


def pack_host_layout(packed_seq_params: Any) -> tuple[list[int], list[int]]:
    """``(bounds, starts)`` of a THD pack on the host: ``cu_seqlens_q`` and ``cu_seqlens_q_padded``
    (``cu_seqlens_q`` again where the pack has no alignment padding), each read once per tensor
    (:func:`host_bounds`). Callers must not modify the lists."""
    bounds = host_bounds(packed_seq_params.cu_seqlens_q)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return bounds, (host_bounds(padded) if padded is not None else bounds)


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens.tolist()``, read once per tensor object (:func:`_derived`): the first call for a
    pack syncs with its device, every later layer reuses the list. Callers must not modify it."""
    return _derived(cu_seqlens, "host", lambda t: t.tolist())


def pack_positions(cu_seqlens: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """Each row's position inside its slot of the pack ``cu_seqlens`` (``[T]`` long on ``device``,
    default the tensor's: ``0 .. n_i - 1`` for slot ``i``), what Megatron-Core's THD RoPE takes for
    row ``j`` of slot ``i`` (``freqs[j]``). Computed once per tensor object and device
    (:func:`_derived`)."""
    device = cu_seqlens.device if device is None else torch.device(device)

    def make(t: torch.Tensor) -> torch.Tensor:
        bounds = host_bounds(t)
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        slots = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.long)
        rows = torch.arange(bounds[-1] - bounds[0], dtype=torch.long) + bounds[0]
        return (rows - torch.repeat_interleave(starts, slots)).to(device)

    return _derived(cu_seqlens, ("positions", device), make)


def pack_pieces(num_rows: int, packed_seq_params: Any) -> Optional[list[tuple[int, int, bool]]]:
    """The row ranges ``[(start, end, is_sequence), ...]`` of a THD pack of ``num_rows`` rows, in
    row order and covering ``[0, num_rows)``: every sequence's own tokens
    (``cu_seqlens_q_padded[i]`` + its length from ``cu_seqlens_q``; ``is_sequence`` True), each run
    of alignment padding after it and any rows after the last sequence (False). ``None`` when there
    is no pack (BSHD) or its bounds do not describe these rows. The bounds are read to the host once
    per pack (:func:`host_bounds`)."""
    if packed_seq_params is None or getattr(packed_seq_params, "cu_seqlens_q", None) is None:
        return None
    ends = host_bounds(packed_seq_params.cu_seqlens_q)
    lengths = [b - a for a, b in zip(ends, ends[1:])]
    starts = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    starts = host_bounds(packed_seq_params.cu_seqlens_q if starts is None else starts)
    if len(starts) != len(lengths) + 1 or starts[-1] > num_rows:
        return None
    pieces, row = [], 0
    for start, length in zip(starts, lengths):
        if start < row or length < 0:
            return None
        pieces += [(row, start, False)] if start > row else []
        pieces += [(start, start + length, True)] if length else []
        row = start + length
    pieces += [(row, num_rows, False)] if num_rows > row else []
    return pieces


def pack_segments(num_rows: int, packed_seq_params: Any) -> Optional[list[tuple[int, int]]]:
    """The row ranges ``[(start, end), ...]`` of a THD pack of ``num_rows`` rows that a model run on
    each sequence alone would see one at a time: :func:`pack_pieces` without the kind of each
    range. ``None`` when there is no pack (BSHD) or its bounds do not describe these rows."""
    pieces = pack_pieces(num_rows, packed_seq_params)
    return None if pieces is None else [(start, end) for start, end, _ in pieces]


def sequence_segments(rows: torch.Tensor) -> Optional[list[tuple[int, int]]]:
    """The row ranges of ``rows`` (``[T, ...]`` or ``[T, 1, ...]``: a THD pack's rows in pack order)
    for the pack of the layer running on this thread; ``None`` where there is none, it has one
    sequence, or ``rows`` are not its rows (another row count; :func:`pack_segments`)."""
    pack = getattr(_LOCAL, "pack", None)
    if pack is None or rows.dim() < 2 or (rows.dim() > 2 and rows.shape[1] != 1):
        return None
    params, num_rows = pack
    if num_rows is not None and rows.shape[0] != num_rows:
        return None
    segments = pack_segments(rows.shape[0], params)
    return segments if segments and len(segments) > 1 else None


@contextlib.contextmanager
def inside_pack(packed_seq_params: Any, num_rows: Optional[int]) -> Iterator[None]:
    """The pack ``packed_seq_params`` of ``num_rows`` rows (``None``: whatever the tensor's) on this
    thread inside the block; ``packed_seq_params=None``: no pack (a module that has split the
    pack itself, whose inner GEMMs then run as they are called)."""
    previous = getattr(_LOCAL, "pack", None)
    _LOCAL.pack = None if packed_seq_params is None else (packed_seq_params, num_rows)
    try:
        yield
    finally:
        _LOCAL.pack = previous


def outside_pack() -> contextlib.AbstractContextManager:
    """No pack on this thread inside the block (:func:`inside_pack` with none)."""
    return inside_pack(None, None)


def linear_each_sequence(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, one call per sequence of the running layer's pack
    (:func:`sequence_segments`), or one call where there is none. Differentiable."""
    segments = sequence_segments(input)
    if segments is None:
        return F.linear(input, weight, bias)
    return torch.cat([F.linear(input[start:end], weight, bias) for start, end in segments], dim=0)


@functools.lru_cache(maxsize=None)
def sequence_bounds_layer_class() -> type:
    """Megatron-Core's ``TransformerLayer`` that keeps its ``packed_seq_params`` on this thread while
    it runs (:func:`sequence_segments` reads them), for ``pack_gemms="each"``. Same math otherwise."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class SequenceBoundsTransformerLayer(TransformerLayer):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            hidden_states = kwargs.get("hidden_states", args[0] if args else None)
            rows = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) else -1
            with inside_pack(kwargs.get("packed_seq_params"), rows):
                return super().forward(*args, **kwargs)

    return SequenceBoundsTransformerLayer


class PerSequenceGEMM:
    """Mixin for a Megatron-Core linear (``ColumnParallelLinear`` / ``RowParallelLinear``): inside a
    layer that keeps its pack (:func:`sequence_segments`) its ``_forward_impl`` without a bias,
    sequence parallelism, gradient-accumulation fusion or an input-gradient all-reduce (tensor
    parallelism) is :func:`linear_each_sequence`; everywhere else Megatron-Core's own."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = not any(kwargs.get(k) for k in ("gradient_accumulation_fusion", "sequence_parallel", "allreduce_dgrad"))
        if plain and kwargs.get("bias") is None and not args and sequence_segments(input) is not None:
            return linear_each_sequence(input, weight)
        return super()._forward_impl(input, weight, *args, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def _per_sequence_class(cls: type) -> type:
    return type(f"PerSequence{cls.__name__}", (PerSequenceGEMM, cls), {"__doc__": PerSequenceGEMM.__doc__})


def gemm_each_sequence(linear: torch.nn.Module) -> None:
    """Give a built Megatron-Core linear the per-sequence GEMM of :class:`PerSequenceGEMM` (its
    class becomes a subclass of its own with the mixin; parameters and everything else unchanged):
    for the linears Megatron-Core builds itself or accepts only as its own class (the LM head, MLA's
    down projections)."""
    if not isinstance(linear, PerSequenceGEMM):
        linear.__class__ = _per_sequence_class(type(linear))


def install_output_layer(model: torch.nn.Module) -> None:
    """Give ``model``'s LM head (a ``GPTModel``'s ``output_layer``, on the last stage) the
    per-sequence GEMM of the decoder layers (:func:`gemm_each_sequence`), with the model's
    ``packed_seq_params`` kept on this thread for the forward (a forward pre-hook; the pack's rows
    are its ``input_ids``' where the stage has them, else whatever the head gets, which are the
    pack's). Nothing without an output layer."""
    head = getattr(model, "output_layer", None)
    if head is None or not hasattr(head, "_forward_impl"):
        return
    gemm_each_sequence(head)
    contexts: list = []

    def enter(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)  # THD: [1, T]
        rows = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 else None
        context = inside_pack(kwargs.get("packed_seq_params"), rows)
        context.__enter__()
        contexts.append(context)

    def leave(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if contexts:
            contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


__all__ = [
    "PerSequenceGEMM",
    "gemm_each_sequence",
    "host_bounds",
    "inside_pack",
    "install_output_layer",
    "linear_each_sequence",
    "outside_pack",
    "pack_pieces",
    "pack_positions",
    "pack_segments",
    "sequence_bounds_layer_class",
    "sequence_segments",
]
