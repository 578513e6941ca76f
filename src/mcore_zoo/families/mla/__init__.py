"""Multi-head latent attention and the DeepSeek-V2 / V3 decoder: :mod:`.config` (MLA fields,
the DeepSeek converter), :mod:`.spec` (Megatron-Core's ``MLASelfAttention`` with HF's RoPE, scale
and latent norms), :mod:`.weights` (the MLA rules, the DeepSeek weight table)."""
