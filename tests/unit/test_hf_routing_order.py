"""The zoo's HF-order router (``hf_topk_routing``, what ``hf-exact`` routes with) against
transformers' own router modules on the same router logits: the same experts for every token *in
the same order* - the order of a token's experts sets the order of each expert's rows (transformers'
eager experts) and of the combine's sum (``grouped_mm``), so a bf16 model whose routing only
permutes a token's experts is not bitwise (Kimi-K2 at full width, one group of 64 experts: max
|dlogit| 0.0156, found on the GPU and reproduced on the CPU). DeepSeek-V2 / V3 take the top k
unsorted (``torch.topk(sorted=False)``, whose order on the CPU is not the sorted one from 64
experts on) - also when V3's router has a single group (Kimi-K2, GLM-5) - and V2's group-limited
top k masks the other groups with 0.0."""

from __future__ import annotations

import pytest
import torch

from mcore_zoo.families.moe import spec as moe_spec
from mcore_zoo.registry import get_registry

from ..conftest import require_current_deepseek_v2_reference

TOKENS, EXPERTS = 97, 64

V3_CASES = {  # (architecture, routing fields of a published config, experts cut to 64)
    "kimi-k2 (one group)": ("DeepseekV3ForCausalLM", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                                                      "routed_scaling_factor": 2.827}),
    "deepseek-v3 (8 groups)": ("DeepseekV3ForCausalLM", {"n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                                                         "routed_scaling_factor": 2.5}),
    "glm-5 (one group)": ("GlmMoeDsaForCausalLM", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                                                   "routed_scaling_factor": 2.5}),
}
_V3_ROUTERS = {  # architecture -> (transformers' config class, its router module), by module name
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaTopkRouter"),
}
V2_CASES = {
    "greedy": {"topk_method": "greedy", "num_experts_per_tok": 6},
    "group_limited_greedy": {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3, "num_experts_per_tok": 6},
}


def _zoo_routing(arch: str, fields: dict, logits: torch.Tensor, bias: torch.Tensor, monkeypatch) -> tuple:
    """The zoo's ``(top-k indices in slot order, routing probs [T, E])`` for ``logits`` ``[T, E]``."""
    entry = get_registry().get(arch)
    moe = entry.config_from_hf({**entry.entry.example_config, "n_routed_experts": EXPERTS, **fields}).moe
    monkeypatch.setattr(moe_spec._LOCAL, "expert_bias", bias, raising=False)
    monkeypatch.setattr(moe_spec._LOCAL, "batch", 1, raising=False)
    probs, _ = moe_spec.hf_topk_routing(logits, moe)
    return moe_spec._LOCAL.topk_indices, probs


def _logits_router(router_class: type, config) -> torch.nn.Module:
    """transformers' router with an identity gate: its fp32 logits are its input, exactly."""
    router = router_class(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS))
    return router


def _logits(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, EXPERTS, generator=generator) * 3


@pytest.mark.parametrize("case", list(V3_CASES))
def test_v3_router_takes_transformers_experts_in_transformers_order(case, monkeypatch):
    import importlib

    import transformers

    arch, fields = V3_CASES[case]
    module, config_class, router_class = _V3_ROUTERS[arch]
    routers = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_class)(**{**get_registry().get(arch).entry.example_config,
                                                    "n_routed_experts": EXPERTS, "hidden_size": EXPERTS, **fields})  # fmt: skip
    router = _logits_router(getattr(routers, router_class), config)
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(1)) * 0.1
    router.e_score_correction_bias.copy_(bias)
    logits = _logits(0)
    with torch.no_grad():
        _, want_weights, want_indices = router(logits)
    indices, probs = _zoo_routing(arch, fields, logits, bias, monkeypatch)
    assert torch.equal(indices, want_indices), "the same experts in transformers' slot order"
    assert torch.equal(probs.gather(1, indices), want_weights)


@pytest.mark.parametrize("case", list(V2_CASES))
def test_v2_router_takes_transformers_experts_in_transformers_order(case, monkeypatch):
    require_current_deepseek_v2_reference()
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    arch = "DeepseekV2ForCausalLM"
    fields = V2_CASES[case]
    config = DeepseekV2Config(**{**get_registry().get(arch).entry.example_config, "n_routed_experts": EXPERTS,
                                 "hidden_size": EXPERTS, **fields})  # fmt: skip
    router = _logits_router(DeepseekV2TopkRouter, config)
    logits = _logits(2)
    with torch.no_grad():
        _, want_weights, want_indices = router(logits)
    indices, probs = _zoo_routing(arch, fields, logits, torch.zeros(EXPERTS), monkeypatch)
    assert torch.equal(indices, want_indices), "the same experts in transformers' slot order"
    assert torch.equal(probs.gather(1, indices), want_weights)


def test_a_sorted_top_k_is_another_order_here():
    """The check above can fail: on these logits the sorted top k is not ``sorted=False``'s order."""
    logits = _logits(0).sigmoid()
    assert not torch.equal(torch.topk(logits, 8, dim=-1)[1], torch.topk(logits, 8, dim=-1, sorted=False)[1])
