"""Buffers one process writes and other processes of the same host read in place, without a copy on
the way: CUDA IPC for a CUDA tensor, shared memory for a CPU tensor.

The owner makes the buffer with :func:`shared_empty` (or shares a CUDA tensor it has with
:func:`share_buffer`) and keeps it alive, and sends the :class:`SharedBuffer` (plain values:
picklable) to the readers; each reader calls
:func:`open_buffer` once and gets a tensor over the same memory:

* CUDA: the reader maps the owner's allocation (``cudaIpcOpenMemHandle``, what
  ``torch.multiprocessing`` does for a CUDA tensor) into its own device's context - the same GPU, or
  another GPU of the node reached over NVLink / PCIe;
* CPU: the owner allocates the buffer in a shared-memory file (:func:`shared_empty`; no helper
  process of torch's in between) and the reader maps that file.

Ordering is the caller's: a reader must not read before the owner's writes are done (a CUDA
owner synchronises its stream before it tells the readers), and the owner must not write again
before every reader is done (:class:`AckBoard`).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import ZooError


@dataclass(frozen=True)
class SharedBuffer:
    """What a reader needs to map an owner's buffer: ``kind`` (``"cuda"`` or ``"cpu"``), its
    handle (CUDA: the storage's IPC handle, plain ints and bytes; CPU: the shared-memory file's
    path) and the buffer's ``nbytes``."""

    kind: str
    handle: Any
    nbytes: int


def shared_empty(nbytes: int, device: torch.device) -> tuple[torch.Tensor, SharedBuffer]:
    """A new ``uint8`` buffer of ``nbytes`` on ``device`` that other processes of this host can
    map (:func:`open_buffer`), and its :class:`SharedBuffer`. CPU: a file in shared memory
    (``/dev/shm`` where there is one), mapped shared, removed when the returned tensor is freed or
    the process exits (readers map it before: they are handed it at setup; keep the returned
    tensor, not only views of it); CUDA: an ordinary device buffer shared
    through its IPC handle."""
    if device.type == "cuda":
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return tensor, share_buffer(tensor)
    if device.type != "cpu":
        raise ZooError(f"shared_empty: no sharing for a {device.type} tensor (CUDA or CPU)")
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"mcore-zoo-{os.getpid()}-{uuid.uuid4().hex}")
    tensor = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
    weakref.finalize(tensor, _remove, path)  # the file goes with the returned tensor (or at exit)
    return tensor, SharedBuffer("cpu", path, nbytes)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def share_buffer(tensor: torch.Tensor) -> SharedBuffer:
    """Share a CUDA ``tensor`` (contiguous ``uint8``, the whole of its storage) with other
    processes of this host (CUDA IPC). CPU buffers are made shared (:func:`shared_empty`)."""
    if tensor.dtype != torch.uint8 or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise ZooError("share_buffer: a contiguous uint8 tensor at the start of its storage")
    if not tensor.is_cuda:
        raise ZooError(f"share_buffer: a {tensor.device.type} tensor; CPU buffers are made shared with shared_empty")
    return SharedBuffer("cuda", tuple(tensor.untyped_storage()._share_cuda_()), tensor.numel())


def open_buffer(shared: SharedBuffer, device: Optional[torch.device] = None) -> torch.Tensor:
    """A ``uint8`` tensor of ``shared.nbytes`` over the owner's memory: on ``device`` (this
    process's CUDA device; default the current one) for a CUDA buffer, on the CPU for a CPU one."""
    if shared.kind == "cpu":
        return torch.from_file(shared.handle, shared=True, size=max(shared.nbytes, 1), dtype=torch.uint8)[: shared.nbytes]
    if shared.kind != "cuda":
        raise ZooError(f"open_buffer: unknown kind {shared.kind!r}")
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    _, handle, size, offset, counter, counter_offset, event, event_sync = shared.handle
    storage = torch.UntypedStorage._new_shared_cuda(device.index, handle, size, offset, counter, counter_offset,
                                                    event, event_sync)  # fmt: skip
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (shared.nbytes,), (1,))


class AckBoard:
    """Progress counters in shared memory: slot ``i`` holds how far reader ``i`` has got (an
    increasing int64). The owner makes the board and shares it; readers raise their slot; the
    owner waits until the slots it needs reach a value - no message to match, so a reader that
    stops early (it raises its slot to the end) never leaves the owner waiting on a message."""

    def __init__(self, tensor: torch.Tensor, owned: Optional[torch.Tensor] = None) -> None:
        self.tensor = tensor  # int64 [readers], CPU, shared
        self._owned = owned  # the owner's buffer: its shared-memory file lives as long as it does

    @classmethod
    def create(cls, readers: int) -> tuple["AckBoard", SharedBuffer]:
        raw, shared = shared_empty(8 * max(readers, 1), torch.device("cpu"))
        raw.zero_()
        return cls(raw.view(torch.int64), raw), shared

    @classmethod
    def open(cls, shared: SharedBuffer) -> "AckBoard":
        return cls(open_buffer(shared).view(torch.int64))

    def raise_to(self, slot: int, value: int) -> None:
        """Reader ``slot`` has got to ``value`` (never lowered)."""
        if int(self.tensor[slot]) < value:
            self.tensor[slot] = value

    def wait(self, slots: list[int], value: int, timeout: float, what: str) -> None:
        """Until every one of ``slots`` is at least ``value``; raises :class:`ZooError` naming
        ``what`` and the slots behind after ``timeout`` seconds."""
        deadline, pause = time.monotonic() + timeout, 1e-5
        while True:
            behind = [s for s in slots if int(self.tensor[s]) < value]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise ZooError(f"{what}: reader(s) {behind} did not get to {value} in {timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


__all__ = ["AckBoard", "SharedBuffer", "open_buffer", "share_buffer", "shared_empty"]
