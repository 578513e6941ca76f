"""Gated DeltaNet linear attention among gated full attention (Qwen3-Next, Qwen3.5): :mod:`.config`
(``layer_types`` and the ``linear_*`` fields -> :class:`~mcore_zoo.config.arch.GatedDeltaNetSpec`),
:mod:`.spec` (the portable gated DeltaNet layer in transformers' op order, THD packs reset per
sequence; the gated attention; the hybrid layer specs), :mod:`.weights` (the linear-attention and
gated-attention rules, the table of Qwen3-Next and Qwen3.5)."""
