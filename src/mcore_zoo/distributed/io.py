"""Megatron-Core distributed checkpoints (``torch_dist``), written and read tensor by tensor.

A ``torch_dist`` checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory: global tensors
named by their ``ShardedTensor`` keys (decoder layers stacked along a leading layer axis), stored in
chunks anywhere in the global tensor. Loading at any TP / PP / VPP reads the overlapping chunks,
so the layout a checkpoint was written from does not matter. Megatron-Core's own
``dist_checkpointing.save`` needs the whole state in memory at once; this module writes the same
checkpoint from a single process holding one parameter at a time:

1. :func:`sharded_layout` builds the model once, at TP = PP = 1, on the ``meta`` device (no
   memory), asks it for its ``sharded_state_dict`` and records, for every ``ShardedTensor``, which
   parameter (and which view of it) it comes from: key, global shape and offset. The keys are the
   model's own, so they are exactly what a model of any other layout asks for on load.
2. :func:`write_streaming` saves through DCP's ``FileSystemWriter`` with a planner that resolves
   each chunk only when the writer asks for it (serially, in parameter order): the producer
   callback materialises one parameter, its chunks are written, the parameter is dropped.
   ``ShardedObject`` entries (``_extra_state``) are written like Megatron-Core writes them;
   ``common.pt`` and ``metadata.json`` come from Megatron-Core's own helpers.
3. :func:`read_params` reads parameters back in groups (e.g. one decoder layer) through
   ``dist_checkpointing.load``, so a conversion back to HF streams too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..errors import ZooError


@dataclass(frozen=True)
class ShardedChunk:
    """One ``ShardedTensor`` of the single-process model: where its data sits in a parameter and
    where it goes in the checkpoint's global tensor."""

    param: str
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    sizes: tuple[int, ...]  # the chunk in the global tensor (prepended layer axes included)
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, stride, storage offset) in the parameter
    dtype: torch.dtype
    template: Any = dataclasses.field(compare=False, repr=False)  # the ShardedTensor, without data

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This chunk's data (a view) taken from the materialised parameter ``tensor``."""
        return tensor.as_strided(*self.view)

    def request(self, tensor: torch.Tensor) -> Any:
        """The ``ShardedTensor`` that loads this chunk into the parameter ``tensor``."""
        return dataclasses.replace(self.template, data=self.of(tensor), dtype=tensor.dtype)


@dataclass
class ShardedLayout:
    """Every parameter (name -> shape, dtype) and every chunk of the single-process model, plus its
    ``ShardedObject`` entries (DCP key -> serialised bytes) and common (non-sharded) state."""

    params: dict[str, tuple[tuple[int, ...], torch.dtype]]
    chunks: list[ShardedChunk]
    objects: dict[str, io.BytesIO]
    common: dict


def sharded_layout(model: torch.nn.Module) -> ShardedLayout:
    """Read ``model.sharded_state_dict()`` of a single-process (TP = PP = 1) model (see module
    docstring). Raises if an entry is neither a parameter's chunk nor a ``ShardedObject``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    from ..weights.rules import model_tensors  # parameters + checkpoint-state buffers (MoE expert_bias)

    tensors = model_tensors(model)
    names = {id(p): n for n, p in tensors.items()}
    sharded, common = save_preprocess(model.sharded_state_dict(), validate_access_integrity=False)
    apply_factories(sharded)
    chunks: list[ShardedChunk] = []
    objects: dict[str, Any] = {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedObject):
            objects[f"{value.unique_key}#{len(objects)}"] = value
            continue
        if not isinstance(value, ShardedTensor) or value.flattened_range is not None:
            raise ZooError(f"unsupported sharded state entry {getattr(value, 'key', value)!r} ({type(value).__name__})")
        data = value.data
        base = data._base if data._base is not None else data
        if id(base) not in names:
            raise ZooError(f"sharded tensor {value.key!r} is not (a view of) a model parameter")
        sizes = (1,) * value.prepend_axis_num + tuple(value.local_shape)
        chunks.append(
            ShardedChunk(
                names[id(base)], value.key, tuple(value.global_shape), tuple(value.global_offset), sizes,
                (tuple(data.shape), tuple(data.stride()), data.storage_offset()), value.dtype, value.without_data(),
            )  # fmt: skip
        )
    chunks.sort(key=lambda c: list(names.values()).index(c.param))  # parameter order, stable within one
    grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(objects)  # {unique_key: [objects]}
    serialised = mcore_to_pyt_state_dict(dict(grouped))  # {unique_key: BytesIO}, as mcore saves them
    params = {n: (tuple(p.shape), p.dtype) for n, p in tensors.items()}
    return ShardedLayout(params, chunks, serialised, common)


@functools.lru_cache(maxsize=None)
def _streaming_save_planner() -> type:
    """The planner class, created once (a class made per call would sit in a reference cycle
    with whatever its methods close over - parameters included - until the cyclic GC runs)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class StreamingSavePlanner(DefaultSavePlanner):
        """DefaultSavePlanner for the ``ShardedObject`` bytes, plus one lazily produced write item
        per chunk; the most recently produced parameter is kept until its chunks are written."""

        def __init__(self, layout: ShardedLayout, produce: Callable[[str], torch.Tensor]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.layout, self.produce = layout, produce
            self._chunks = {(c.key, c.global_offset): c for c in layout.chunks}
            self._current: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = [
                WriteItem(
                    index=MetadataIndex(c.key, torch.Size(c.global_offset)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(c.global_offset), sizes=torch.Size(c.sizes)),
                        properties=TensorProperties(dtype=c.dtype),
                        size=torch.Size(c.global_shape),
                    ),
                )
                for c in self.layout.chunks
            ]
            self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
            return self.plan

        def transform_object(self, write_item: Any, obj: Any) -> Any:
            return obj  # ShardedObject bytes are serialised already (as Megatron-Core's planner does)

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
            name, tensor = self._current
            if name != chunk.param:
                self._current = (None, None)  # drop the previous parameter first
                tensor = self.produce(chunk.param)
                want = self.layout.params[chunk.param]
                if tuple(tensor.shape) != want[0] or tensor.dtype != want[1]:
                    raise ZooError(f"{chunk.param}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {want[0]} {want[1]}")
                self._current = (chunk.param, tensor)
            return chunk.of(tensor).reshape(chunk.sizes).contiguous()

    return StreamingSavePlanner


