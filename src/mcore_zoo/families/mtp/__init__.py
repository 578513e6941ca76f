"""Multi-token prediction (DeepSeek-V3, GLM-4.5): :mod:`.config` (``num_nextn_predict_layers``),
:mod:`.spec` (Megatron-Core's MTP block and the ``GPTModel`` whose output carries its logits),
:mod:`.weights` (the MTP layers' rules and the checkpoint's copies of the embedding and head)."""
