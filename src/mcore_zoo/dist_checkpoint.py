"""Offline conversion between HF checkpoints and Megatron-Core distributed checkpoints, streaming.

``hf_to_mcore`` writes a ``torch_dist`` checkpoint once; :func:`load_mcore_checkpoint` (and any
Megatron-LM style ``dist_checkpointing.load``) then loads it at any TP / PP / VPP through
dist_checkpointing's resharding. Both directions run in one process and hold one parameter
(HF -> mcore) or one decoder layer (mcore -> HF, plus the HF shard being written, see
``max_shard_size``) at a time: the model is never materialised, so a model larger than the
process's memory converts. How: the single-process model is built on the ``meta`` device, its
``sharded_state_dict`` gives every checkpoint key, shape and offset, and parameters are produced
from the HF files with the same weight-map rules as :func:`mcore_zoo.load_hf_weights`
(:mod:`mcore_zoo.distributed.io`).

A ``mcore_zoo.json`` beside the distributed checkpoint records the architecture and the HF
config, so the way back needs nothing else. Both directions write atomically. Key names are the
fused-norm ones (``linear_qkv.layer_norm_weight``) whatever the backend, so a checkpoint converted
with the CPU ``local`` backend loads into a Transformer Engine model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import torch

from .errors import InputError, OutputError, ZooError

logger = logging.getLogger(__name__)

META_FILE = "mcore_zoo.json"
FORMAT_VERSION = 2

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


def parse_dtype(name: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ZooError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def _single_process() -> None:
    """Conversion runs in one process at TP = PP = 1; create that state if there is none."""
    from megatron.core import parallel_state as ps

    from .parallel import ensure_model_parallel
    from .placement import process_count

    if process_count() > 1:
        raise ZooError("checkpoint conversion runs in a single process (it streams; no parallelism needed)")
    if ps.model_parallel_is_initialized() and ps.get_model_parallel_group().size() > 1:
        raise ZooError("checkpoint conversion needs TP = PP = 1 in this process")
    ensure_model_parallel()


def meta_model(source: Any, request: Any = None, /, **options: Any) -> torch.nn.Module:
    """The single-process (TP = PP = 1) model on the ``meta`` device: names, shapes, sharding
    metadata and the bound weight map, without memory. ``request`` / ``options``: the build options
    of :func:`mcore_zoo.build_model` (a :class:`~mcore_zoo.build.BuildRequest` and / or keywords);
    the layout, CPU initialisation and the absence of random init are this function's."""
    from .build import BuildRequest, prepare
    from .placement import Parallelism

    for key in ("parallel", "perform_initialization"):
        if key in options:
            raise TypeError(f"meta_model does not take {key!r} (a single process, no random init)")
    req = BuildRequest.of(request, **options)
    _single_process()
    plan = prepare(source, req, parallel=Parallelism(), perform_initialization=False,
                   overrides={**dict(req.overrides or {}), "use_cpu_initialization": True})  # fmt: skip
    with torch.device("meta"):
        return plan.new_handle().attach(plan.build_chunk())


def _checkpoint_dtype(ckpt: Any) -> torch.dtype:
    """The dtype holding most of the checkpoint's bytes (of an FP8 block-quantized checkpoint: of
    its tensors stored unquantized, e.g. bf16 - the dequantized weights take that dtype too)."""
    counts: Counter = Counter()
    names = [n for n in ckpt.keys() if ckpt.entry(n) is not None] or list(ckpt.keys())
    for name in names:
        shape = ckpt.shape(name)
        counts[ckpt.dtype(name)] += int(torch.Size(shape).numel())
    return counts.most_common(1)[0][0]


