"""Refit into an in-process ``vllm.LLM``: the adapter (trainer side) and the worker extension
(engine side).

Start the engine with the zoo's worker extension, then refit through the adapter::

    llm = vllm.LLM(model=hf_dir, tensor_parallel_size=2,
                   worker_extension_cls="mcore_zoo.rollout.vllm.ZooWorkerExtension")
    adapter = VLLMAdapter(llm)
    mcore_zoo.refit(model, adapter)

Two modes:

* ``"direct"`` (default): the plan's shards, already fused and split the way vLLM holds them
  (``qkv_proj``, ``gate_up_proj``, ``experts.routed_experts.w13_weight`` / ``w2_weight``, the
  vocabulary padded to 64 rows), are copied into the engine's parameters by name, in place - no
  vLLM weight loader runs. ``begin`` sends the engine the plan's manifest once; every worker checks
  that each named parameter exists with the planned shape and dtype before the first byte moves,
  and ``end`` checks that every element of every planned parameter was written.
* ``"load_weights"``: whole tensors under HF names go through the model's own ``load_weights``
  (vLLM fuses and splits): slower, but it follows whatever the engine's loaders do.

The worker binds the plan once (on the manifest): for every slot, bucket by bucket, the region of
its parameter it fills (``param.data[expert].narrow(0, offset, rows)``, kept as a view recipe, not
a view), the padding rows to zero and whether the shard must be cast to the planned dtype first (an
engine parameter in another dtype: ``copy_`` converts, as vLLM's default loader does, after the
cast the export would have made). A bucket then carries only the shards, in plan order; the worker
copies each into its region. Later refits with the same plan check the binding against the
engine's parameters (the same parameter objects with the same dtype, shape and stride - a few
lookups per parameter; their storage may have moved) and re-bind if the engine replaced any.
Between refits the worker holds no engine tensor (parameters weakly, regions as recipes).

In direct mode the adapter takes ``raw_shards`` (:class:`~mcore_zoo.rollout.adapter.EngineAdapter`):
from a trainer whose export needs no collective (TP / PP / EP 1) each shard is a view of the
trainer's parameter in the parameter's dtype, possibly in a refined shape (mcore's interleaved
q / k / v rows as ``[groups, rows, hidden]``): the worker copies it into its region viewed in that
shape - one copy per shard from the trainer's parameter into the engine's, no intermediate.

Derived weights: vLLM's MLA attention keeps ``W_UK_T`` / ``W_UV``, computed from ``kv_b_proj``
after loading. ``zoo_refit_end`` recomputes them in both modes, as vLLM's loader does
(``MLAAttention.process_weights_after_loading``, into the existing tensors).

Transport: when the engine's workers run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
with one worker: ``UniProcExecutor``, or ``ExecutorWithExternalLauncher``), ``collective_rpc``
hands the shards over as they are (one device-to-device copy into each parameter; on CUDA with
Triton the worker writes all of a bucket's byte copies with one launch, :mod:`mcore_zoo.kernels.copy_runs`,
its table built on the first refit and kept while the tensors stay where they were). Otherwise each
bucket is packed into one flat buffer per engine rank (in the planned dtype) and sent as a CUDA IPC
handle (``torch.multiprocessing.reductions.reduce_tensor``); the worker opens it and copies from it.

The worker-extension methods are what ``collective_rpc`` calls by name:
``zoo_refit_begin(plan_id, manifests, mode, counts, fused)``, ``update_weights_from_buckets(index,
payloads)``, ``zoo_refit_end()``. This module imports vLLM only inside the worker methods.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from ..errors import ZooError
from .adapter import EngineAdapter, RefitBucket
from .engine_format import HF_NAMES, VLLM, VLLM_EP, VLLM_EP_ROUND_ROBIN, EngineFormat

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RefitPlan

EXTENSION = "mcore_zoo.rollout.vllm.ZooWorkerExtension"

_ALIGN = 256  # bytes between tensors packed into one buffer

#: vLLM unquantized MoE backends whose runtime expert layout is the loader's (w13 = [w1; w3])
_LOADER_LAYOUT_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON", "CPU")


class VLLMAdapter(EngineAdapter):
    """A running ``vllm.LLM`` started with ``worker_extension_cls=`` :data:`EXTENSION`.

    Args:
        llm: the engine.
        mode: ``"direct"`` or ``"load_weights"`` (module docstring).
        transport: ``"auto"`` (objects in-process, CUDA IPC otherwise), ``"inproc"`` or ``"ipc"``.
        tp_size: the engine's tensor-parallel size (default: read from the engine's config).
        reset_prefix_cache: after a refit, drop vLLM's cached KV blocks (computed with the old
            weights) through ``llm.reset_prefix_cache()`` - skipped for an engine started with
            ``enable_prefix_caching=False``, which caches none. vLLM walks every KV-cache block
            in Python for it: 0.9-1.8 ms for 23,601 blocks, 2.6-3.3 ms for 55,603 (H200, vLLM 0.26); ``end``
            runs it while the GPU finishes the copies.
        fused_copies: in direct mode with the worker in this process, write each bucket's shards
            with one kernel launch instead of a ``copy_`` each where they are plain byte copies
            (:mod:`mcore_zoo.kernels.copy_runs`: CUDA with Triton; elsewhere, or for a cast, a
            reshape or padding rows, ``copy_``). The kernel's table is built on the first refit
            and kept while the trainer's and the engine's tensors stay where they were.
        engine_format: the engine's fusion map in direct mode (default :data:`VLLM`, or for an
            engine started with ``enable_expert_parallel=True`` :data:`VLLM_EP` /
            :data:`VLLM_EP_ROUND_ROBIN` after its ``expert_placement_strategy``: each engine rank's
            experts whole; refused with EPLB or data-parallel ranks, whose experts move or spread
            beyond the TP group - ``mode="load_weights"`` takes those); a plugin whose vLLM model
            class fuses or replicates tensors otherwise passes its own
            :class:`~mcore_zoo.rollout.engine_format.EngineFormat`.
        engine_rank: the one engine TP rank this adapter feeds (``refit(..., receiver="all")``
            with one engine rank per trainer rank: a trainer of the same TP then sends that rank's
            shards only, from its own TP chunks). ``"auto"``: the worker's TP rank when the engine
            runs vLLM's ``external_launcher`` executor (one worker in this process), else ``None``
            (every rank's shards arrive; each worker takes its own).
    """

    def __init__(self, llm: Any, *, mode: str = "direct", transport: str = "auto", tp_size: Optional[int] = None,
                 reset_prefix_cache: bool = True, engine_rank: Union[int, str, None] = "auto",
                 engine_format: Optional[EngineFormat] = None, fused_copies: bool = True) -> None:  # fmt: skip
        if mode not in ("direct", "load_weights"):
            raise ValueError(f"mode must be 'direct' or 'load_weights', got {mode!r}")
        if engine_format is not None and (mode != "direct" or not engine_format.presplit):
            raise ValueError("engine_format applies to mode='direct' only, and must be pre-split (presplit=True)")
        self.llm = llm
        self.mode = mode
        self.engine_format: EngineFormat = (engine_format or _engine_format_of(llm)) if mode == "direct" else HF_NAMES
        self.tp_size = tp_size if tp_size is not None else _engine_tp(llm)
        self.transport = _transport(llm) if transport == "auto" else transport
        self.reset_prefix_cache = reset_prefix_cache and _prefix_caching(llm)
        self.fused_copies = fused_copies and mode == "direct" and self.transport == "inproc"
        # direct mode copies each shard into a region of its parameter, viewed in the shard's shape
        self.raw_shards = mode == "direct"
        if engine_rank == "auto":
            external = mode == "direct" and _executor(llm) == "ExecutorWithExternalLauncher"
            engine_rank = _worker_tp_rank(llm) if external else None
        self.engine_rank: Optional[int] = engine_rank  # type: ignore[assignment]
        self._manifest_for: Optional["weakref.ref[RefitPlan]"] = None

    def begin(self, plan: "RefitPlan") -> None:
        # the manifest travels once per plan; later refits with the same plan send only its id
        known = self._manifest_for is not None and self._manifest_for() is plan
        manifests = None if known else [plan.manifest(r) for r in range(plan.target_tp)]
        counts = None if known else [plan.bucket_counts(r) for r in range(plan.target_tp)]
        args = (id(plan), manifests, self.mode, counts, self.fused_copies)
        _check(self.llm.collective_rpc("zoo_refit_begin", args=args), "begin")
        self._manifest_for = weakref.ref(plan)

    def load_bucket(self, bucket: RefitBucket) -> None:
        if self.transport == "inproc":
            payloads: list[Any] = [[t for _, t in per] for per in bucket.items]
        else:
            payloads = [_pack(per) for per in bucket.items]
        _check(self.llm.collective_rpc("update_weights_from_buckets", args=(bucket.index, payloads)), "bucket")

    def end(self) -> None:
        # the prefix-cache reset is host work: run it while the GPU finishes the copies already
        # enqueued, before the worker's end synchronises and checks (an incomplete refit still
        # raises; its cache is dropped either way)
        if self.reset_prefix_cache and hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        _check(self.llm.collective_rpc("zoo_refit_end"), "end")


def _engine_format_of(llm: Any) -> EngineFormat:
    """The direct mode's engine format for ``llm``: :data:`VLLM`, or with the engine's expert
    parallelism over its TP group the format placing experts as its ``expert_placement_strategy``
    does. Refuses expert layouts a plan cannot know: EPLB (redundant experts, moved while serving),
    expert parallelism across data-parallel ranks."""
    try:
        parallel = llm.llm_engine.vllm_config.parallel_config
    except AttributeError:  # no config to read (a stand-in engine): vLLM's default
        return VLLM
    if not getattr(parallel, "enable_expert_parallel", False):
        return VLLM
    if getattr(parallel, "enable_eplb", False):
        raise ZooError("VLLMAdapter: the engine runs EPLB (redundant experts, moved while it serves): a direct refit"
                       " cannot know where each expert is - use mode='load_weights'")  # fmt: skip
    if int(getattr(parallel, "data_parallel_size", 1)) != 1:
        raise ZooError(f"VLLMAdapter: the engine splits experts over {parallel.data_parallel_size} data-parallel ranks"
                       " too (expert parallelism beyond the TP group): not planned - use mode='load_weights'")  # fmt: skip
    placement = getattr(parallel, "expert_placement_strategy", "linear")
    formats = {"linear": VLLM_EP, "round_robin": VLLM_EP_ROUND_ROBIN}
    if placement not in formats:
        raise ZooError(f"VLLMAdapter: expert_placement_strategy {placement!r} (known: {', '.join(formats)})")
    return formats[placement]


def _engine_tp(llm: Any) -> int:
    config = llm.llm_engine.vllm_config
    return int(config.parallel_config.tensor_parallel_size)


def _prefix_caching(llm: Any) -> bool:
    """Whether the engine caches KV blocks across requests (``True`` when its config cannot be read:
    then the reset is done)."""
    try:
        return bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    except AttributeError:
        return True


def _executor(llm: Any) -> str:
    """The class name of the engine's executor (``""`` when it has none in this process)."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    return "" if executor is None else type(executor).__name__


def _transport(llm: Any) -> str:
    """``inproc`` when the engine's worker lives in this process (an in-process engine core with
    ``UniProcExecutor``, or ``ExecutorWithExternalLauncher``: one engine rank per trainer rank)."""
    return "inproc" if _executor(llm) in ("UniProcExecutor", "ExecutorWithExternalLauncher") else "ipc"


def _worker_tp_rank(llm: Any) -> int:
    """The TP rank of the engine's one worker in this process."""
    ranks = llm.collective_rpc("zoo_tp_rank")
    if len(ranks) != 1:
        raise ZooError(f"engine_rank='auto': expected one worker in this process, the engine has {len(ranks)}")
    return int(ranks[0])


def _check(results: list[Any], what: str) -> None:
    errors = [r for r in results if r]
    if errors:
        raise ZooError(f"vLLM refit {what} failed on {len(errors)} worker(s): " + " | ".join(map(str, errors[:4])))


def _pack(items: list[tuple[Any, torch.Tensor]]) -> tuple[Any, list[tuple[int, tuple[int, ...], str]]]:
    """One flat buffer per engine rank (on the shards' device) holding every shard in its slot's
    dtype, + ``(byte_start, shape, dtype)`` per shard in plan order; the buffer travels as a CUDA
    IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    metas, total = [], 0
    for slot, t in items:
        metas.append((total, tuple(t.shape), str(slot.dtype).replace("torch.", "")))
        total += -(-t.numel() * slot.dtype.itemsize // _ALIGN) * _ALIGN
    device = items[0][1].device if items else torch.device("cpu")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for (slot, t), (start, shape, _) in zip(items, metas):
        buffer[start : start + t.numel() * slot.dtype.itemsize].view(slot.dtype).view(shape).copy_(t)
    handle = reduce_tensor(buffer) if buffer.is_cuda else buffer
    return handle, metas


def _unpack(payload: Any) -> list[torch.Tensor]:
    handle, metas = payload
    if isinstance(handle, torch.Tensor):
        buffer = handle
    else:
        rebuild, args = handle
        args = list(args)
        args[6] = torch.cuda.current_device()  # open the handle on this worker's device (peer access)
        buffer = rebuild(*args)
    out = []
    for start, shape, dtype in metas:
        dt = getattr(torch, dtype)
        out.append(buffer[start : start + math.prod(shape) * dt.itemsize].view(dt).view(shape))
    return out


class _Binding:
    """The engine side of one plan on one worker, bound once (see the module docstring).

    ``buckets[index]``: per slot of this rank in that bucket, ``[param, size, stride, offset, pad,
    cast, numel, refined]`` - the region of parameter ``params[param]`` the shard fills, as a view
    recipe (``torch.as_strided`` of the parameter: size, stride, storage offset relative to the
    parameter's; stride ``None``: the whole parameter), the zero rows after it (a recipe, or ``None``), the dtype to cast the shard
    to before the copy (``None``: ``copy_`` alone is exact), the shard's element count, and
    ``(shape, stride)`` of the region viewed in the shape raw shards of that slot come in (made on
    first use); in ``load_weights`` mode the HF names instead. ``written[index]``: the elements each
    bucket writes, per parameter (for the completeness check).

    Nothing here keeps an engine tensor alive between refits: parameters and modules are held
    weakly, regions are recipes, and :meth:`current` takes the parameters' data for one refit
    (``bases``, dropped by :meth:`release`).
    """

    def __init__(self, model: torch.nn.Module, manifest: list[Any], counts: list[int], mode: str) -> None:
        self.model, self.mode = weakref.ref(model), mode
        #: write each bucket's plain byte copies with one launch (direct mode; set per refit by
        #: ``zoo_refit_begin``; see :meth:`write`), and whether that failed here once
        self.fused, self.fused_broken = False, False
        #: per bucket: (the shards' and engine storage's layout key, its RunTable, the positions left out)
        self.tables: dict[int, tuple[Any, Any, list[int]]] = {}
        self.problems: list[str] = []
        self.want: dict[str, int] = {}
        self.params: list[tuple[Any, str, Any, Any]] = []  # (owner module, leaf, parameter) weakly, layout
        self.buckets: list[list[Any]] = []
        self.written: list[dict[str, int]] = []
        self.covers = mode != "direct"
        self.bases: list[torch.Tensor] = []
        self.offsets: list[int] = []
        if sum(counts) != len(manifest):
            self.problems.append(f"bucket counts cover {sum(counts)} slots, the manifest has {len(manifest)}")
            return
        if mode != "direct":  # vLLM's loaders: whole HF tensors by name
            names = [entry[0] for entry in manifest]
            starts = [sum(counts[:i]) for i in range(len(counts))]
            self.buckets = [names[s : s + n] for s, n in zip(starts, counts)]
            return
        params = dict(model.named_parameters(remove_duplicate=False))
        index: dict[str, int] = {}
        for name, expert, offset, shape, dtype, pad, rows in manifest:
            if name in self.want:
                continue
            param = params.get(name)
            if param is None:
                self.problems.append(f"no parameter {name!r}")
                self.want[name] = 0
                continue
            target_shape = tuple(param.shape[1:]) if expert is not None else tuple(param.shape)
            # dtypes may differ (GLM-4.5's router is fp32 in vLLM): ``copy_`` converts, as vLLM's
            # default weight loader does
            if target_shape[0] != rows or tuple(target_shape[1:]) != tuple(shape[1:]):
                self.problems.append(f"{name}: engine {tuple(param.shape)}, plan rows {rows} x {tuple(shape[1:])}")
            self.want[name] = param.numel()
            owner, _, leaf = name.rpartition(".")
            index[name] = len(self.params)
            self.params.append((weakref.ref(model.get_submodule(owner)), leaf, weakref.ref(param), _layout(param)))
        if self.problems:
            return
        self.problems += _manifest_tiling_problems(manifest, params)
        if self.problems:
            return

        def recipe(view: torch.Tensor, base: torch.Tensor) -> tuple[tuple[int, ...], Optional[tuple[int, ...]], int]:
            size, stride, offset = tuple(view.shape), view.stride(), view.storage_offset() - base.storage_offset()
            return (size, None, 0) if (size, stride, offset) == (tuple(base.shape), base.stride(), 0) else (size, stride, offset)

        entries = iter(manifest)
        for count in counts:
            dests, written = [], {}
            for name, expert, offset, shape, dtype, pad, rows in (next(entries) for _ in range(count)):
                data = params[name].detach()
                target = data if expert is None else data[expert]
                region = target.narrow(0, offset, shape[0]) if shape else target
                pad_rows = target.narrow(0, offset + shape[0], pad) if pad else None
                cast = getattr(torch, dtype)
                dests.append([index[name], *recipe(region, data), None if pad_rows is None else recipe(pad_rows, data),
                              None if cast == data.dtype else cast, math.prod(shape), None])  # fmt: skip
                written[name] = written.get(name, 0) + region.numel() + (pad_rows.numel() if pad_rows is not None else 0)
            self.buckets.append(dests)
            self.written.append(written)
        self.covers = not self.short([1] * len(self.buckets))  # every bucket once fills every parameter

    def current(self, model: torch.nn.Module) -> bool:
        """Whether the engine still holds the parameters this binding was made for (the same
        objects with the same dtype, shape and stride; their storage may have moved); if so, take
        their data for this refit."""
        if self.model() is not model:
            return False
        bases = []
        for owner_ref, leaf, param_ref, layout in self.params:
            owner, param = owner_ref(), param_ref()
            if owner is None or param is None or owner._parameters.get(leaf) is not param or _layout(param) != layout:
                return False
            bases.append(param)  # written under no_grad
        self.bases, self.offsets = bases, [b.storage_offset() for b in bases]
        return True

    def release(self) -> None:
        self.bases, self.offsets = [], []

    def write(self, index: int, shards: list[torch.Tensor]) -> None:
        """Copy bucket ``index``'s shards (plan order) into their regions.

        With fused copies (:attr:`fused`), every shard that is a plain byte copy into its region
        goes into one :class:`~mcore_zoo.kernels.copy_runs.RunTable` per bucket, written by one
        launch; the table is kept while the same shards (data pointer, shape, stride, dtype) fill
        the same engine storage, and rebuilt otherwise. The rest (a cast, a reshaped shard,
        padding rows, odd sizes) is copied shard by shard."""
        dests = self.buckets[index]
        if len(shards) != len(dests):
            raise ZooError(f"{len(shards)} shard(s), the plan has {len(dests)} for this rank")
        if self.fused:
            try:
                rest = self._write_fused(index, dests, shards)
            except ZooError:
                raise
            except Exception as exc:  # e.g. Triton cannot compile here: nothing was written yet
                self.fused, self.fused_broken, self.tables = False, True, {}
                warnings.warn(f"refit: fused copies off, copying shard by shard ({type(exc).__name__}: {exc})",
                              stacklevel=2)  # fmt: skip
                rest = range(len(dests))
            for i in rest:
                self._copy(dests[i], shards[i])
            return
        for dest, shard in zip(dests, shards):
            self._copy(dest, shard)

    def _write_fused(self, index: int, dests: list[Any], shards: list[torch.Tensor]) -> list[int]:
        """Launch bucket ``index``'s run table (built or rebuilt when the shards or the engine's
        storage moved); returns the positions of the shards it leaves to :meth:`_copy`."""
        from ..kernels.copy_runs import RunTable, byte_runs

        if not dests:  # no slot of this rank in the bucket
            return []
        bases = self.bases
        key = (tuple((s.data_ptr(), s.shape, s.stride(), s.dtype) for s in shards),
               tuple(bases[dest[0]].data_ptr() for dest in dests))  # fmt: skip
        cached = self.tables.get(index)
        if cached is None or cached[0] != key:
            runs: list[tuple[int, int, int]] = []
            rest = []
            for i, (dest, shard) in enumerate(zip(dests, shards)):
                region = self._region(dest, shard)
                found = None if region is None or dest[4] is not None else byte_runs(region, shard)
                if found is None:
                    rest.append(i)
                else:
                    runs.extend(found)
            cached = self.tables[index] = (key, RunTable(runs, bases[dests[0][0]].device), rest)
        cached[1].launch()
        return cached[2]

    def _region(self, dest: list[Any], shard: torch.Tensor) -> Optional[torch.Tensor]:
        """The region of ``dest`` viewed in ``shard``'s shape when ``shard`` can be copied into it
        as it is (the planned dtype, no reshape); ``None`` otherwise."""
        if shard.numel() != dest[6]:
            raise ZooError(f"a shard of {shard.numel()} elements for a slot of {dest[6]}")
        if dest[5] is not None:  # the engine parameter has another dtype: copy_ converts
            return None
        return self._view(dest, shard.shape)

    def _view(self, dest: list[Any], shape: torch.Size) -> Optional[torch.Tensor]:
        """The region of ``dest`` viewed in ``shape`` (a raw shard's refined shape: same elements,
        row-major), or ``None`` where the region cannot be viewed so."""
        param, size, stride, offset = dest[:4]
        base = self.bases[param]
        if shape != size:
            refined = dest[7]
            if refined is None or refined[0] != shape:
                refined = dest[7] = (shape, _view_stride(size, stride or base.stride(), shape))
            if refined[1] is None:
                return None
            size, stride = refined
        return base if stride is None else torch.as_strided(base, size, stride, self.offsets[param] + offset)

    def _copy(self, dest: list[Any], shard: torch.Tensor) -> None:
        """Copy one shard into its region (and zero its padding rows)."""
        param, size, stride, offset, pad, cast, numel, refined = dest
        if shard.numel() != numel:
            raise ZooError(f"a shard of {shard.numel()} elements for a slot of {numel}")
        if cast is not None:  # the planned dtype first, as the export would have cast it
            shard = shard.to(cast)
        region = self._view(dest, shard.shape)
        if region is None:  # the region cannot be viewed in the shard's shape: reshape the shard instead
            region, shard = self._view(dest, size), shard.reshape(size)
        region.copy_(shard)  # type: ignore[union-attr]
        if pad is not None:
            base = self.bases[param]
            torch.as_strided(base, pad[0], pad[1] or base.stride(), self.offsets[param] + pad[2]).zero_()

    def short(self, done: list[int]) -> list[str]:
        """Parameters not written exactly once over, given how often each bucket was written."""
        got = dict.fromkeys(self.want, 0)
        for times, written in zip(done, self.written):
            for name, n in written.items():
                got[name] += times * n
        return [f"{n} ({w} of {self.want[n]} elements)" for n, w in got.items() if w != self.want[n]]


def _manifest_tiling_problems(manifest: list[Any], params: dict[str, torch.Tensor]) -> list[str]:
    """Whether the manifest's slots tile every parameter they name exactly - each row (of each
    expert) once, none left - as row spans (:class:`~mcore_zoo.rollout.adapter.RegionCoverage`);
    a count of elements would pass a slot planned twice and another never."""
    from .plan import RegionCoverage, slot_rows

    coverage, expected = RegionCoverage(), {}
    try:
        for name, expert, offset, shape, _dtype, pad, _rows in manifest:
            coverage.add((0, name, expert), *slot_rows(offset, shape, pad))
            param = params[name]
            if expert is None:
                expected[(0, name, None)] = param.shape[0] if param.dim() else 1
            else:
                expected.update({(0, name, e): param.shape[1] if param.dim() > 1 else 1 for e in range(param.shape[0])})
    except ZooError as exc:
        return [str(exc)]
    return coverage.problems(expected)


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.dtype, tuple(tensor.shape), tensor.stride()


def _view_stride(size: tuple[int, ...], stride: tuple[int, ...], shape: Any) -> Optional[tuple[int, ...]]:
    """The stride of a ``(size, stride)`` region viewed in ``shape`` (``None``: not viewable)."""
    try:
        return torch.empty_strided(size, stride, device="meta").view(shape).stride()
    except RuntimeError:
        return None


def _relays_out_experts(module: Any) -> bool:
    """A MoE layer whose unquantized kernel keeps experts in a layout other than the loader's."""
    backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
    return backend is not None and getattr(backend, "name", str(backend)) not in _LOADER_LAYOUT_MOE_BACKENDS


