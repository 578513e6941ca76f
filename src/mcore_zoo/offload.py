"""Offload a model's parameters, gradients and optimizer state to host memory and back.

An RL job keeps several models on one set of devices: the reference is needed only for its
forwards, the actor's memory is wanted by the rollout engine while it generates. :func:`offload`
copies every tensor storage the model and its optimizer hold - parameters (or the DDP wrapper's
contiguous parameter buffers), gradients (``.grad``, ``.main_grad``, the DDP gradient buffers) and
the optimizer's state (moments, fp32 main parameters) - into host memory (pinned when the device
is a GPU), then shrinks each device storage to nothing; :meth:`Offloaded.restore` gives every
storage its size back and copies the bytes in. Tensors keep their identity, shapes and views
(parameters stay views of the DDP buffers, the optimizer keeps its references): after the return
every tensor holds the same bits as before.

Storages are copied whole and once each, however many tensors view them. The model must not be
used while it is offloaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch

from .handle import ModelHandle, handle_of


@dataclass
class Offloaded:
    """A model's storages in host memory (:func:`offload`); :meth:`restore` puts them back.

    Attributes:
        nbytes: the bytes moved.
        seconds: the time of the move to the host (``offload``), then of the move back.
        restored: whether :meth:`restore` ran.
    """

    nbytes: int
    seconds: float
    _moved: list[tuple[Any, torch.Tensor]] = field(default_factory=list, repr=False)
    restored: bool = False

    def restore(self) -> "Offloaded":
        """Give every storage its size back and copy its bytes from the host; returns ``self``
        with ``seconds`` the time of this move."""
        if self.restored:
            return self
        start = time.perf_counter()
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        _synchronize(self._moved)
        self.seconds = time.perf_counter() - start
        self._moved = []
        self.restored = True
        return self


def offload(model: Union[ModelHandle, torch.nn.Module, Sequence[torch.nn.Module]], optimizer: Any = None, *,
            parameters: bool = True, gradients: bool = True) -> Offloaded:  # fmt: skip
    """Move the storages of ``model`` (its chunks as the caller holds them: wrapped in DDP or not)
    and of ``optimizer``'s state to host memory (module docstring); returns the :class:`Offloaded`
    whose :meth:`~Offloaded.restore` brings them back. ``parameters`` / ``gradients``: which of
    the model's tensors go (the optimizer's state goes whenever ``optimizer`` is given)."""
    handle_of(model)  # a zoo-built model (any wrapper)
    given = list(model) if isinstance(model, (list, tuple)) else [model]
    tensors: list[torch.Tensor] = []
    if parameters:
        tensors += _parameters(given)
    if gradients:
        tensors += _gradients(given)
    if optimizer is not None:
        tensors += list(_optimizer_tensors(optimizer))
    start = time.perf_counter()
    moved: list[tuple[Any, torch.Tensor]] = []
    seen: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=tensor.is_cuda)
        host.copy_(_bytes_of(storage), non_blocking=True)
        moved.append((storage, host))
    _synchronize(moved)
    for storage, _ in moved:
        storage.resize_(0)
    return Offloaded(sum(h.numel() for _, h in moved), time.perf_counter() - start, moved)


def _bytes_of(storage: Any) -> torch.Tensor:
    """A ``uint8`` tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(moved: Sequence[tuple[Any, torch.Tensor]]) -> None:
    if any(storage.device.type == "cuda" for storage, _ in moved):
        torch.cuda.synchronize()


def _parameters(given: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters, and the DDP wrapper's parameter buffers they view."""
    out = [p.data for chunk in given for p in chunk.parameters()]
    out += [b.param_data for b in _ddp_buffers(given) if getattr(b, "param_data", None) is not None]
    return out


def _gradients(given: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """``.grad`` and ``.main_grad`` of every parameter, and the DDP gradient buffers."""
    out = []
    for chunk in given:
        for p in chunk.parameters():
            out += [g for g in (p.grad, getattr(p, "main_grad", None)) if isinstance(g, torch.Tensor)]
    out += [b.grad_data for b in _ddp_buffers(given) if getattr(b, "grad_data", None) is not None]
    return out


def _ddp_buffers(given: Iterable[torch.nn.Module]) -> list[Any]:
    """Megatron-Core DDP's contiguous parameter-and-gradient buffers (dense and expert); none for an
    unwrapped chunk (whose ``buffers`` is ``nn.Module.buffers``)."""
    found = []
    for chunk in given:
        for name in ("buffers", "expert_parallel_buffers"):
            value = getattr(chunk, name, None)
            if isinstance(value, (list, tuple)):
                found += value
    return found


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``optimizer``'s state and parameter groups: Megatron-Core's optimizers
    (chained, distributed, mixed precision: the inner torch optimizer and its fp32 main
    parameters) or a torch optimizer."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer: Optional[torch.optim.Optimizer] = getattr(inner, "optimizer", inner)
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            continue
        for state in torch_optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                yield p.data
                if isinstance(p.grad, torch.Tensor):
                    yield p.grad


__all__ = ["Offloaded", "offload"]
