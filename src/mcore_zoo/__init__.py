"""mcore-zoo: Hugging Face causal-LM architectures on Megatron-Core ``GPTModel``, with parity proofs.

Public API (everything else is internal)::

    import mcore_zoo

    arch = mcore_zoo.lookup("path/to/checkpoint")          # or an HF config / arch name
    model = mcore_zoo.build_model("path/to/checkpoint", backend="te", load="path/to/checkpoint")
    out = mcore_zoo.packed_forward(model, [ids_a, ids_b])   # THD packing, per-sequence logprobs
    for name, tensor in mcore_zoo.iter_hf_weights(model):    # streaming export to HF names
        ...

Parallel layouts (TP / SP / PP / VPP / CP) go through the same calls; see docs/parallel.md
(``iter_hf_buckets``, ``iter_hf_shards``, ``load_mcore_checkpoint``); ``packed_forward`` runs
every layout; ``train_step`` is its differentiable twin for training (a trainer's loss inside
Megatron-Core's schedule; docs/trainer-integration.md).

Importing this package is cheap: Megatron-Core, Transformer Engine and transformers are imported
only by the functions that need them.
"""

from __future__ import annotations


from ._lazy import lazy_attributes
from ._version import __version__
from .entry import Extension, ModelEntry
from .errors import (
    CheckpointFormatError,
    ConfigError,
    LayoutError,
    MissingTensorsError,
    NotOnThisRankError,
    PluginConflictError,
    PluginError,
    ShapeMismatchError,
    UnclassifiedConfigFieldsError,
    UnexpectedTensorsError,
    UnknownArchitectureError,
    UnmappedParametersError,
    UnsupportedConfigError,
    UnsupportedLayoutError,
    WeightMapError,
    ZooError,
)
from .hookspecs import hookimpl, hookspec
from .registry import Registry, get_registry, lookup

#: name -> "module:attr", imported on first access
_LAZY = {
    "Architecture": "mcore_zoo.architecture:Architecture",
    "ArchConfig": "mcore_zoo.config.arch:ArchConfig",
    "RopeSpec": "mcore_zoo.config.arch:RopeSpec",
    "MoESpec": "mcore_zoo.config.arch:MoESpec",
    "Parallelism": "mcore_zoo.placement:Parallelism",
    "Placement": "mcore_zoo.placement:Placement",
    "ConfigReader": "mcore_zoo.config.reader:ConfigReader",
    "FieldReport": "mcore_zoo.config.reader:FieldReport",
    "NumericsProfile": "mcore_zoo.numerics.profiles:NumericsProfile",
    "get_profile": "mcore_zoo.numerics.profiles:get_profile",
    "build_model": "mcore_zoo.distributed.build:build_model",
    "prepare": "mcore_zoo.build:prepare",
    "BuildPlan": "mcore_zoo.build:BuildPlan",
    "model_provider": "mcore_zoo.build:model_provider",
    "BuildRequest": "mcore_zoo.build:BuildRequest",
    "handle_of": "mcore_zoo.handle:handle_of",
    "ModelHandle": "mcore_zoo.handle:ModelHandle",
    "ensure_model_parallel": "mcore_zoo.parallel:ensure_model_parallel",
    "WeightMap": "mcore_zoo.weights.rules:WeightMap",
    "Rule": "mcore_zoo.weights.rules:Rule",
    "Source": "mcore_zoo.weights.rules:Source",
    "rule": "mcore_zoo.weights.rules:rule",
    "split_rows": "mcore_zoo.weights.rules:split_rows",
    "QKV": "mcore_zoo.weights.rules:QKV",
    "GATE_UP": "mcore_zoo.weights.rules:GATE_UP",
    "read_dense_decoder": "mcore_zoo.config.common:read_dense_decoder",
    "classify_common_fields": "mcore_zoo.config.common:classify_common_fields",
    "HFCheckpoint": "mcore_zoo.weights.io:HFCheckpoint",
    "load_hf_weights": "mcore_zoo.distributed.load:load_hf_weights",
    "load_hf_state_dict": "mcore_zoo.distributed.load:load_hf_state_dict",
    "iter_hf_weights": "mcore_zoo.distributed.export:iter_hf_weights",
    "iter_hf_buckets": "mcore_zoo.distributed.export:iter_hf_buckets",
    "iter_hf_shards": "mcore_zoo.distributed.export:iter_hf_shards",
    "save_hf_checkpoint": "mcore_zoo.distributed.export:save_hf_checkpoint",
    "generic_forward": "mcore_zoo.distributed.forward:generic_forward",
    "launch": "mcore_zoo.distributed.launch:launch",
    "load_mcore_checkpoint": "mcore_zoo.dist_checkpoint:load_mcore_checkpoint",
    "PackedBatch": "mcore_zoo.packing:PackedBatch",
    "PackedOutput": "mcore_zoo.packing:PackedOutput",
    "pack_sequences": "mcore_zoo.packing:pack_sequences",
    "packed_forward": "mcore_zoo.distributed.forward:packed_forward",
    "train_step": "mcore_zoo.distributed.train:train_step",
    "wrap_for_training": "mcore_zoo.distributed.optimizer:wrap_for_training",
    "TrainingSetup": "mcore_zoo.distributed.optimizer:TrainingSetup",
    "copy_weights": "mcore_zoo.distributed.copy:copy_weights",
    "offload": "mcore_zoo.offload:offload",
    "Offloaded": "mcore_zoo.offload:Offloaded",
    "TokenOutputs": "mcore_zoo.distributed.train:TokenOutputs",
    "StepResult": "mcore_zoo.distributed.train:StepResult",
    "token_logprobs_and_entropy": "mcore_zoo.distributed.vocab_parallel:token_logprobs_and_entropy",
    "partition_by_tokens": "mcore_zoo.distributed.forward:partition_by_tokens",
    "plan_microbatches": "mcore_zoo.distributed.microbatches:plan_microbatches",
    "alignment_for": "mcore_zoo.packing:alignment_for",
    "ParityOptions": "mcore_zoo.parity.harness:ParityOptions",
    "run_parity": "mcore_zoo.parity.harness:run_parity",
    "refit": "mcore_zoo.rollout.refit:refit",
    "RefitGroup": "mcore_zoo.distributed.refit_group:RefitGroup",
    "DisaggSender": "mcore_zoo.rollout.disagg:DisaggSender",
    "EngineReceiver": "mcore_zoo.rollout.disagg:EngineReceiver",
    "refit_time_at_scale": "mcore_zoo.rollout.scale:refit_time_at_scale",
    "megatron_patches": "mcore_zoo.specs.patching:patches",
}

__all__ = [
    "__version__",
    "ModelEntry",
    "Extension",
    "hookimpl",
    "hookspec",
    "Registry",
    "get_registry",
    "lookup",
    "ZooError",
    "ConfigError",
    "UnsupportedConfigError",
    "UnclassifiedConfigFieldsError",
    "LayoutError",
    "UnsupportedLayoutError",
    "NotOnThisRankError",
    "PluginError",
    "PluginConflictError",
    "UnknownArchitectureError",
    "WeightMapError",
    "MissingTensorsError",
    "UnexpectedTensorsError",
    "UnmappedParametersError",
    "ShapeMismatchError",
    "CheckpointFormatError",
    *_LAZY,
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
