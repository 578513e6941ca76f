"""The numerics knob ``grouped_experts`` (Megatron-Core's ``TEGroupedMLP``): where it is refused,
the layer spec it selects, and the weight names the rules bind to.

Transformer Engine is not installed on the CPU, so the grouped experts built here use the
stand-in grouped linears of ``tests/te_grouped_standin.py`` (TE's parameter names, shapes and
``(x, m_splits)`` contract; see its docstring for what that does and does not check). The
numerics, EP and export checks with them live in ``tests/parity/test_grouped_experts.py`` and
``tests/distributed/test_grouped_experts_layouts.py``; the real TE kernels in
``tests/gpu/test_grouped_experts_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError
from mcore_zoo.numerics.profiles import PROFILES, get_profile
from mcore_zoo.weights.rules import grouped_expert_name

from ..te_grouped_standin import StandInColumnParallelGroupedLinear, StandInRowParallelGroupedLinear, installed

MOE = "Qwen3MoeForCausalLM"


def _grouped(profile: str = "default", **knobs):
    return get_profile(profile).with_knobs(grouped_experts=True, **knobs)


def test_the_knob_is_off_in_every_builtin_profile_and_a_bool():
    assert {name: p.grouped_experts for name, p in PROFILES.items()} == dict.fromkeys(PROFILES, False)
    assert _grouped().grouped_experts is True and _grouped("training").grouped_experts is True
    with pytest.raises(ZooError, match="grouped_experts='yes' must be true or false"):
        get_profile("default").with_knobs(grouped_experts="yes")


@pytest.mark.parametrize("profile", ["hf-exact", "hf-exact-sdpa"])
def test_hf_exact_profiles_refuse_grouped_experts(profile):
    with pytest.raises(ZooError, match=rf"{profile}\+grouped_experts=True.*refused.*sequential experts"):
        get_profile(profile).with_knobs(grouped_experts=True)
    # also when other knobs are flipped first (the profile is still hf-exact by name)
    with pytest.raises(ZooError, match="refused"):
        get_profile(profile).with_knobs(router="mcore").with_knobs(grouped_experts=True)


@pytest.mark.parametrize("backend", ["local", "portable"])
def test_non_te_backends_refuse_grouped_experts(mpu, reference_checkpoint, backend):
    ckpt = reference_checkpoint(MOE)
    with pytest.raises(ZooError, match=rf"grouped_experts=True needs backend 'te'.*backend '{backend}'"):
        mcore_zoo.build_model(ckpt, backend=backend, numerics=_grouped())


def test_the_te_backend_on_the_cpu_refuses_grouped_experts(mpu, reference_checkpoint):
    with pytest.raises(ZooError, match="grouped_experts=True .*needs a CUDA device"):
        mcore_zoo.build_model(reference_checkpoint(MOE), backend="te", numerics=_grouped())


def test_the_layer_spec_refuses_grouped_experts_off_te():
    """The spec checks too (an architecture's layer specs can be asked for directly)."""
    from mcore_zoo.specs.gpt import gpt_layer_spec

    arch = mcore_zoo.lookup(MOE).config_from_hf(mcore_zoo.lookup(MOE).example_config())
    with pytest.raises(ZooError, match="backend 'local'"):
        gpt_layer_spec(arch, "local", _grouped(), moe=True)


def test_a_config_override_cannot_disagree_with_the_knob(mpu, reference_checkpoint):
    with pytest.raises(ZooError, match="moe_grouped_gemm=True.*grouped_experts is False"):
        mcore_zoo.build_model(reference_checkpoint(MOE), backend="local", overrides={"moe_grouped_gemm": True})


def test_a_dense_model_ignores_the_knob(mpu, reference_checkpoint):
    model = mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local", numerics=_grouped())
    assert not getattr(model.config, "moe_grouped_gemm", False)


def test_without_transformer_engine_megatron_offers_no_te_grouped_experts():
    """On this CPU machine Megatron-Core's TE spec provider falls back to another module; the zoo
    refuses it instead of building that."""
    pytest.importorskip("megatron.core")
    from mcore_zoo.compat import te_grouped_experts
    from mcore_zoo.specs.gpt import have_transformer_engine

    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ZooError, match="instead of TEGroupedMLP"):
        te_grouped_experts()


