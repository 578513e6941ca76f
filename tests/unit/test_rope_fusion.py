"""When Transformer Engine's fused RoPE kernel is asked for. Its THD form rotates each packed
sequence's rows by their position inside the sequence (``freqs[0:len]``), so it cannot take
multimodal RoPE's per-token angles (image tokens share positions): a vision-language model on
``te`` must keep the unfused rotation, which applies the angles row by row."""

from __future__ import annotations

import pytest

import mcore_zoo

pytest.importorskip("megatron.core")


def _apply_rope_fusion(name: str) -> bool:
    from mcore_zoo.config.transformer import BuildOptions, transformer_config_kwargs
    from mcore_zoo.numerics.profiles import get_profile

    architecture = mcore_zoo.lookup(name)
    arch = architecture.config_from_hf(architecture.example_config())
    options = BuildOptions(backend="te", numerics=get_profile("default").for_device(True))  # a CUDA build's knobs
    return transformer_config_kwargs(arch, options)["apply_rope_fusion"]


def test_text_models_on_te_keep_the_fused_rope_kernel():
    assert _apply_rope_fusion("Qwen3ForCausalLM")


@pytest.mark.parametrize("name", ["Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                                  "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration"])  # fmt: skip
def test_multimodal_rope_is_never_fused(name):
    assert not _apply_rope_fusion(name)
