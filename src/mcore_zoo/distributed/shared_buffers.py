"""Buffers one process writes and other processes of the same host read in place, without a copy on
the way: CUDA IPC for a CUDA tensor, shared memory for a CPU tensor.

The owner calls :func:`share_buffer` once on a contiguous ``uint8`` tensor it keeps alive, and sends
the :class:`SharedBuffer` (plain ints and bytes: picklable) to the readers; each reader calls
:func:`open_buffer` once and gets a tensor over the same memory:

* CUDA: the reader maps the owner's allocation (``cudaIpcOpenMemHandle``, what
  ``torch.multiprocessing`` does for a CUDA tensor) into its own device's context - the same GPU, or
  another GPU of the node reached over NVLink / PCIe;
* CPU: the owner's storage is moved into shared memory (torch's file-system sharing) and the reader
  maps that file.

Ordering is the caller's: a reader must not read before the owner's writes are done (a CUDA
owner synchronises its stream before it tells the readers), and the owner must not write again
before every reader is done (:class:`AckBoard`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ZooError


@dataclass(frozen=True)
class SharedBuffer:
    """What a reader needs to map an owner's buffer: ``kind`` (``"cuda"`` or ``"cpu"``), the
    storage's share handle (``handle``: plain ints and bytes) and the buffer's ``nbytes``."""

    kind: str
    handle: tuple
    nbytes: int


def share_buffer(tensor: torch.Tensor) -> SharedBuffer:
    """Share ``tensor`` (contiguous ``uint8``, the whole of its storage) with other processes of
    this host. A CPU tensor's storage moves into shared memory in place."""
    if tensor.dtype != torch.uint8 or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise ZooError("share_buffer: a contiguous uint8 tensor at the start of its storage")
    storage = tensor.untyped_storage()
    if tensor.is_cuda:
        return SharedBuffer("cuda", tuple(storage._share_cuda_()), tensor.numel())
    if tensor.device.type == "cpu":
        return SharedBuffer("cpu", tuple(storage._share_filename_cpu_()), tensor.numel())
    raise ZooError(f"share_buffer: no sharing for a {tensor.device.type} tensor (CUDA or CPU)")


def open_buffer(shared: SharedBuffer, device: Optional[torch.device] = None) -> torch.Tensor:
    """A ``uint8`` tensor of ``shared.nbytes`` over the owner's memory: on ``device`` (this
    process's CUDA device; default the current one) for a CUDA buffer, on the CPU for a CPU one."""
    if shared.kind == "cuda":
        device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        _, handle, size, offset, counter, counter_offset, event, event_sync = shared.handle
        storage = torch.UntypedStorage._new_shared_cuda(device.index, handle, size, offset, counter, counter_offset,
                                                        event, event_sync)  # fmt: skip
    elif shared.kind == "cpu":
        storage = torch.UntypedStorage._new_shared_filename_cpu(*shared.handle)
    else:
        raise ZooError(f"open_buffer: unknown kind {shared.kind!r}")
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (shared.nbytes,), (1,))


class AckBoard:
    """Progress counters in shared memory: slot ``i`` holds how far reader ``i`` has got (an
    increasing int64). The owner makes the board and shares it; readers raise their slot; the
    owner waits until the slots it needs reach a value - no message to match, so a reader that
    stops early (it raises its slot to the end) never leaves the owner waiting on a message."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # int64 [readers], CPU, shared

    @classmethod
    def create(cls, readers: int) -> tuple["AckBoard", SharedBuffer]:
        raw = torch.zeros(8 * max(readers, 1), dtype=torch.uint8)
        shared = share_buffer(raw)
        return cls(raw.view(torch.int64)), shared

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


__all__ = ["AckBoard", "SharedBuffer", "open_buffer", "share_buffer"]
