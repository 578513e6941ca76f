"""On ``te``, a profile that runs a THD pack's GEMMs one sequence at a time (``pack_gemms="each"``:
``hf-exact``) takes the zoo's linears - torch's ``F.linear`` per sequence - for every projection:
attention, dense MLP, experts, MLA's projections, the MTP block's ``eh_proj``. Transformer Engine's
GEMM (its own cuBLASLt workspace) is not torch's bits at every row count. Other profiles keep TE's
linears. The specs are assembled on the CPU from the class names (Transformer Engine is absent
here; nothing is built)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import mcore_zoo

pytest.importorskip("megatron.core")


def _arch(name, **fields):
    architecture = mcore_zoo.lookup(name)
    return architecture.config_from_hf({**architecture.example_config(), **fields})


def _linears(spec, path="layer"):
    """``{path: class}`` of every linear (a field named ``linear_*`` or ``eh_proj``) in a spec tree."""
    found = {}
    if isinstance(spec, (list, tuple)):
        for i, item in enumerate(spec):
            found.update(_linears(item, f"{path}.{i}"))
        return found
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return found
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        where = f"{path}.{field.name}"
        if field.name.startswith("linear_") or field.name == "eh_proj":
            module = getattr(value, "module", value)
            found[where] = module.func if isinstance(module, functools.partial) else module
        found.update(_linears(value, where))
    return found


def _te_classes(linears):
    """The entries of ``linears`` that are Transformer Engine's linears (without TE installed,
    placeholders of Megatron-Core's TE module: compared by identity)."""
    from megatron.core.extensions import transformer_engine as te

    names = ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear")
    own = [getattr(te, name) for name in names]
    return {path: cls for path, cls in linears.items() if any(cls is c for c in own)}


@pytest.mark.parametrize("name,moe", [("Qwen3MoeForCausalLM", True), ("Qwen2ForCausalLM", False),
                                      ("DeepseekV3ForCausalLM", True)])  # fmt: skip
def test_hf_exact_on_te_takes_the_zoos_linears(te_named, name, moe):
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.specs.gpt import gpt_layer_spec
    from mcore_zoo.specs.linears import FusedBiasColumnParallelLinear, FusedBiasRowParallelLinear

    spec = gpt_layer_spec(_arch(name), "te", get_profile("hf-exact"), moe=moe)
    linears = _linears(spec)
    assert linears and not _te_classes(linears), _te_classes(linears)
    attention = spec.submodules.self_attention.submodules
    assert attention.linear_proj is FusedBiasRowParallelLinear
    qkv = getattr(attention, "linear_qkv", None) or attention.linear_kv_up_proj
    assert qkv is FusedBiasColumnParallelLinear
    assert any(cls is FusedBiasRowParallelLinear for path, cls in linears.items() if "mlp" in path)


@pytest.mark.parametrize("profile", ["default", "training"])
def test_other_profiles_keep_te_linears(te_named, profile):
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.specs.gpt import gpt_layer_spec

    spec = gpt_layer_spec(_arch("Qwen3MoeForCausalLM"), "te", get_profile(profile), moe=True)
    linears = _linears(spec)
    assert linears and _te_classes(linears) == linears


def test_mtp_eh_proj_follows_the_profile(te_named):
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mcore_zoo.families.mtp.spec import mtp_block_spec
    from mcore_zoo.numerics.profiles import get_profile

    arch = _arch("DeepseekV3ForCausalLM", num_nextn_predict_layers=1)
    exact = mtp_block_spec(arch, "te", get_profile("hf-exact"))
    assert not _te_classes(_linears(exact, "mtp"))
    assert exact.submodules.layer_specs[0].submodules.eh_proj is ColumnParallelLinear
    stock = mtp_block_spec(arch, "te", get_profile("default"))
    assert stock.submodules.layer_specs[0].submodules.eh_proj is TEColumnParallelLinear
