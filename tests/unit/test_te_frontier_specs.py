"""The ``te`` layer specs of gpt-oss, DeepSeek-V3.2 and GLM-5, assembled on the CPU (Transformer Engine
is absent here: the specs name its classes, nothing is built). Their core attention stays the zoo's:
attention sinks in transformers' softmax order (``PortableAttention``, eager) and DeepSeek sparse
attention over the indexer's selection (``SparsePortableAttention``), between TE's linears and norms.
A model without sinks keeps Transformer Engine's own attention."""

from __future__ import annotations

import functools

import pytest

import mcore_zoo

pytest.importorskip("megatron.core")


def _arch(name):
    architecture = mcore_zoo.lookup(name)
    return architecture.config_from_hf(architecture.example_config())


def _module(spec):
    spec = getattr(spec, "module", spec)
    return spec.func if isinstance(spec, functools.partial) else spec


def test_gpt_oss_te_keeps_the_zoos_sink_attention(te_named):
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear

    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.specs.gpt import gpt_layer_spec
    from mcore_zoo.specs.portable import PortableAttention

    spec = gpt_layer_spec(_arch("GptOssForCausalLM"), "te", get_profile("default"), moe=True)
    attention = spec.submodules.self_attention.submodules
    assert _module(attention.core_attention) is PortableAttention
    assert attention.core_attention.keywords["kernel"] == "eager"
    assert attention.linear_qkv is TELayerNormColumnParallelLinear
    assert attention.linear_proj is TERowParallelLinear


def test_a_model_without_sinks_keeps_te_attention(te_named):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.specs.gpt import gpt_layer_spec

    spec = gpt_layer_spec(_arch("LlamaForCausalLM"), "te", get_profile("default"))
    assert spec.submodules.self_attention.submodules.core_attention is TEDotProductAttention


@pytest.mark.parametrize("name", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_dsa_te_is_sparse_attention_between_te_linears(te_named, name):
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from mcore_zoo.families.dsa.spec import SparsePortableAttention, _dsa_attention_class
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.specs.gpt import gpt_layer_spec

    spec = gpt_layer_spec(_arch(name), "te", get_profile("default"), moe=True)
    attention = spec.submodules.self_attention
    assert attention.module is _dsa_attention_class()
    assert _module(attention.submodules.core_attention) is SparsePortableAttention
    assert attention.submodules.linear_q_up_proj is TEColumnParallelLinear
    assert attention.submodules.linear_kv_up_proj is TEColumnParallelLinear
    assert attention.submodules.linear_proj is TERowParallelLinear