def _derives_weights(module: Any) -> bool:
    """vLLM's MLA attention (found by class name: vLLM is imported in the worker only)."""
    return any(c.__name__ == "MLAAttention" for c in type(module).__mro__) and hasattr(module, "process_weights_after_loading")


class ZooWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods run on every worker and
    return ``None`` on success or an error string (``collective_rpc`` gathers them)."""

    def _zoo_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _zoo_tp_rank(self) -> int:
        from ..placement import vllm_tp_rank

        return vllm_tp_rank()

    def zoo_tp_rank(self) -> int:
        """This worker's tensor-parallel rank (``VLLMAdapter(engine_rank="auto")`` asks)."""
        return self._zoo_tp_rank()

    def _zoo_modules(self, kind: str, wanted: Callable[[Any], bool]) -> list[tuple[str, Any]]:
        """The model's modules that ``wanted`` picks, ``(name, module)``: found with one walk of the
        model per ``kind``, kept while the worker holds the same model."""
        model = self._zoo_model()
        found_by_kind = getattr(self, "_zoo_found", None)
        if found_by_kind is None:
            found_by_kind = self._zoo_found = {}
        cached = found_by_kind.get(kind)
        if cached is not None and cached[0] is model:
            return cached[1]
        found = [(name, module) for name, module in model.named_modules() if wanted(module)]
        found_by_kind[kind] = (model, found)
        return found

    def _zoo_relayout_modules(self) -> list[tuple[str, Any]]:
        """MoE layers whose kernel keeps experts in its own layout after loading (FlashInfer
        CUTLASS swaps w13 to [w3; w1], FlashInfer TRT-LLM permutes blocks; Triton - vLLM's default on
        Hopper - keeps the loader's layout)."""
        return self._zoo_modules("relayout", _relays_out_experts)

    def _zoo_derived_modules(self) -> list[tuple[str, Any]]:
        """Attention layers that keep weights derived from a refit parameter, which vLLM computes
        after loading: MLA's ``W_UK_T`` / ``W_UV``, read off ``kv_b_proj``
        (``MLAAttention.process_weights_after_loading``; without a re-derivation the engine would
        keep attending with the old weights)."""
        return self._zoo_modules("derived", _derives_weights)

    def _zoo_rederive(self) -> None:
        """Recompute the derived weights of :meth:`_zoo_derived_modules` from the refit parameters,
        as vLLM's loader does after loading (``process_weights_after_loading(model_config.dtype)``;
        the results are copied into the existing tensors, so captured CUDA graphs stay valid)."""
        derived = self._zoo_derived_modules()
        if not derived:
            return
        config = getattr(self, "model_config", None) or self.vllm_config.model_config  # type: ignore[attr-defined]
        with torch.no_grad():
            for _, module in derived:
                module.process_weights_after_loading(config.dtype)

    def zoo_refit_begin(self, plan_id: int, manifests: Optional[list[Any]], mode: str,
                        counts: Optional[list[list[int]]] = None, fused: bool = False) -> Optional[str]:  # fmt: skip
        """Start a refit: bind the plan (``manifests`` / ``counts`` given: per engine rank, the
        plan's manifest and its slots per bucket) or check the binding of the plan ``plan_id``
        this worker already has, re-binding it if the engine replaced a parameter. ``fused``:
        write each bucket's plain copies with one launch where this worker's device has the
        kernel (:mod:`mcore_zoo.kernels.copy_runs`; CUDA with Triton)."""
        model = self._zoo_model()
        self._zoo_mode = mode
        relayout = self._zoo_relayout_modules()
        if mode == "direct" and relayout:
            backend = relayout[0][1].quant_method.unquantized_backend
            return (f"{len(relayout)} MoE layer(s) run {backend}, which re-lays out expert weights after loading;"
                    " refit them with VLLMAdapter(llm, mode='load_weights') (vLLM's loaders, then its relayout)")  # fmt: skip
        if manifests is not None:
            if counts is None:
                return "refit plan sent without its bucket counts"
            rank = self._zoo_tp_rank() if mode == "direct" else 0
            self._zoo_plan = (plan_id, manifests[rank], counts[rank], mode)
            self._zoo_binding: Optional[_Binding] = None
        elif getattr(self, "_zoo_plan", (None,))[0] != plan_id:
            return "refit plan unknown to this worker (its manifest was never sent)"
        binding = self._zoo_binding
        if binding is None or binding.mode != mode or not binding.current(model):
            _, manifest, bucket_counts, _ = self._zoo_plan
            binding = self._zoo_binding = _Binding(model, manifest, bucket_counts, mode)
            if binding.problems:
                self._zoo_binding = None
                return f"{len(binding.problems)} plan/engine mismatch(es): " + "; ".join(binding.problems[:8])
            binding.current(model)
        if fused and mode == "direct" and not binding.fused_broken:
            from ..kernels import copy_runs

            binding.fused = bool(binding.bases) and copy_runs.supported(binding.bases[0].device)
        else:
            binding.fused = False
        self._zoo_done = [0] * len(binding.buckets)
        return None

    def update_weights_from_buckets(self, index: int, payloads: list[Any]) -> Optional[str]:
        """Write bucket ``index``: ``payloads[rank]`` is that engine rank's shards in plan order
        (a list of tensors in-process, a packed buffer otherwise)."""
        try:
            binding = getattr(self, "_zoo_binding", None)
            if binding is None:
                return f"bucket {index}: no refit begun"
            payload = payloads[self._zoo_tp_rank()] if self._zoo_mode == "direct" else payloads[0]
            shards = payload if isinstance(payload, list) else _unpack(payload)
            with torch.no_grad():
                if self._zoo_mode == "load_weights":
                    self._zoo_model().load_weights(list(zip(binding.buckets[index], shards)))
                else:
                    binding.write(index, shards)
            self._zoo_done[index] += 1
            return None
        except Exception as exc:  # reported to the trainer through collective_rpc
            return f"bucket {index}: {type(exc).__name__}: {exc}"

    def zoo_refit_end(self) -> Optional[str]:
        if self._zoo_mode != "direct":
            # vLLM's RL update path: weights through the loaders, then the kernels' relayout
            # (``_setup_kernel`` copies into the existing storage on a weight update)
            with torch.no_grad():
                for _, module in self._zoo_relayout_modules():
                    module.quant_method.process_weights_after_loading(module)
        try:  # both modes: neither the direct copies nor vLLM's loaders update derived weights
            self._zoo_rederive()
        except Exception as exc:  # reported to the trainer through collective_rpc
            return f"refit end: re-deriving MLA weights failed: {type(exc).__name__}: {exc}"
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        binding = getattr(self, "_zoo_binding", None)
        if binding is not None:
            binding.release()
        if self._zoo_mode != "direct" or (binding is not None and binding.covers and all(t == 1 for t in self._zoo_done)):
            return None
        short = binding.short(self._zoo_done) if binding is not None else ["no refit begun"]
        if short:
            return f"refit incomplete: {len(short)} parameter(s) not fully written: " + "; ".join(short[:8])
        return None

    def zoo_refit_fused(self) -> bool:
        """Whether this worker's last refit wrote its buckets with fused copies (one launch per
        bucket: ``VLLMAdapter(fused_copies=True)`` on a device with the kernel)."""
        binding = getattr(self, "_zoo_binding", None)
        return bool(binding is not None and binding.fused)

    def zoo_compare_parameters(self, expected: dict[str, torch.Tensor]) -> Optional[str]:
        """Check this worker's parameters against ``expected`` (engine name -> tensor, e.g. a
        :class:`~mcore_zoo.rollout.adapter.DictAdapter`'s tensors of this rank): ``None`` when every
        named parameter is bit for bit equal, else what differs. Needs the tensors in this process
        (an in-process engine: ``UniProcExecutor`` or ``external_launcher``)."""
        params = dict(self._zoo_model().named_parameters())
        wrong = []
        for name, want in expected.items():
            have = params.get(name)
            if have is None:
                wrong.append(f"{name}: not a parameter of the engine")
            elif have.shape != want.shape or have.dtype != want.dtype:
                wrong.append(f"{name}: {tuple(have.shape)} {have.dtype}, expected {tuple(want.shape)} {want.dtype}")
            elif not torch.equal(have.data, want.to(have.device)):
                wrong.append(f"{name}: values differ")
        return f"{len(wrong)} parameter(s) differ: " + "; ".join(wrong[:8]) if wrong else None


__all__ = ["VLLMAdapter", "ZooWorkerExtension", "EXTENSION"]
