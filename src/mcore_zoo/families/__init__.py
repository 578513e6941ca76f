"""Architecture families: the pieces several plugins share, each family kept in one place.

A family is what a decoder adds to the dense Llama-like one (:mod:`mcore_zoo.config.common`,
:mod:`mcore_zoo.weights.dense`, :mod:`mcore_zoo.specs.gpt`), in three modules:

* ``config.py`` - reading its HF config fields into the :class:`~mcore_zoo.config.arch.ArchConfig`
  (description level: config, weights, registration and support modules only);
* ``spec.py`` - its Megatron-Core layer spec and modules (model level), picked by
  :func:`mcore_zoo.specs.gpt.gpt_layer_specs` from the ``ArchConfig`` - or, where the family's
  layers replace the attention layer itself, its own block spec, named as the entry's
  ``layer_spec`` (gated DeltaNet);
* ``weights.py`` - its weight rules (description level).

Families:

* :mod:`.moe` - mixture of experts: the router kinds (softmax top-k, the grouped sigmoid router
  with expert bias), shared experts, dense / MoE layer patterns, the expert weight rules;
* :mod:`.mla` - multi-head latent attention and the DeepSeek-V2 / V3 decoder around it;
* :mod:`.mtp` - multi-token prediction layers (DeepSeek-V3, GLM-4.5);
* :mod:`.gated_deltanet` - gated DeltaNet linear attention among gated full attention (Qwen3-Next,
  Qwen3.5).

Plugins reach the families only through :mod:`mcore_zoo.plugin_api`.
"""
