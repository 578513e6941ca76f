"""Mixture of experts: :mod:`.config` (HF MoE fields -> :class:`~mcore_zoo.config.arch.MoESpec`,
``MoESpec`` -> ``TransformerConfig`` fields), :mod:`.spec` (Megatron-Core's ``MoELayer`` with the
zoo's HF-order router and experts), :mod:`.weights` (router, expert and shared-expert rules)."""
