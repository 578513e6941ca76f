"""Vision-language models (Qwen2.5-VL): a vision tower before a Megatron-Core decoder with
multimodal RoPE.

* :mod:`.config` - a ``vision_config`` -> :class:`~mcore_zoo.config.arch.VisionSpec`, one tower
  reader per ``VisionSpec.kind`` (``read_qwen2_5_vision``);
* :mod:`.positions` - the 3-D multimodal RoPE position ids of one sequence, as transformers'
  ``get_rope_index``;
* :mod:`.vision` - the towers as zoo modules in transformers' op order (``TOWERS``, by kind);
* :mod:`.spec` - the tower attached to the first stage's ``GPTModel`` and the pre-hook that gives
  the decoder its embeddings (image / video tokens replaced by merged features) and position ids;
  the per-sequence input contract ``SequenceVisionInputs``;
* :mod:`.weights` - the tower's rules beside the language model's (``TOWER_TENSORS``, by kind);
* :mod:`.forward` - ``vision_language_forward``: ``packed_forward`` with per-sequence vision inputs.

Extension points for the next towers: a ``VisionSpec.kind`` with its reader, its module in
``vision.TOWERS`` and its names in ``weights.TOWER_TENSORS``; interleaved multimodal RoPE
(Qwen3-VL, ``mrope_interleaved``) in the RoPE reader and the rotary module; deepstack features
(Qwen3-VL) as extra outputs of the tower added to the first decoder layers' input.
"""
