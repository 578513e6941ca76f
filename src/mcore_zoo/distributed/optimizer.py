"""Megatron-Core's own training path for a zoo-built model, on the model's process groups.

:func:`wrap_for_training` does what a trainer's setup does with Megatron-Core (no Megatron-LM
``get_model``): wrap each chunk in ``DistributedDataParallel``, build the optimizer with
``get_megatron_optimizer`` (the distributed optimizer by default) and set the config's
``finalize_model_grads_func`` / ``no_sync_func`` so that :func:`~mcore_zoo.distributed.train.train_step`
reduces the gradients through Megatron-Core's schedule. Every piece gets the model's
``pg_collection`` when the model has process groups of its own
(:attr:`~mcore_zoo.placement.Placement.own_groups`), so an actor, a reference and a critic at
different layouts in one job each train on their own groups; a model on the job's parallel state
gets Megatron-Core's defaults.

After ``train_step``, ``optimizer.step()`` returns ``(success, grad_norm, num_zeros)``: the norm is
the one Megatron-Core clips by (``OptimizerConfig.clip_grad``), over every parameter of the model
counted once. On a CPU the optimizer runs through the zoo's CPU patches
(:mod:`mcore_zoo.cpu_shim`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ..handle import ModelHandle, handle_of


@dataclass
class TrainingSetup:
    """What :func:`wrap_for_training` returns.

    Attributes:
        model: the DDP-wrapped chunks as ``build_model`` returned them (one module, or the list of
            virtual-pipeline chunks): what ``train_step`` and ``packed_forward`` take.
        optimizer: Megatron-Core's optimizer over every chunk (``step()``, ``zero_grad()``).
        handle: the model's handle.
    """

    model: Union[torch.nn.Module, list[torch.nn.Module]]
    optimizer: Any
    handle: ModelHandle

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """The wrapped chunks as a list."""
        return self.model if isinstance(self.model, list) else [self.model]

    def zero_grad(self) -> None:
        """Zero the DDP gradient buffers and the optimizer's gradients (before each step)."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()


def wrap_for_training(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    optimizer_config: Any,
    ddp_config: Optional[Any] = None,
) -> TrainingSetup:
    """Wrap a zoo-built model (``build_model``'s result, unwrapped) for training with Megatron-Core's
    DDP and optimizer, on the model's own process groups where it has them (module docstring).

    Args:
        model: the chunk(s) ``build_model`` returned.
        optimizer_config: ``megatron.core.optimizer.OptimizerConfig`` (``optimizer``, ``lr``,
            ``clip_grad``, ``use_distributed_optimizer``, ``bf16`` / ``fp16``, ...).
        ddp_config: ``megatron.core.distributed.DistributedDataParallelConfig``; default: one with
            ``use_distributed_optimizer`` as the optimizer config says and fp32 gradient reduction.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    handle = handle_of(chunks)
    handle.placement.check_holds_model(handle.arch_config.architecture)  # a model placed on other ranks
    if ddp_config is None:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=optimizer_config.use_distributed_optimizer,
                                                   grad_reduce_in_fp32=True)  # fmt: skip
    groups = handle.placement.pg_collection  # None: the job's parallel state (Megatron-Core's default)
    own = {} if groups is None else {"pg_collection": groups}
    wrapped = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0, **own)
        for i, chunk in enumerate(chunks)
    ]  # fmt: skip
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    if groups is not None:  # Megatron-Core takes no gloo groups with a pg_collection
        own["use_gloo_process_groups"] = False
    optimizer = get_megatron_optimizer(optimizer_config, wrapped, **own)
    config.grad_scale_func = optimizer.scale_loss  # fp16's loss scale (1 otherwise)
    return TrainingSetup(wrapped if isinstance(model, (list, tuple)) else wrapped[0], optimizer, handle)


__all__ = ["TrainingSetup", "wrap_for_training"]