def write_streaming(layout: ShardedLayout, produce: Callable[[str], torch.Tensor], directory: str | os.PathLike) -> None:
    """Write a ``torch_dist`` checkpoint into ``directory`` (existing, empty) from one process;
    ``produce(param_name)`` returns each parameter (shape and dtype of ``layout.params``)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0)
    dcp.save(dict(layout.objects), storage_writer=writer, planner=_streaming_save_planner()(layout, produce), no_dist=True)
    torch.save(layout.common, os.path.join(str(directory), COMMON_STATE_FNAME))
    save_config(CheckpointingConfig("torch_dist"), str(directory))


@functools.lru_cache(maxsize=None)
def _region_load_planner() -> type:
    """A DCP load planner filling ``{(key, global offset): (destination, global shape)}`` regions
    (any chunking on disk; the overlaps are read). Created once: see :func:`_streaming_save_planner`."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionLoadPlanner(DefaultLoadPlanner):
        def __init__(self, requests: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]]) -> None:
            super().__init__()
            self.requests = requests

        def create_local_plan(self) -> LoadPlan:
            items = []
            stored = self.metadata.state_dict_metadata
            for (key, offset), (dest, global_shape) in self.requests.items():
                md = stored.get(key)
                if not isinstance(md, TensorStorageMetadata):
                    raise ZooError(f"distributed checkpoint has no tensor {key!r}")
                if tuple(md.size) != tuple(global_shape):
                    raise ZooError(f"distributed checkpoint tensor {key!r} is {tuple(md.size)}, the model expects {tuple(global_shape)}")
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=dest.shape)
                items += create_read_items_for_chunk_list(key, md, [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.requests[(index.fqn, tuple(index.offset))][0]

    return RegionLoadPlanner


#: What a DCP ``.metadata`` pickle may name (written by torch's ``FileSystemWriter``, for the zoo's
#: own checkpoints and Megatron-Core's ``torch_dist`` saves alike): DCP's metadata classes, torch
#: sizes, dtypes and layouts, paths. Nothing else is unpickled unless the user trusts the file.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData", "LoadPlan", "ReadItem",
        "LoadItemType",
    },
    # empty classes Megatron-Core keeps so that older checkpoints' metadata unpickles
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreSavePlan", "MCoreMetadata"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device", "layout", "memory_format"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}  # fmt: skip


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, unpickled with the allow-list
    :data:`DCP_METADATA_GLOBALS` (any ``torch`` dtype too): a file naming anything else - the way
    a crafted pickle runs code - raises :class:`~mcore_zoo.errors.InputError` naming the file and
    the refused global, before anything of it is called."""
    import pickle

    from ..errors import InputError

    class AllowListUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name in DCP_METADATA_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise InputError(f"{path}: refused to unpickle {module}.{name} (not a checkpoint metadata type; pass"
                             " trust_pickle=True / --trust-pickle only for a checkpoint you trust)")  # fmt: skip

    try:
        with open(path, "rb") as stream:
            return AllowListUnpickler(stream).load()
    except InputError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise InputError(f"{path}: damaged or truncated DCP metadata ({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def dcp_metadata_reads(trust_pickle: bool = False) -> Iterator[None]:
    """Within the block, torch's DCP ``FileSystemReader`` - the zoo's and Megatron-Core's
    ``dist_checkpointing.load`` - reads ``.metadata`` through :func:`read_dcp_metadata`; with
    ``trust_pickle``, with torch's own unrestricted ``pickle.load``. (Process-wide for the block:
    the reader is constructed inside Megatron-Core.)"""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    if trust_pickle:
        yield
        return
    original = filesystem.FileSystemReader.read_metadata

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    filesystem.FileSystemReader.read_metadata = read_metadata
    try:
        yield
    finally:
        filesystem.FileSystemReader.read_metadata = original


def read_params(
    layout: ShardedLayout,
    groups: Iterable[Sequence[str]],
    directory: str | os.PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    trust_pickle: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """For each group of parameter names, read those parameters from a ``torch_dist`` checkpoint
    (only that group in memory; any chunking on disk) and yield ``{name: tensor}``. The DCP
    metadata is read without running pickled code unless ``trust_pickle`` (:func:`dcp_metadata_reads`)."""
    import torch.distributed.checkpoint as dcp

    by_param: dict[str, list[ShardedChunk]] = {}
    for c in layout.chunks:
        by_param.setdefault(c.param, []).append(c)
    for group in groups:
        tensors = {}
        requests = {}
        for name in group:
            shape, param_dtype = layout.params[name]
            tensors[name] = torch.empty(shape, dtype=dtype or param_dtype)
            for c in by_param.get(name, []):
                requests[(c.key, c.global_offset)] = (c.of(tensors[name]).view(c.sizes), c.global_shape)
        with dcp_metadata_reads(trust_pickle):
            dcp.load({}, storage_reader=dcp.FileSystemReader(str(directory)), planner=_region_load_planner()(requests), no_dist=True)
        yield tensors


__all__ = ["ShardedChunk", "ShardedLayout", "sharded_layout", "write_streaming", "read_params", "read_dcp_metadata",
           "dcp_metadata_reads"]
