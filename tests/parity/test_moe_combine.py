"""The token combine of ``hf-exact`` MoE layers against transformers' own experts forward: a
token's weighted expert outputs summed in transformers' order and dtype, with eight experts per
token (top-2 sums are the same in any order, top-8 sums are not), through both of Megatron-Core's
dropless token dispatchers: the all-gather one (the zoo's on the CPU) unpermutes before the layer's
``combine``, the all-to-all one (the zoo's on CUDA) after it, in ``postprocess``."""

from __future__ import annotations

import pytest
import torch

import mcore_zoo
from mcore_zoo.numerics.profiles import get_profile
from mcore_zoo.parity.reference import load_reference

from ..conftest import random_sequences

TOKENS, HIDDEN, EXPERTS, TOPK = 48, 16, 16, 8


@pytest.fixture
def alltoall_on_cpu(monkeypatch):
    """Build MoE layers with Megatron-Core's all-to-all token dispatcher on the CPU, as the zoo
    builds them for CUDA. Its only CUDA calls move the split sizes to the host on a side stream:
    here they are host copies already (one process, expert-parallel size 1)."""
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    from mcore_zoo.families.moe import config as moe_config

    config_kwargs = moe_config.moe_config_kwargs

    def alltoall(*args, **kwargs):
        return {**config_kwargs(*args, **kwargs), "moe_token_dispatcher_type": "alltoall"}

    def host_copies(self, point, tokens_per_expert=None):
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        self.input_splits = maybe_move_tensor_to_cpu(self.input_splits, as_numpy=True)
        self.output_splits = maybe_move_tensor_to_cpu(self.output_splits, as_numpy=True)
        self.output_splits_tp = maybe_move_tensor_to_cpu(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = maybe_move_tensor_to_cpu(self.num_out_tokens)
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = maybe_move_tensor_to_cpu(self.num_global_tokens_per_local_expert)
        return maybe_move_tensor_to_cpu(tokens_per_expert)

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    monkeypatch.setattr(moe_config, "moe_config_kwargs", alltoall)
    monkeypatch.setattr(dispatcher, "cuda_dtoh_stream", object(), raising=False)  # never a CUDA stream
    monkeypatch.setattr(dispatcher, "_maybe_dtoh_and_synchronize", host_copies)


@pytest.fixture
def combines(monkeypatch):
    """The shapes of the rows every ``hf_order_unpermute`` call (the HF-order combine) sums."""
    from mcore_zoo.families.moe import spec

    calls = []
    original = spec.hf_order_unpermute

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(spec, "hf_order_unpermute", counted)
    return calls


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_top8_bf16_equal_to_transformers_through_either_dispatcher(mpu, reference_checkpoint, request, combines,
                                                                  dispatcher, experts):  # fmt: skip
    """Qwen3-MoE with eight of sixteen experts per token, bf16: the logits equal transformers' with
    the same experts implementation, bit for bit, and every MoE layer combines through the HF-order
    combine, whichever dispatcher unpermutes (the all-to-all one's stock ``scatter_add_`` combine
    sums in row order and in the rows' dtype)."""
    if dispatcher == "alltoall":
        request.getfixturevalue("alltoall_on_cpu")
    ckpt = reference_checkpoint("Qwen3MoeForCausalLM", {"num_experts": EXPERTS, "num_experts_per_tok": TOPK})
    hf = load_reference(mcore_zoo.lookup("Qwen3MoeForCausalLM"), ckpt, dtype=torch.bfloat16,
                        experts_implementation=experts)  # fmt: skip
    model = mcore_zoo.build_model(ckpt, backend="local", numerics=get_profile("hf-exact").with_knobs(moe_experts=experts),
                                  load=ckpt, params_dtype=torch.bfloat16).eval()  # fmt: skip
    moe_layers = sum(model.mcore_zoo.arch_config.moe.is_moe_layer(i) for i in range(len(model.decoder.layers)))
    ids = torch.stack(random_sequences([37, 37], hf.config.vocab_size, seed=3))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
    assert len(combines) == moe_layers > 0
    assert torch.equal(got, ref)


def _experts(implementation: str):
    """transformers' Qwen3-MoE experts (``hidden == intermediate``) in ``implementation``, with an
    activation of ones: ``act(gate) * up == up`` exactly."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=HIDDEN, num_experts=EXPERTS,
                            num_experts_per_tok=TOPK)  # fmt: skip
    config._experts_implementation = implementation
    experts = Qwen3MoeExperts(config).to(torch.bfloat16)
    experts.act_fn = _Ones()
    return experts


class _Ones(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


def _transformers_combine(implementation: str, outputs: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' experts forward (``grouped_mm_experts_forward`` or the eager loop) where the
    expert ``e`` outputs ``outputs[t, e]`` for token ``t``: the up projection passes the token's
    row through (its first column is the token's index), the down projection looks the output up;
    the weighting and the sum over a token's experts are transformers' own code."""
    from transformers.integrations import moe as hf_moe

    experts = _experts(implementation)
    hidden = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    hidden[:, 0] = torch.arange(TOKENS)

    def look_up(rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return outputs[rows[:, 0].long(), expert]

    def grouped_linear(input, weight, offs, bias=None, is_transposed=False):
        if weight is experts.gate_up_proj:
            return torch.cat([input, input], dim=-1)
        expert = torch.searchsorted(offs.long(), torch.arange(input.shape[0]), right=True)
        return look_up(input, expert)

    def linear(input, weight, bias=None):
        if weight.shape[0] == 2 * HIDDEN:  # gate_up_proj[e]
            return torch.cat([input, input], dim=-1)
        e = next(i for i in range(EXPERTS) if experts.down_proj[i].data_ptr() == weight.data_ptr())
        return look_up(input, torch.full((input.shape[0],), e))

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(hf_moe, "_grouped_linear", grouped_linear)
        patch.setattr(torch.nn.functional, "linear", linear)
        return experts(hidden, top_k_index, top_k_weights)


def _added(by_slot: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``by_slot [T, k, H]`` added slot by slot in ``order [T, k]``, rounding to bf16 after each add."""
    total = torch.zeros(by_slot.shape[0], by_slot.shape[2], dtype=torch.bfloat16)
    for j in range(by_slot.shape[1]):
        total = total + by_slot[torch.arange(by_slot.shape[0]), order[:, j]].bfloat16()
    return total


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=["qwen-bf16-weights", "mixtral-fp32-weights"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_the_combine_is_transformers_own(implementation, weights_dtype):
    """``hf_order_unpermute`` on Megatron-Core's rows (expert-major, each expert's tokens ascending)
    of the zoo's weighted expert outputs equals transformers' experts forward on the same expert
    outputs and routing weights, bit for bit: bf16 outputs of spread magnitudes, eight experts per
    token in score order (not expert order). The values make the sum's precision and order matter:
    ``grouped_mm`` (one sum, rounded once) is not bf16 adds in expert order, ``eager`` (bf16 adds in
    expert order) is neither bf16 adds in top-k order nor one sum rounded once."""
    from mcore_zoo.families.moe.spec import hf_order_unpermute

    gen = torch.Generator().manual_seed(0)
    scale = 2.0 ** torch.randint(-6, 7, (TOKENS, EXPERTS, 1), generator=gen)
    outputs = (torch.randn(TOKENS, EXPERTS, HIDDEN, generator=gen) * scale).bfloat16()
    top_k_index = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(TOKENS)])
    top_k_weights = torch.softmax(torch.randn(TOKENS, TOPK, generator=gen), dim=-1).to(weights_dtype)
    want = _transformers_combine(implementation, outputs, top_k_index, top_k_weights)

    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top_k_index, True)
    probs = torch.zeros(TOKENS, EXPERTS, dtype=weights_dtype).scatter(1, top_k_index, top_k_weights)
    expert, token = routing_map.T.nonzero().unbind(1)  # Megatron-Core's permuted rows
    weighted = outputs[token, expert] * probs[token, expert].unsqueeze(-1)  # the zoo's experts' product
    if implementation == "eager":
        weighted = weighted.to(torch.bfloat16)
    got = hf_order_unpermute(weighted, token, (TOKENS, HIDDEN), TOPK, implementation, top_k_index, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)

    by_slot = outputs.gather(1, top_k_index[..., None].expand(-1, -1, HIDDEN)) * top_k_weights[..., None]
    in_expert_order, in_top_k_order = torch.argsort(top_k_index, dim=1), torch.arange(TOPK).expand(TOKENS, -1)
    if implementation == "grouped_mm":
        assert not torch.equal(_added(by_slot, in_expert_order), want)
    else:
        assert not torch.equal(_added(by_slot, in_top_k_order), want)
        assert not torch.equal(by_slot.float().sum(dim=1).bfloat16(), want)