@pytest.mark.parametrize("router", ["hf", "mcore"])
def test_the_experts_spec_is_megatrons_own_te_grouped_spec(router):
    """With TE's grouped linears present, the experts submodule equals what Megatron-Core's own
    ``get_moe_module_spec(use_te=True, moe_grouped_gemm=True)`` builds (the MoE part of
    ``get_gpt_layer_with_transformer_engine_spec``), the module swapped for the HF-order subclass
    under ``router="hf"``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from mcore_zoo.families.moe.spec import hf_grouped_experts_class, moe_mlp_submodule

    arch = mcore_zoo.lookup(MOE).config_from_hf(mcore_zoo.lookup(MOE).example_config())
    pieces = {"linear_fc1": object(), "linear_fc2": object()}

    def experts_of(mlp):
        sub = getattr(mlp, "submodules", None) or mlp.keywords["submodules"]
        e = sub.experts
        return (e.module, e.submodules) if hasattr(e, "module") else (e.func, e.keywords["submodules"])

    with installed():
        ours = experts_of(moe_mlp_submodule(arch, pieces, router, "grouped_mm", grouped=True))
        stock = experts_of(get_moe_module_spec(use_te=True, num_experts=8, moe_grouped_gemm=True))
        sequential = experts_of(moe_mlp_submodule(arch, pieces, router, "grouped_mm", grouped=False))
    assert stock[0] is TEGroupedMLP
    assert ours[0] is (hf_grouped_experts_class("grouped_mm") if router == "hf" else TEGroupedMLP)
    assert issubclass(ours[0], TEGroupedMLP)
    assert ours[1] == stock[1]
    assert ours[1].linear_fc1 is StandInColumnParallelGroupedLinear and ours[1].linear_fc2 is StandInRowParallelGroupedLinear
    assert not issubclass(sequential[0], TEGroupedMLP)


def test_grouped_expert_names():
    assert grouped_expert_name("decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight") == \
        "decoder.layers.3.mlp.experts.linear_fc1.weight12"  # fmt: skip
    assert grouped_expert_name("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias") == \
        "decoder.layers.0.mlp.experts.linear_fc2.bias0"  # fmt: skip
    assert grouped_expert_name("mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.7.linear_fc2.weight") == \
        "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc2.weight7"  # fmt: skip
    for other in ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                  "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.layer_norm_weight",
                  "decoder.layers.0.mlp.router.weight"):  # fmt: skip
        assert grouped_expert_name(other) is None, other


def _standin_profile(router: str = "hf"):
    """hf-exact's knobs with grouped experts: allowed under another name (the stand-in GEMMs are
    the sequential ones, so HF's op order still holds; see tests/te_grouped_standin.py)."""
    return dataclasses.replace(get_profile("hf-exact").with_knobs(router=router), name="standin-grouped", grouped_experts=True)


def test_grouped_parameters_are_te_names_and_shapes_and_all_bound(mpu, reference_checkpoint):
    """Every expert parameter of the grouped model is ``linear_fc{1,2}.weight{i}`` with the
    sequential expert's shape, and the weight map binds each to HF expert ``i`` (one EP rank)."""
    from mcore_zoo.handle import handle_of

    ckpt = reference_checkpoint(MOE)
    with installed():
        model = mcore_zoo.build_model(ckpt, backend="local", numerics=_standin_profile())
    arch = handle_of(model).arch_config
    E, I, H = arch.moe.num_experts, arch.moe.expert_ffn_hidden_size, arch.hidden_size
    assert model.config.moe_grouped_gemm is True
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    moe_layers = [layer for layer in range(arch.num_layers) if arch.moe.is_moe_layer(layer)]
    assert moe_layers
    want = {}
    for layer in moe_layers:
        for i in range(E):
            want[f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{i}"] = (2 * I, H)
            want[f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{i}"] = (H, I)
    assert {n: tuple(p.shape) for n, p in experts.items()} == want
    bound = {b.mcore: b for b in handle_of(model).bound_rules(model)}
    for layer in moe_layers:
        for i in range(E):
            fc1 = bound[f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{i}"]
            assert fc1.hf == (f"model.layers.{layer}.mlp.experts.{i}.gate_proj.weight",
                              f"model.layers.{layer}.mlp.experts.{i}.up_proj.weight")  # fmt: skip
            assert fc1.expert == i and fc1.is_expert and fc1.tp_axes == (0, 0)
            fc2 = bound[f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{i}"]
            assert fc2.hf == (f"model.layers.{layer}.mlp.experts.{i}.down_proj.weight",) and fc2.tp_axes == (1,)
    # the bound rules are the sequential model's, renamed
    seq = mcore_zoo.build_model(ckpt, backend="local", numerics="hf-exact")
    seq_bound = handle_of(seq).bound_rules(seq)
    assert sorted(b.hf for b in seq_bound) == sorted(b.hf for b in bound.values())


def test_an_expert_parameter_without_a_rule_fails_the_load(mpu, reference_checkpoint):
    """Fail closed: a grouped parameter the rules do not know (here a single stacked ``weight``,
    the layout of Megatron-Core 0.19's ``moe_single_grouped_weight``) is named, not left at its
    random initialisation."""
    ckpt = reference_checkpoint(MOE)
    with installed():
        model = mcore_zoo.build_model(ckpt, backend="local", numerics=_standin_profile())
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    fc1.register_parameter("weight", torch.nn.Parameter(torch.zeros(2, 2)))
    with pytest.raises(ZooError, match=r"decoder\.layers\.0\.mlp\.experts\.linear_fc1\.weight\b"):
        mcore_zoo.load_hf_weights(model, ckpt)
