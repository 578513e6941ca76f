"""Gated DeltaNet linear attention among gated full attention (Qwen3-Next, Qwen3.5): :mod:`.config`
(``layer_types`` and the ``linear_*`` fields -> :class:`~mcore_zoo.config.arch.GatedDeltaNetSpec`),
:mod:`.spec` (the zoo's gated DeltaNet layer in transformers' op order, THD packs reset per
sequence; the gated attention; the hybrid layer specs on ``local``, ``portable`` and ``te``),
:mod:`.kernels` (the layer's kernels: torch or flash-linear-attention's), :mod:`.weights` (the linear-attention and
gated-attention rules, the table of Qwen3-Next and Qwen3.5)."""
