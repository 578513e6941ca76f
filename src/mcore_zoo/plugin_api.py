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
  :class:`PackedOutput`, :class:`PackedBatch`;
* the decoder table and checkpoint formats - :func:`decoder_weight_map` (a pre-norm decoder's table
  from its MLP rules and, optionally, its attention rules), :func:`read_quantization` (an FP8
  block-quantized ``quantization_config``);
* mixture of experts (:mod:`mcore_zoo.families.moe`) - the readers :func:`read_expert_counts`,
  :func:`read_sparse_layers`, :func:`read_aux_loss`, :func:`read_no_jitter`,
  :func:`read_shared_experts`, :func:`read_expert_groups`, :func:`read_grouped_sigmoid_router`
  (GLM-4.5 / DeepSeek-V3's router, a whole :class:`MoESpec`), :func:`read_clamped_swiglu` and
  :func:`read_mxfp4_experts` (gpt-oss's experts and MXFP4 checkpoints); the rules
  :func:`routed_expert_rules`, :func:`shared_expert_rules`, :func:`router_expert_bias_rule`,
  :func:`deepseek_moe_rules`, :func:`stacked_expert_rules` (experts stacked in one HF tensor per
  projection), :func:`stacked_transposed_expert_rules` (stacked, gate and up in halves: Qwen3-VL-MoE), :func:`sink_rule` (attention sinks) and the tables :func:`moe_decoder_weight_map`
  (Qwen-MoE naming) and :func:`gpt_oss_weight_map`; the MoE layer spec follows ``arch.moe``;
* multi-head latent attention and the DeepSeek decoder (:mod:`mcore_zoo.families.mla`) -
  :class:`MLASpec`, :func:`read_mla`, :func:`read_deepseek` (a whole DeepSeek-V2 / V3 converter),
  :func:`read_remote_code_names`, :func:`mla_attention_rules`, :func:`deepseek_weight_map`; the MLA
  layer spec follows ``arch.mla``;
* DeepSeek sparse attention (:mod:`mcore_zoo.families.dsa`) - :class:`DSASpec`, :func:`read_dsa`,
  :func:`read_deepseek_dsa` (a whole DeepSeek-V3.2 / GLM-5 converter), :func:`read_glm_indexer_fields`
  (GLM-5's ``indexer_types`` and indexer RoPE fields), :func:`indexer_rules`,
  :func:`dsa_weight_map`; the DSA layer spec follows ``arch.mla.indexer``;
* multi-token prediction (:mod:`mcore_zoo.families.mtp`) - :func:`read_mtp`; the MTP block and its
  rules follow ``arch.mtp_num_layers`` (:func:`decoder_weight_map` adds them);
* gated DeltaNet (:mod:`mcore_zoo.families.gated_deltanet`) - :class:`GatedDeltaNetSpec`,
  :func:`read_gated_deltanet` (``layer_types`` and the ``linear_*`` fields),
  :func:`read_gated_deltanet_mtp` (the ``mtp_*`` fields: none, or dropped on request),
  :func:`read_attention_output_gate` (Qwen3.5's ``attn_output_gate``),
  :func:`refuse_vision_language_config` (``text_config`` / ``vision_config`` refused by name),
  :func:`gated_deltanet_rules`, :func:`gated_attention_rules`, :func:`gated_deltanet_weight_map`
  (Qwen3-Next's and Qwen3.5's table), :func:`hybrid_layer_specs` (the layer spec: gated DeltaNet and gated
  attention layers as ``arch.gated_deltanet.layer_types`` says);
* attention windows - :func:`read_sliding_window` (one ``sliding_window`` for every layer);
* the language model of a vision-language checkpoint - :func:`read_language_model` (``text_config``
  read by the text model's converter, ``vision_config`` recorded as the vision tower's),
  :func:`language_model_weight_map` (a text table under ``model.language_model.``, the vision
  tower's tensors ignored by name), :func:`gated_deltanet_language_model_weight_map` (Qwen3.5's
  language model alone), :func:`gated_deltanet_vision_language_weight_map` (Qwen3.5's, the tower
  under ``model.visual.``);
* vision-language models (:mod:`mcore_zoo.families.vision_language`) - :class:`VisionSpec`,
  :func:`read_qwen2_5_vision`, :func:`read_qwen3_vision`, :func:`read_qwen3_5_vision` (a
  ``vision_config``, passed to ``read_language_model(..., read_vision=...)``),
  :func:`check_tower_fits_decoder`, :func:`check_mrope_sections`,
  :func:`always_interleaved_mrope`, :func:`vision_tower_rules`, :func:`vision_language_weight_map`,
  :func:`qwen2_5_vl_weight_map`, :func:`qwen3_vl_weight_map`, :func:`qwen3_vl_moe_weight_map`,
  :class:`SequenceVisionInputs` and :func:`vision_language_forward` (the entry's ``forward``:
  per-sequence pixels in THD packs).
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
    "read_sliding_window": "mcore_zoo.config.common:read_sliding_window",
    "read_quantization": "mcore_zoo.config.quantization:read_quantization",
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
    "decoder_weight_map": "mcore_zoo.weights.dense:decoder_weight_map",
    # mixture of experts
    "read_expert_counts": "mcore_zoo.families.moe.config:read_expert_counts",
    "read_sparse_layers": "mcore_zoo.families.moe.config:read_sparse_layers",
    "read_aux_loss": "mcore_zoo.families.moe.config:read_aux_loss",
    "read_no_jitter": "mcore_zoo.families.moe.config:read_no_jitter",
    "read_shared_experts": "mcore_zoo.families.moe.config:read_shared_experts",
    "read_expert_groups": "mcore_zoo.families.moe.config:read_expert_groups",
    "read_grouped_sigmoid_router": "mcore_zoo.families.moe.config:read_grouped_sigmoid_router",
    "read_clamped_swiglu": "mcore_zoo.families.moe.config:read_clamped_swiglu",
    "read_mxfp4_experts": "mcore_zoo.families.moe.config:read_mxfp4_experts",
    "stacked_expert_rules": "mcore_zoo.families.moe.weights:stacked_expert_rules",
    "sink_rule": "mcore_zoo.families.moe.weights:sink_rule",
    "gpt_oss_weight_map": "mcore_zoo.families.moe.weights:gpt_oss_weight_map",
    "routed_expert_rules": "mcore_zoo.families.moe.weights:routed_expert_rules",
    "shared_expert_rules": "mcore_zoo.families.moe.weights:shared_expert_rules",
    "router_expert_bias_rule": "mcore_zoo.families.moe.weights:router_expert_bias_rule",
    "deepseek_moe_rules": "mcore_zoo.families.moe.weights:deepseek_moe_rules",
    "moe_decoder_weight_map": "mcore_zoo.families.moe.weights:moe_decoder_weight_map",
    # multi-head latent attention, the DeepSeek decoder
    "MLASpec": "mcore_zoo.config.arch:MLASpec",
    "read_mla": "mcore_zoo.families.mla.config:read_mla",
    "read_deepseek": "mcore_zoo.families.mla.config:read_deepseek",
    "read_remote_code_names": "mcore_zoo.families.mla.config:read_remote_code_names",
    "mla_attention_rules": "mcore_zoo.families.mla.weights:mla_attention_rules",
    "deepseek_weight_map": "mcore_zoo.families.mla.weights:deepseek_weight_map",
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5)
    "DSASpec": "mcore_zoo.config.arch:DSASpec",
    "read_dsa": "mcore_zoo.families.dsa.config:read_dsa",
    "read_deepseek_dsa": "mcore_zoo.families.dsa.config:read_deepseek_dsa",
    "read_glm_indexer_fields": "mcore_zoo.families.dsa.config:read_glm_indexer_fields",
    "indexer_rules": "mcore_zoo.families.dsa.weights:indexer_rules",
    "dsa_weight_map": "mcore_zoo.families.dsa.weights:dsa_weight_map",
    # multi-token prediction
    "read_mtp": "mcore_zoo.families.mtp.config:read_mtp",
    # gated DeltaNet (Qwen3-Next, Qwen3.5)
    "GatedDeltaNetSpec": "mcore_zoo.config.arch:GatedDeltaNetSpec",
    "read_gated_deltanet": "mcore_zoo.families.gated_deltanet.config:read_gated_deltanet",
    "read_gated_deltanet_mtp": "mcore_zoo.families.gated_deltanet.config:read_mtp_fields",
    "read_attention_output_gate": "mcore_zoo.families.gated_deltanet.config:read_attention_output_gate",
    "refuse_vision_language_config": "mcore_zoo.families.gated_deltanet.config:refuse_vision_language_config",
    "gated_attention_rules": "mcore_zoo.families.gated_deltanet.weights:gated_attention_rules",
    "gated_deltanet_rules": "mcore_zoo.families.gated_deltanet.weights:gated_deltanet_rules",
    "gated_deltanet_weight_map": "mcore_zoo.families.gated_deltanet.weights:gated_deltanet_weight_map",
    "gated_deltanet_language_model_weight_map": "mcore_zoo.families.gated_deltanet.weights:language_model_weight_map",
    "gated_deltanet_vision_language_weight_map": "mcore_zoo.families.gated_deltanet.weights:vision_language_weight_map",
    "hybrid_layer_specs": "mcore_zoo.families.gated_deltanet.spec:hybrid_layer_specs",
    # the language model of a vision-language checkpoint
    "read_language_model": "mcore_zoo.config.language_model:read_language_model",
    "language_model_weight_map": "mcore_zoo.weights.language_model:language_model_weight_map",
    # vision-language models (Qwen2.5-VL): the tower, multimodal RoPE, per-sequence vision inputs
    "VisionSpec": "mcore_zoo.config.arch:VisionSpec",
    "read_qwen2_5_vision": "mcore_zoo.families.vision_language.config:read_qwen2_5_vision",
    "read_qwen3_vision": "mcore_zoo.families.vision_language.config:read_qwen3_vision",
    "read_qwen3_5_vision": "mcore_zoo.families.vision_language.config:read_qwen3_5_vision",
    "check_tower_fits_decoder": "mcore_zoo.families.vision_language.config:check_tower_fits_decoder",
    "check_mrope_sections": "mcore_zoo.families.vision_language.config:check_mrope_sections",
    "always_interleaved_mrope": "mcore_zoo.families.vision_language.config:always_interleaved_mrope",
    "qwen3_vl_weight_map": "mcore_zoo.families.vision_language.weights:qwen3_vl_weight_map",
    "qwen3_vl_moe_weight_map": "mcore_zoo.families.vision_language.weights:qwen3_vl_moe_weight_map",
    "stacked_transposed_expert_rules": "mcore_zoo.families.moe.weights:stacked_transposed_expert_rules",
    "vision_tower_rules": "mcore_zoo.families.vision_language.weights:vision_tower_rules",
    "vision_language_weight_map": "mcore_zoo.families.vision_language.weights:vision_language_weight_map",
    "qwen2_5_vl_weight_map": "mcore_zoo.families.vision_language.weights:qwen2_5_vl_weight_map",
    "SequenceVisionInputs": "mcore_zoo.families.vision_language.spec:SequenceVisionInputs",
    "vision_language_forward": "mcore_zoo.families.vision_language.forward:vision_language_forward",
    # layer spec and forward
    "gpt_layer_specs": "mcore_zoo.specs.gpt:gpt_layer_specs",
    "generic_forward": "mcore_zoo.distributed.forward:generic_forward",
    "PackedOutput": "mcore_zoo.packing:PackedOutput",
    "PackedBatch": "mcore_zoo.packing:PackedBatch",
}

__all__ = ["ModelEntry", "Extension", "hookimpl", "FORWARD_CONTRACT", *_LAZY]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