def hf_to_mcore(
    hf_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    params_dtype: Optional[Union[str, torch.dtype]] = None,
    backend: str = "local",
    overwrite: bool = False,
    make_vocab_size_divisible_by: Optional[int] = None,
    ignore_fields: Optional[Mapping[str, str]] = None,
) -> Path:
    """HF checkpoint -> Megatron-Core ``torch_dist`` checkpoint, one parameter in memory at a time.

    ``params_dtype`` defaults to the dtype of the HF weights. ``make_vocab_size_divisible_by`` pads
    the vocabulary as a Megatron trainer configured so expects it (recorded; the way back unpads).
    ``ignore_fields`` (``{hf_field: reason}``, as for :func:`mcore_zoo.build_model`) is recorded
    too, and the way back builds the same model. Every check of
    :func:`mcore_zoo.load_hf_weights` (coverage both ways, shapes) runs before anything is written.
    """
    from .distributed.io import sharded_layout, write_streaming
    from .handle import handle_of
    from .weights.io import atomic_output_dir
    from .weights.load import open_hf_checkpoint, plan_load, read_rule_into

    from .hf_assets import MCORE_ASSET_DIR, copy_assets
    from .hub import resolve
    from .registry import lookup

    hf_dir = resolve(hf_dir)  # a Hugging Face Hub id: its snapshot
    arch_config = lookup(hf_dir).config_from_hf(hf_dir, ignore_fields=ignore_fields)
    with contextlib.closing(open_hf_checkpoint(hf_dir, arch_config)) as ckpt:  # FP8 blocks as load_hf_weights reads them
        dtype = parse_dtype(params_dtype) or _checkpoint_dtype(ckpt)
        model = meta_model(hf_dir, backend=backend, params_dtype=dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                           ignore_fields=ignore_fields)  # fmt: skip
        handle = handle_of(model)
        steps = {s.bound.mcore: s for s in handle.rule_steps(model)}
        plan_load(handle.weight_map, ckpt, [(model, list(steps.values()))])  # coverage, unmapped parameters, shapes: all before writing
        layout = sharded_layout(model)

        def produce(name: str) -> torch.Tensor:
            shape, param_dtype = layout.params[name]
            tensor = torch.empty(shape, dtype=param_dtype)
            read_rule_into(ckpt, steps[name].bound, tensor, steps[name].ctx)
            return tensor

        out = Path(out_dir)
        with atomic_output_dir(out, overwrite=overwrite, inputs=[hf_dir]) as tmp:
            with _write_errors(out, tmp):
                write_streaming(layout, _with_progress(produce, len(layout.params), "hf -> mcore"), tmp)
            meta = {
                "format_version": FORMAT_VERSION,
                "architecture": handle.arch_config.architecture,
                "hf_config": handle.arch_config.hf_config,
                "params_dtype": str(dtype).replace("torch.", ""),
                "backend": backend,
                "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                "ignore_fields": dict(ignore_fields or {}),
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            (tmp / MCORE_ASSET_DIR).mkdir()
            copy_assets(hf_dir, tmp / MCORE_ASSET_DIR)  # tokenizer, generation_config.json: for the way back
    logger.info("wrote distributed checkpoint %s (%d parameters, %s)", out, len(layout.params), meta["params_dtype"])
    return out


def _with_progress(produce: Any, total: int, desc: str) -> Any:
    """``produce`` counting its calls on a progress bar (quiet when not a terminal)."""
    from .progress import enabled

    if not enabled():
        return produce
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="param", leave=False)

    def counted(name: str) -> torch.Tensor:
        tensor = produce(name)
        bar.update(1)
        if bar.n >= total:
            bar.close()
        return tensor

    return counted


@contextlib.contextmanager
def _write_errors(out: Path, tmp: Path) -> Iterator[None]:
    """Name the output and the likely cause when writing fails (a full or read-only disk surfaces
    from torch's writer as e.g. ``unexpected pos 704 vs 598``)."""
    import shutil

    try:
        yield
    except ZooError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        cause = _os_error_in(exc)
        if cause is not None:
            where = f"{cause.filename}: " if cause.filename else ""
            detail = f"{where}{cause.strerror or cause}"
        else:
            detail = _one_line(exc)
        hints = []
        try:
            hints.append(f"{shutil.disk_usage(tmp).free / 2**20:.1f} MiB free on its device")
        except OSError:
            hints.append("free space unknown")
        try:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:
                hints.append(f"file size limit {limit} bytes (ulimit -f)")
        except (ImportError, OSError, ValueError):
            pass
        raise OutputError(out, f"writing failed: {detail} ({'; '.join(hints)}; is the disk full, a quota or"
                               " file size limit reached, or the directory read-only?)") from exc  # fmt: skip


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (at most 300 characters): torch's ``CheckpointException``
    embeds each rank's traceback, whose last line is the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if "Traceback" in str(exc) else " ".join(lines))[:300] or type(exc).__name__


