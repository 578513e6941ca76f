"""The stable API for plugin authors: everything a plugin package imports from mcore-zoo.

Out-of-tree plugins import from here (never from internal modules), so that the zoo can move its
internals without breaking them::

    from mcore_zoo.plugin_api import ModelEntry, hookimpl          # cheap: module import time

    def weight_map(arch):                                          # heavy names: inside functions
        from mcore_zoo.plugin_api import dense_decoder_weight_map
        return dense_decoder_weight_map(arch)

Importing this module is cheap: ``ModelEntry``, ``Extension`` and ``hookimpl`` are loaded eagerly,
every other name (config readers, weight-table helpers, layer specs, the generic forward) on first
access.

Groups:

* registration - :class:`ModelEntry`, :class:`Extension`, :data:`hookimpl`,
  :data:`FORWARD_CONTRACT`;
* config conversion - :class:`ConfigReader`, :class:`ArchConfig`, :class:`RopeSpec`,
  :class:`MoESpec`, :func:`read_dense_decoder`, :func:`classify_common_fields`,
  :func:`read_layer_types`, :func:`read_qwen_window`;
* weight table - :class:`WeightMap`, :class:`Rule`, :class:`Source`, :class:`Transform`,
  :class:`TransformContext`, the transforms :data:`QKV` / :data:`GATE_UP`, the rule constructors
  (:func:`rule`, :func:`replicated`, :func:`column_parallel`, :func:`row_parallel`,
  :func:`fused_qkv`, :func:`fused_gate_up`, :func:`split_rows`) and the Llama-like pieces
  (:data:`LAYER`, :data:`HF_LAYER`, :data:`ROTARY_BUFFER_IGNORED`, :func:`embedding_rules`,
  :func:`attention_rules`, :func:`gated_mlp_rules`, :func:`tied_lm_head_ignored`,
  :func:`dense_decoder_weight_map`);
* layer spec and forward - :func:`gpt_layer_specs`, :func:`generic_forward`,
  :class:`PackedOutput`, :class:`PackedBatch`.
"""

from __future__ import annotations

from ._lazy import lazy_attributes
from .entry import FORWARD_CONTRACT, Extension, ModelEntry
from .hookspecs import hookimpl

_LAZY = {
    # config conversion
    "ConfigReader": "mcore_zoo.config.reader:ConfigReader",
    "ArchConfig": "mcore_zoo.config.arch:ArchConfig",
    "RopeSpec": "mcore_zoo.config.arch:RopeSpec",
    "MoESpec": "mcore_zoo.config.arch:MoESpec",
    "read_dense_decoder": "mcore_zoo.config.common:read_dense_decoder",
    "classify_common_fields": "mcore_zoo.config.common:classify_common_fields",
    "read_layer_types": "mcore_zoo.config.common:read_layer_types",
    "read_qwen_window": "mcore_zoo.config.common:read_qwen_window",
    # weight table
    "WeightMap": "mcore_zoo.weights.rules:WeightMap",
    "Rule": "mcore_zoo.weights.rules:Rule",
    "Source": "mcore_zoo.weights.rules:Source",
    "Transform": "mcore_zoo.weights.rules:Transform",
    "TransformContext": "mcore_zoo.weights.rules:TransformContext",
    "QKV": "mcore_zoo.weights.rules:QKV",
    "GATE_UP": "mcore_zoo.weights.rules:GATE_UP",
    "rule": "mcore_zoo.weights.rules:rule",
    "replicated": "mcore_zoo.weights.rules:replicated",
    "column_parallel": "mcore_zoo.weights.rules:column_parallel",
    "row_parallel": "mcore_zoo.weights.rules:row_parallel",
    "fused_qkv": "mcore_zoo.weights.rules:fused_qkv",
    "fused_gate_up": "mcore_zoo.weights.rules:fused_gate_up",
    "split_rows": "mcore_zoo.weights.rules:split_rows",
    "LAYER": "mcore_zoo.weights.dense:LAYER",
    "HF_LAYER": "mcore_zoo.weights.dense:HF_LAYER",
    "ROTARY_BUFFER_IGNORED": "mcore_zoo.weights.dense:ROTARY_BUFFER_IGNORED",
    "embedding_rules": "mcore_zoo.weights.dense:embedding_rules",
    "attention_rules": "mcore_zoo.weights.dense:attention_rules",
    "gated_mlp_rules": "mcore_zoo.weights.dense:gated_mlp_rules",
    "tied_lm_head_ignored": "mcore_zoo.weights.dense:tied_lm_head_ignored",
    "dense_decoder_weight_map": "mcore_zoo.weights.dense:dense_decoder_weight_map",
    # layer spec and forward
    "gpt_layer_specs": "mcore_zoo.specs.gpt:gpt_layer_specs",
    "generic_forward": "mcore_zoo.distributed.forward:generic_forward",
    "PackedOutput": "mcore_zoo.packing:PackedOutput",
    "PackedBatch": "mcore_zoo.packing:PackedBatch",
}

__all__ = ["ModelEntry", "Extension", "hookimpl", "FORWARD_CONTRACT", *_LAZY]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
