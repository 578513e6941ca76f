"""The zoo's HF-order router (``hf_topk_routing``, what ``hf-exact`` routes with) against
transformers' own router module of every MoE built-in, on the same router logits (an identity gate:
transformers' fp32 logits are its input, exactly): the same experts for every token *in the same
order*, and the same weights. The order of a token's experts sets the order of each expert's rows
(transformers' eager experts) and of the combine's sum (``grouped_mm``), so a bf16 model whose
routing only permutes a token's experts is not bitwise (Kimi-K2 at full width, one group of 64
experts: max |dlogit| 0.0156, found on the GPU and reproduced on the CPU). DeepSeek-V2 / V3,
GLM-4.5 and GLM-5 take the top k unsorted (``torch.topk(sorted=False)``, whose order on the CPU is
not the sorted one from 64 experts on) - also with a single expert group (Kimi-K2, GLM-5 and GLM-4.5
as published) - V2's group-limited top k masks the other groups with 0.0; the others take it
sorted. Each case's routing fields are its published config's, the experts cut to 64."""

from __future__ import annotations

import importlib

import pytest
import torch

import transformers
from mcore_zoo.families.moe import spec as moe_spec
from mcore_zoo.registry import get_registry

from ..conftest import require_current_deepseek_v2_reference

TOKENS, EXPERTS = 97, 64

#: case -> (architecture, transformers' model module, its config class, its router class, fields)
CASES = {
    "kimi-k2 (one group)": ("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter",
                            {"n_routed_experts": EXPERTS, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                             "routed_scaling_factor": 2.827}),
    "deepseek-v3 (8 groups)": ("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter",
                               {"n_routed_experts": EXPERTS, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                                "routed_scaling_factor": 2.5}),
    "deepseek-v3.2 (8 groups)": ("DeepseekV32ForCausalLM", "deepseek_v32", "DeepseekV32Config", "DeepseekV32TopkRouter",
                                 {"n_routed_experts": EXPERTS, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                                  "routed_scaling_factor": 2.5}),
    "glm-5 (one group)": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaTopkRouter",
                          {"n_routed_experts": EXPERTS, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                           "routed_scaling_factor": 2.5}),
    "glm-4.5 (one group)": ("Glm4MoeForCausalLM", "glm4_moe", "Glm4MoeConfig", "Glm4MoeTopkRouter",
                            {"n_routed_experts": EXPERTS, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
                             "routed_scaling_factor": 2.5}),
    "deepseek-v2 greedy": ("DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter",
                           {"n_routed_experts": EXPERTS, "topk_method": "greedy", "num_experts_per_tok": 6}),
    "deepseek-v2 group_limited_greedy": ("DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2Config",
                                         "DeepseekV2TopkRouter",
                                         {"n_routed_experts": EXPERTS, "topk_method": "group_limited_greedy",
                                          "n_group": 8, "topk_group": 3, "num_experts_per_tok": 6}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter",
                  {"num_experts": EXPERTS, "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeTopKRouter",
                  {"num_experts": EXPERTS, "num_experts_per_tok": 4, "norm_topk_prob": False}),
    "qwen3-next": ("Qwen3NextForCausalLM", "qwen3_next", "Qwen3NextConfig", "Qwen3NextTopKRouter",
                   {"num_experts": EXPERTS, "num_experts_per_tok": 10, "norm_topk_prob": True}),
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeTopKRouter",
                    {"num_experts": EXPERTS, "num_experts_per_tok": 8}),
    "mixtral": ("MixtralForCausalLM", "mixtral", "MixtralConfig", "MixtralTopKRouter",
                {"num_local_experts": EXPERTS, "num_experts_per_tok": 2}),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", "GptOssConfig", "GptOssTopKRouter",
                {"num_local_experts": EXPERTS, "num_experts_per_tok": 4}),
}  # fmt: skip


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("case", list(CASES))
def test_the_router_takes_transformers_experts_in_transformers_order(case, monkeypatch):
    arch, module, config_class, router_class, fields = CASES[case]
    if module == "deepseek_v2":
        require_current_deepseek_v2_reference()
    entry = get_registry().get(arch)
    example = {**entry.entry.example_config, **fields}
    moe = entry.config_from_hf(example).moe
    config = getattr(transformers, config_class)(**{**example, "hidden_size": EXPERTS})
    router = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), router_class)(config)
    bias = torch.zeros(EXPERTS)
    with torch.no_grad():
        router.weight.copy_(torch.eye(EXPERTS))  # fp32: the logits are the input, exactly
        if hasattr(router, "e_score_correction_bias"):
            bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(1)) * 0.1
            router.e_score_correction_bias.copy_(bias)
    logits = _logits(0)
    with torch.no_grad():
        _, want_weights, want_indices = router(logits)
    monkeypatch.setattr(moe_spec._LOCAL, "expert_bias", bias, raising=False)
    monkeypatch.setattr(moe_spec._LOCAL, "batch", 1, raising=False)
    monkeypatch.setattr(moe_spec._LOCAL, "hidden_dtype", torch.float32, raising=False)
    probs, routing_map = moe_spec.hf_topk_routing(logits, moe)
    indices = moe_spec._LOCAL.topk_indices
    assert torch.equal(indices, want_indices), "the same experts in transformers' slot order"
    assert torch.equal(probs.gather(1, indices), want_weights.to(probs.dtype))
    assert int(routing_map.sum()) == TOKENS * moe.top_k


def test_a_sorted_top_k_is_another_order_here():
    """The check above can fail: on these logits the sorted top k is not ``sorted=False``'s order."""
    scores = _logits(0).sigmoid()
    assert not torch.equal(torch.topk(scores, 8, dim=-1)[1], torch.topk(scores, 8, dim=-1, sorted=False)[1])
