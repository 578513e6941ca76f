"""The ``te`` layer specs of the gated DeltaNet models (Qwen3-Next, Qwen3.5 dense and MoE), assembled
on the CPU (Transformer Engine is absent here: the specs name its classes, nothing is built).
Transformer Engine's linears, attention and zero-centred norms (``zero_centered_gamma``) around the
zoo's gated DeltaNet layer, which keeps a norm of its own before it; the gated attention keeps the
sigmoid output gate in transformers' op order."""

from __future__ import annotations

import pytest

import mcore_zoo

pytest.importorskip("megatron.core")


def _layer_specs(name, profile):
    from mcore_zoo.config.transformer import BuildOptions, transformer_config_class, transformer_config_kwargs
    from mcore_zoo.families.gated_deltanet.spec import hybrid_layer_specs
    from mcore_zoo.numerics.profiles import get_profile

    architecture = mcore_zoo.lookup(name)
    arch = architecture.config_from_hf(architecture.example_config())
    numerics = get_profile(profile)
    options = BuildOptions(backend="te", numerics=numerics.for_device(False), cpu=True)  # no fused RoPE here
    kwargs = transformer_config_kwargs(arch, options)
    config = transformer_config_class(arch)(**kwargs)
    return arch, config, hybrid_layer_specs(arch, "te", numerics, config=config)


@pytest.mark.parametrize("name", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_te_builds_te_modules_around_the_zoos_gated_deltanet(te_named, mpu, name):
    from megatron.core.extensions.transformer_engine import (
        TEDotProductAttention, TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear,
    )  # fmt: skip

    from mcore_zoo.families.gated_deltanet.spec import gated_attention_class, gated_deltanet_class

    arch, config, block = _layer_specs(name, "default")
    assert config.layernorm_zero_centered_gamma  # TE's norms scale by 1 + weight
    assert block.layer_norm is TENorm
    for index, layer in enumerate(block.layer_specs):
        mixer = layer.submodules.self_attention
        if arch.gated_deltanet.is_linear_layer(index):
            assert mixer.module is gated_deltanet_class() and mixer.params["kernel"] == "auto"
            assert layer.submodules.input_layernorm is TENorm  # no linear_qkv to fuse it into
            assert layer.submodules.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"
        else:
            assert mixer.module is gated_attention_class()
            assert mixer.submodules.linear_qkv is TELayerNormColumnParallelLinear
            assert mixer.submodules.core_attention is TEDotProductAttention
            assert mixer.submodules.linear_proj is TERowParallelLinear
            assert mixer.submodules.q_layernorm is TENorm


def test_te_with_hf_norms_keeps_transformers_zero_centred_norm(te_named, mpu):
    """``norm="hf"`` profiles (``training``, ``hf-exact``) on ``te``: the zoo's zero-centred RMSNorm in
    transformers' op order, not fused; the gated DeltaNet layer on the torch kernels."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    from mcore_zoo.specs.norms import ZeroCenteredRMSNorm

    _, _, block = _layer_specs("Qwen3NextForCausalLM", "training")
    assert block.layer_norm is ZeroCenteredRMSNorm
    linear, attention = block.layer_specs[0], block.layer_specs[3]
    assert linear.submodules.input_layernorm is ZeroCenteredRMSNorm
    assert linear.submodules.self_attention.params["kernel"] == "torch"
    assert attention.submodules.self_attention.submodules.linear_qkv is TEColumnParallelLinear