def _os_error_in(exc: BaseException) -> Optional[OSError]:
    """The first ``OSError`` behind ``exc``: in its cause / context chain, or among the per-rank
    failures of torch's ``CheckpointException``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and (current.errno or current.strerror):
            return current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) and failure else failure)
    return None


def read_meta(mcore_dir: Union[str, os.PathLike]) -> dict[str, Any]:
    path = Path(mcore_dir) / META_FILE
    if not path.is_file():
        raise ZooError(f"{mcore_dir} has no {META_FILE}: not a checkpoint written by mcore-zoo convert")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSON or UTF-8
        raise InputError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: damaged (not a JSON object)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ZooError(
            f"{path}: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}; convert the HF checkpoint again"
        )
    for key, kind in (("hf_config", dict), ("architecture", str)):
        if not isinstance(meta.get(key), kind):
            raise InputError(f"{path}: damaged (field {key!r} missing or not a {kind.__name__})")
    for key in ("backend", "params_dtype"):
        if key in meta and not isinstance(meta[key], str):
            raise InputError(f"{path}: damaged (field {key!r} is not a string)")
    pad = meta.get("make_vocab_size_divisible_by")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
        raise InputError(f"{path}: damaged (field 'make_vocab_size_divisible_by' is not a positive integer)")
    return meta


@contextlib.contextmanager
def _reading_dist_checkpoint(mcore_dir: Union[str, os.PathLike]) -> Iterator[None]:
    """Name the distributed checkpoint when its ``.metadata`` or ``.distcp`` files are damaged."""
    try:
        yield
    except ZooError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException; pickle, EOF, ...
        detail = _one_line(exc)
        raise InputError(
            f"distributed checkpoint {mcore_dir} cannot be read (damaged or truncated .metadata / .distcp files?):"
            f" {detail}"
        ) from exc


def load_mcore_checkpoint(model: Any, mcore_dir: Union[str, os.PathLike], *, trust_pickle: bool = False) -> None:
    """Load a distributed checkpoint into ``model`` - this rank's chunk, or its list of VPP chunks -
    at any layout. Every rank of the job calls it (one collective load). Every parameter must be
    found and every checkpoint tensor used; only ``_extra_state`` entries (Transformer Engine's
    FP8 metadata) may be absent from the checkpoint. The DCP ``.metadata`` is read without running
    pickled code unless ``trust_pickle`` (:func:`mcore_to_hf`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .distributed.io import dcp_metadata_reads

    from .handle import handle_of

    from .model_groups import refuse_own_groups

    handle = handle_of(model)
    handle.check_current()  # before any IO
    refuse_own_groups(handle.placement, "load_mcore_checkpoint", "dist_checkpoint")
    chunks = handle.chunks
    request = {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    with dcp_metadata_reads(trust_pickle):
        state, missing, unexpected = dist_checkpointing.load(request, str(mcore_dir), strict=StrictHandling.RETURN_ALL)
    absent = sorted(k for k in unexpected if not re.search(r"_extra_state(/|$)", k))  # asked for, not stored
    if absent or missing:
        raise ZooError(
            f"distributed checkpoint {mcore_dir} does not match the model: not in the checkpoint {absent},"
            f" in the checkpoint but not in the model {sorted(missing)}"
        )
    for i, chunk in enumerate(chunks):
        not_loaded, extra = chunk.load_state_dict(state[f"chunk{i}"], strict=False)
        not_loaded = [k for k in not_loaded if not k.endswith("_extra_state")]
        if not_loaded or extra:
            raise ZooError(f"distributed checkpoint {mcore_dir} does not match the model: missing {not_loaded}, unexpected {extra}")


def _layer_groups(names: list[str]) -> Iterator[list[str]]:
    """Parameter names grouped by decoder layer (others one by one), in model order."""
    groups: dict[Any, list[str]] = {}
    for name in names:
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        groups.setdefault(("layer", int(m.group(1))) if m else ("single", name), []).append(name)
    yield from groups.values()


def mcore_to_hf(
    mcore_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[Union[str, torch.dtype]] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> list[str]:
    """Megatron-Core distributed checkpoint (written by :func:`hf_to_mcore`, or saved by a training
    job from a zoo-built model of any layout) -> HF checkpoint, one decoder layer at a time.

    The checkpoint's DCP ``.metadata`` (a pickle) is read with an allow-list of the types it holds,
    so a crafted one cannot run code; ``trust_pickle=True`` (``--trust-pickle``) reads it with
    plain ``pickle``, for a checkpoint you trust whose metadata names other types."""
    from .distributed.io import read_dcp_metadata, read_params, sharded_layout
    from .handle import handle_of
    from .weights.export import export_rule, hf_config_for_export, write_hf_checkpoint

    from .hf_assets import MCORE_ASSET_DIR
    from .progress import progress

    meta = read_meta(mcore_dir)
    if not trust_pickle:  # refused before anything is written
        read_dcp_metadata(Path(mcore_dir) / ".metadata")
    model = meta_model(meta["hf_config"], backend=meta.get("backend", "local"), params_dtype=parse_dtype(meta.get("params_dtype")),
                       make_vocab_size_divisible_by=meta.get("make_vocab_size_divisible_by"),
                       ignore_fields=meta.get("ignore_fields") or None)  # fmt: skip
    handle = handle_of(model)
    steps = {s.bound.mcore: s for s in handle.export_steps()}
    layout = sharded_layout(model)
    out_dtype = parse_dtype(dtype)

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        groups = list(_layer_groups(list(layout.params)))
        with _reading_dist_checkpoint(mcore_dir):
            reads = read_params(layout, groups, mcore_dir, trust_pickle=trust_pickle)
            for group in progress(reads, total=len(groups), desc="mcore -> hf", unit="layer"):
                for name, tensor in group.items():
                    if name in steps:
                        for hf_name, hf_tensor in export_rule(steps[name].bound, tensor, steps[name].ctx):
                            yield hf_name, hf_tensor.to(out_dtype) if out_dtype is not None else hf_tensor

    return write_hf_checkpoint(
        items(), out_dir, needed=handle.weight_map.export_names(), config=hf_config_for_export(handle.arch_config, out_dtype, head=handle.head),
        max_shard_size=max_shard_size, overwrite=overwrite, inputs=[mcore_dir], assets=Path(mcore_dir) / MCORE_ASSET_DIR,
    )  # fmt: skip
