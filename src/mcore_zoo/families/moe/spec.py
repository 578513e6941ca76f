"""Mixture-of-experts layer specs: Megatron-Core's ``MoELayer`` with the zoo's HF-order router and
experts (numerics knob ``router="hf"``, the default), or the stock ones (``router="mcore"``).

What ``router="hf"`` changes against stock Megatron-Core (both are the same math):

* :class:`HFRouter` - the routing weights are computed in HF's op order (:func:`hf_topk_routing`):
  scores over all experts, top-k, renormalise by division, scale, cast. Stock mcore renormalises
  by a softmax over the top-k logits (``moe_router_pre_softmax=False``), which rounds differently;
  its group-limited selection scores a group by its top ``topk / group_topk`` experts where GLM-4.5
  / DeepSeek-V3 use the top 2. Everything around the arithmetic is Megatron-Core's own ``TopKRouter``
  (gating GEMM, z-loss, aux losses, expert-bias bookkeeping, router replay).
* :class:`HFOrderSequentialMLP` - each expert's output is multiplied by its routing weight *after*
  ``linear_fc2``, as HF does; stock mcore multiplies the activation before ``linear_fc2``.
  :class:`HFOrderTEGroupedMLP` does the same for Transformer Engine's grouped-GEMM experts
  (numerics knob ``grouped_experts``).
* :class:`HFOrderMoELayer` - the token combine follows the transformers experts implementation
  named by the numerics knob ``moe_experts`` (:func:`hf_order_unpermute`): ``"grouped_mm"`` (the
  default of transformers 5) sums a token's weighted expert outputs over its top-k slots in the
  product's dtype and casts once; ``"eager"`` adds them one expert at a time in ascending order in
  the hidden dtype, rounding after each add, as the per-expert ``index_add_`` does. Stock mcore's
  ``scatter_add_`` adds them in no fixed order on CUDA.
* :class:`HFOrderSharedExpertMLP` - the shared-expert gate (a one-column GEMM and a sigmoid) runs
  over the tokens in HF's batch-major order (both round by position in the tensor); the sigmoid
  router scores (GLM-4.5) likewise.

Routing replay works with both (:mod:`mcore_zoo.routing`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import torch

from mcore_zoo.config.arch import ArchConfig, ClampedSwiGLU, MoESpec
from mcore_zoo.errors import ZooError
from mcore_zoo.families.moe.grouped_mm import shared_expert_stacks
from mcore_zoo.specs.pack_rows import outside_pack, sequence_segments
from mcore_zoo.specs.patching import wrap_once

_LOCAL = threading.local()


def hf_topk_routing(logits: torch.Tensor, moe: MoESpec,
                    router_replay: Any = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(routing_probs [T, E], routing_map [T, E])`` from router logits ``[T, E]``, in HF's op order
    (see :class:`~mcore_zoo.config.arch.MoESpec`). ``router_replay``: Megatron-Core's per-layer
    ``RouterReplay`` (record / replay the chosen experts)."""
    num_tokens, num_experts = logits.shape
    if moe.softmax_over_topk:  # gpt-oss: the top k logits, a softmax over them in the logits' dtype
        return _softmax_over_topk(logits, moe, router_replay)
    if moe.router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif moe.router_score_function == "sigmoid":
        # elementwise over the flattened tensor: torch's vectorised sigmoid rounds a tensor's tail
        # differently, so compute it over the tokens in HF's batch-major order (as HF does)
        batch = getattr(_LOCAL, "batch", 1) or 1
        by_batch = logits.float().view(-1, batch, num_experts).transpose(0, 1).contiguous()
        scores = torch.sigmoid(by_batch).transpose(0, 1).reshape(num_tokens, num_experts)
    else:
        raise ValueError(f"unknown router score function {moe.router_score_function!r}")
    choice = scores
    if moe.router_expert_bias:
        bias = _LOCAL.expert_bias
        choice = scores + bias

    def select(values: torch.Tensor, topk: int, num_groups: Optional[int] = None,
               group_topk: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if moe.num_groups and moe.group_topk:  # GLM-4.5 / DeepSeek-V3: a group scores its best two
            per_group = num_experts // moe.num_groups
            grouped = values.view(-1, moe.num_groups, per_group)
            group_scores = grouped.topk(moe.group_score_topk, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=moe.group_topk, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, moe.num_groups, per_group).reshape(-1, num_experts)
            values = values.masked_fill(~score_mask.bool(), moe.group_mask_value)
            return torch.topk(values, k=topk, dim=-1, sorted=moe.topk_sorted)
        return torch.topk(values, topk, dim=-1, sorted=moe.topk_sorted)

    if router_replay is None:
        _, top_indices = select(choice, moe.top_k)
    else:
        _, top_indices = router_replay.get_replay_topk(choice, moe.top_k, None, None, select)
    weights = scores.gather(1, top_indices)
    if moe.normalize_topk:
        denominator = weights.sum(dim=-1, keepdim=True)
        if moe.normalize_eps:
            denominator = denominator + moe.normalize_eps
        weights = weights / denominator
    if moe.topk_scaling_factor is not None:
        weights = weights * moe.topk_scaling_factor
    return _routing_tensors(weights, top_indices, num_experts, moe)


def _routing_tensors(weights: torch.Tensor, top_indices: torch.Tensor, num_experts: int,
                     moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(routing_probs [T, E], routing_map [T, E])`` from the chosen experts' weights ``[T, k]``
    (cast to the probs dtype); records the top-k indices (the combine's slot order: HF's)."""
    _LOCAL.topk_indices = top_indices
    probs_dtype = torch.float32 if moe.probs_dtype == "fp32" else _LOCAL.hidden_dtype
    weights = weights.to(probs_dtype)
    zeros = torch.zeros(weights.shape[0], num_experts, dtype=probs_dtype, device=weights.device)
    routing_probs = zeros.scatter(1, top_indices, weights)
    routing_map = torch.zeros_like(zeros, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def _softmax_over_topk(logits: torch.Tensor, moe: MoESpec, router_replay: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hf_topk_routing` of a gpt-oss router: ``top, idx = topk(logits, k)``,
    ``weights = softmax(top, dtype=logits.dtype)``, cast to the probs dtype."""
    num_experts = logits.shape[1]

    def select(values: torch.Tensor, topk: int, num_groups: Optional[int] = None,
               group_topk: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return torch.topk(values, topk, dim=-1)

    if router_replay is None:
        _, top_indices = select(logits, moe.top_k)
    else:
        _, top_indices = router_replay.get_replay_topk(logits, moe.top_k, None, None, select)
    weights = torch.softmax(logits.gather(1, top_indices), dim=1, dtype=logits.dtype)
    return _routing_tensors(weights, top_indices, num_experts, moe)


def _install() -> None:
    """Route Megatron-Core's ``topk_routing_with_score_function`` (as ``TopKRouter.routing`` calls
    it) through :func:`hf_topk_routing` while an :class:`HFRouter` is routing on this thread; every
    other caller gets the original. Installed once, process-wide."""
    from megatron.core.transformer.moe import router as mrouter

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def dispatch(logits: torch.Tensor, topk: int, *args: Any, **kwargs: Any) -> Any:
            moe = getattr(_LOCAL, "moe", None)
            if moe is None:
                return original(logits, topk, *args, **kwargs)
            return hf_topk_routing(logits, moe, kwargs.get("router_replay"))

        return dispatch

    wrap_once(mrouter, "topk_routing_with_score_function", make)


def hf_order_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: Any,
                       topk: int, experts: str = "eager", topk_indices: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """Megatron-Core's ``unpermute`` (no probs, dropless) with the summation order of one of
    transformers' experts implementations.

    ``permuted_tokens [R, H]`` are the weighted expert outputs in expert-major order (each token's
    rows in ascending expert order), ``sorted_indices [R]`` the token each row belongs to.

    * ``experts="eager"`` (transformers' ``eager`` experts, and transformers 4): HF adds a token's
      experts one expert at a time into a zero tensor of the hidden dtype (``index_add_`` per
      expert, rounding after each add). Here the ``r``-th row of every token (``r < topk``) is added
      in pass ``r``: each pass has distinct indices, so every add is one rounding in HF's order, on
      every device. Megatron-Core's ``scatter_add_`` sums all rows at once, which on CUDA is atomics
      in no fixed order.
    * ``experts="grouped_mm"`` (transformers 5's default): HF keeps the weighted outputs in the
      product's dtype (fp32 when the routing weights are fp32), puts them in a ``[T, topk, H]``
      tensor in the order of its top-k indices, ``.sum(dim=1)``, then casts to the hidden dtype
      once. Here the same: ``topk_indices [T, topk]`` (the router's) give each row its slot; without
      them (or when a token has fewer rows, e.g. experts on other ranks) the slot is the row's rank
      in ascending expert order.

    ``out_dtype``: the hidden dtype (default: the rows' dtype). Differentiable."""
    n = sorted_indices.numel()
    out_dtype = out_dtype or permuted_tokens.dtype
    device = permuted_tokens.device
    num_tokens, hidden = restore_shape[0], restore_shape[-1]
    if n == 0:
        return torch.zeros(restore_shape, dtype=out_dtype, device=device)
    order = torch.argsort(sorted_indices, stable=True)  # rows grouped by token, row order kept
    grouped = sorted_indices[order]
    pos = torch.arange(n, device=sorted_indices.device)
    start = torch.ones(n, dtype=torch.bool, device=sorted_indices.device)
    start[1:] = grouped[1:] != grouped[:-1]
    first = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), dim=0).values
    rank = torch.empty_like(pos)
    rank[order] = pos - first  # how many earlier rows belong to the same token
    if experts == "grouped_mm":
        slot = rank
        if topk_indices is not None and topk_indices.shape == (num_tokens, topk) and n == num_tokens * topk:
            # the r-th smallest expert of a token sits at HF's top-k position argsort(indices)[r]
            slot = torch.argsort(topk_indices.to(device), dim=1)[sorted_indices, rank]
        slots = torch.zeros(num_tokens, topk, hidden, dtype=permuted_tokens.dtype, device=device)
        slots = slots.index_put((sorted_indices, slot), permuted_tokens)
        return slots.sum(dim=1).to(out_dtype).view(restore_shape)
    if experts != "eager":
        raise ValueError(f"unknown experts implementation {experts!r}; use 'grouped_mm' or 'eager'")
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=device)
    for r in range(topk):
        rows = (rank == r).nonzero().squeeze(1)
        out = out.index_add(0, sorted_indices[rows], permuted_tokens[rows])
    return out.to(out_dtype)


def _install_hf_order_combine() -> None:
    """Route the token dispatchers' ``unpermute`` through :func:`hf_order_unpermute` while an
    :class:`HFOrderMoELayer` runs on this thread (and the call is the plain dropless one); every
    other caller gets the original. Installed once, process-wide."""
    from megatron.core.transformer.moe import token_dispatcher

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def dispatch(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: Any,
                     probs: Optional[torch.Tensor] = None, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
            combine = getattr(_LOCAL, "combine", None)
            plain = probs is None and not args and not kwargs.get("fused") and not kwargs.get("drop_and_pad")
            if combine is None or not plain:
                return original(permuted_tokens, sorted_indices, restore_shape, probs, *args, **kwargs)
            topk, experts, hidden_dtype = combine
            return hf_order_unpermute(permuted_tokens, sorted_indices, restore_shape, topk, experts,
                                      getattr(_LOCAL, "topk_indices", None), hidden_dtype)  # fmt: skip

        return dispatch

    wrap_once(token_dispatcher, "unpermute", make)


def _install_permute_record() -> None:
    """Record the ``sorted_indices`` (each permuted row's token) of the token dispatchers'
    ``permute`` in the thread's MoE state while an :class:`HFOrderMoELayer` runs on this thread, so
    that its experts can put the rows in the reference's order (:func:`reference_row_order`).
    Installed once, process-wide; returns the original's result unchanged."""
    from megatron.core.transformer.moe import token_dispatcher

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def record(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if getattr(_LOCAL, "combine", None) is not None:
                _LOCAL.sorted_indices = result[2]
            return result

        return record

    wrap_once(token_dispatcher, "permute", make)


def reference_row_order(sorted_indices: torch.Tensor, tokens_per_expert: list[int],
                        topk_indices: Optional[torch.Tensor], batch: int, experts: str) -> Optional[torch.Tensor]:  # fmt: skip
    """The order in which transformers' experts see the rows that Megatron-Core's dispatcher hands
    the experts, or ``None`` when it cannot be derived (experts on other ranks, dropped tokens).

    Megatron-Core's permuted rows ``[R, H]`` come expert by expert, each expert's tokens in
    ascending order of their sequence-major index ``s * batch + b`` (``sorted_indices [R]``).
    transformers flattens the tokens batch-major (``b * seq + s``) and, per experts
    implementation:

    * ``"eager"``: each expert takes its rows ordered by top-k slot, then batch-major token
      (``torch.where`` over the expert's ``[topk, tokens]`` mask);
    * ``"grouped_mm"``: the rows are ``torch.sort`` of the flattened top-k expert ids
      (``[tokens * topk]``, batch-major), whose order within an expert is the sort's own.

    A CPU GEMM's result for a row can depend on where the row sits in the GEMM (the kernels and
    threads split the rows in blocks), so the zoo's experts run on the rows in the reference's
    order. Returns ``order [R]`` with ``rows[order]`` in the reference's order; each expert's rows
    stay in its own group, so ``tokens_per_expert`` still splits them. ``None`` under expert
    parallelism (the reference has no such layout; Megatron-Core's order is kept)."""
    rows = sorted_indices.numel()
    num_tokens = topk_indices.shape[0] if topk_indices is not None else 0
    if topk_indices is None or rows != num_tokens * topk_indices.shape[1] or rows != sum(tokens_per_expert):
        return None
    if int(topk_indices.max()) >= len(tokens_per_expert) or int(sorted_indices.max()) >= num_tokens:
        return None  # experts on other ranks, or tokens gathered from other ranks
    topk = topk_indices.shape[1]
    batch = max(int(batch or 1), 1)
    if num_tokens % batch:
        return None
    seq = num_tokens // batch
    device = sorted_indices.device
    tokens = sorted_indices.to(device)
    batch_major = (tokens % batch) * seq + tokens // batch  # each row's token, batch-major
    expert_of_row = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=device),
                                            torch.tensor(tokens_per_expert, device=device))  # fmt: skip
    hf_topk = topk_indices.to(device).view(seq, batch, topk).transpose(0, 1).reshape(num_tokens, topk)
    slot = (hf_topk[batch_major] == expert_of_row.unsqueeze(1)).int().argmax(dim=1)  # the row's top-k slot
    if experts == "eager":  # torch.where over the expert's [topk, tokens] mask: slot-major
        return torch.argsort((expert_of_row * topk + slot) * num_tokens + batch_major)
    if experts != "grouped_mm":
        raise ValueError(f"unknown experts implementation {experts!r}; use 'grouped_mm' or 'eager'")
    _, perm = torch.sort(hf_topk.reshape(-1))  # transformers' own call, on the same tensor
    position = torch.empty_like(perm)
    position[perm] = torch.arange(perm.numel(), device=device)  # pair (token, slot) -> its row
    return torch.argsort(position[batch_major * topk + slot])


def run_in_reference_order(run: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor,
                           tokens_per_expert: list[int], experts: str) -> torch.Tensor:  # fmt: skip
    """``run(rows')`` with ``rows'`` in the reference's row order (:func:`reference_row_order`,
    from the dispatcher's rows recorded on this thread), its output rows put back in Megatron-Core's
    order; ``run(rows)`` as it is when the order cannot be derived. Differentiable."""
    sorted_indices = getattr(_LOCAL, "sorted_indices", None)
    if sorted_indices is None or sorted_indices.numel() != rows.shape[0]:
        return run(rows)
    topk_indices = getattr(_LOCAL, "topk_indices", None)
    if topk_indices is not None and len(tokens_per_expert) != int(getattr(_LOCAL, "num_experts", -1)):
        return run(rows)  # expert parallelism: this rank holds some of the experts
    order = reference_row_order(sorted_indices, tokens_per_expert, topk_indices, getattr(_LOCAL, "batch", 1), experts)
    if order is None:
        return run(rows)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return run(rows[order])[inverse]


@functools.lru_cache(maxsize=None)
def hf_moe_layer_class(experts: str = "grouped_mm", pack: str = "batch") -> type:
    """:class:`HFOrderMoELayer`; ``pack``: the numerics knob ``pack_gemms`` (``"each"``: a THD
    pack's sequences through the block one at a time)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if pack not in ("each", "batch"):
        raise ValueError(f"pack_gemms={pack!r}; use 'each' or 'batch'")

    class HFOrderMoELayer(MoELayer):
        """``MoELayer`` whose token combine adds each token's expert outputs in the order of
        transformers' ``experts`` implementation (:func:`hf_order_unpermute`), ending in the
        dtype of the layer's input.

        With ``pack="each"`` a THD pack (bounds from :mod:`mcore_zoo.specs.pack_rows`) goes
        through the whole block - router GEMM, shared experts, expert GEMMs, combine - one
        sequence at a time (:func:`~mcore_zoo.specs.pack_rows.sequence_segments`; alignment padding alone), so every GEMM has the
        row count it has when the sequence runs alone, as transformers runs it: a GEMM's result for
        a row can depend on how many rows it has (the BLAS and cuBLAS pick kernels by shape). Not
        in a training forward with an auxiliary or z-loss: those are defined over the micro-batch's
        tokens (Megatron-Core's load-balancing loss), so the pack runs at once. Only without expert parallelism (each
        call is a collective over the expert-parallel group, whose ranks hold other packs) and
        when this rank holds the whole pack (no sequence or context parallelism); otherwise the
        pack runs at once."""

        def _sequence_segments(self, hidden_states: Any, args: tuple, kwargs: dict) -> Optional[list[tuple[int, int]]]:
            plain = not args and set(kwargs) <= {"padding_mask", "intermediate_tensors"}
            if pack != "each" or not plain or kwargs.get("intermediate_tensors") is not None:
                return None
            if hidden_states is None or hidden_states.dim() != 3 or self.config.expert_model_parallel_size > 1:
                return None
            if self._pack_losses():
                return None
            return sequence_segments(hidden_states)

        def _pack_losses(self) -> bool:
            """A training forward whose router adds an auxiliary or z-loss (over the whole pack)."""
            if not (self.training and torch.is_grad_enabled()):
                return False
            coeff = getattr(self.config, "moe_aux_loss_coeff", 0) or 0
            coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff]
            return any(c for c in coeffs) or bool(getattr(self.config, "moe_z_loss_coeff", None))

        def _forward_whole(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._begin(hidden_states.dtype)
            try:
                return super().forward(hidden_states, *args, **kwargs)
            finally:
                self._end()

        def _begin(self, hidden_dtype: torch.dtype) -> None:
            _install_hf_order_combine()
            _install_permute_record()
            _LOCAL.combine = (self.config.moe_router_topk, experts, hidden_dtype)
            _LOCAL.num_experts = self.config.num_moe_experts
            _LOCAL.topk_indices = None
            _LOCAL.sorted_indices = None

        @staticmethod
        def _end() -> None:
            _LOCAL.combine = None
            _LOCAL.topk_indices = None
            _LOCAL.sorted_indices = None

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            segments = self._sequence_segments(hidden_states, args, kwargs)
            if segments is None:
                return self._forward_whole(hidden_states, *args, **kwargs)
            replay = getattr(self.router, "router_replay", None)
            if hasattr(replay, "check_rows_left"):  # too few routes: named for the layer's whole pack
                replay.check_rows_left(hidden_states.shape[0])
            padding_mask = kwargs.get("padding_mask")  # [b, s]

            def each_sequence(hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> Any:
                outputs, bias = [], None
                recompute, self.moe_layer_recompute = self.moe_layer_recompute, False
                try:
                    # the block's own GEMMs see one sequence: nothing left to split; the experts'
                    # stacked weights (grouped_mm) made once for all the sequences
                    with outside_pack(), shared_expert_stacks():
                        for start, end in segments:
                            if padding_mask is not None:
                                kwargs["padding_mask"] = padding_mask[:, start:end]
                            output, bias = self._forward_whole(hidden_states[start:end], **kwargs)
                            outputs.append(output)
                finally:
                    self.moe_layer_recompute = recompute
                return torch.cat(outputs, dim=0), bias

            if not self.moe_layer_recompute:
                return each_sequence(hidden_states, padding_mask)
            # MoE recomputation: the whole pack in one checkpoint, so that the backward reruns the
            # sequences in their forward's order (routing replay hands each its routes in order)
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(each_sequence, False, hidden_states, padding_mask)

        # route -> ... -> postprocess is also what Megatron-Core's MoE recomputation
        # (recompute_modules "moe") reruns in the backward, outside forward: it starts and ends the
        # HF-order state too. The state lasts until postprocess has run, not just combine: the
        # all-to-all dispatcher (the zoo's on CUDA) unpermutes in combine_postprocess, which
        # postprocess calls after combine (the all-gather dispatcher unpermutes before combine)
        def route(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._begin(hidden_states.dtype)
            return super().route(hidden_states, *args, **kwargs)

        def postprocess(self, output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().postprocess(output, *args, **kwargs)
            finally:
                self._end()

    return HFOrderMoELayer


@functools.lru_cache(maxsize=None)
def hf_router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class HFRouter(TopKRouter):
        """Megatron-Core's ``TopKRouter`` whose routing arithmetic follows HF (module docstring)."""

        def __init__(self, *args: Any, moe: MoESpec, gemm: str = "backend", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.zoo_moe = moe
            if gemm not in ("backend", "hf"):
                raise ValueError(f"router_gemm={gemm!r}; use 'backend' or 'hf'")
            self.zoo_gemm = gemm  # the numerics knob router_gemm (gating)
            if moe.router_weight_dtype == "fp32":  # as the reference keeps it (MoESpec.router_weight_dtype)
                for param in (self.weight, self.bias):
                    if param is not None:
                        param.data = param.data.float()
                        param.keep_fp32 = True  # the build's dtype cast leaves it
            if self.router_replay is not None:  # per-microbatch record / replay (pipeline schedules)
                from megatron.core.transformer.moe.router_replay import RouterReplay

                RouterReplay.global_router_replay_instances.remove(self.router_replay)
                self.router_replay = microbatch_router_replay_class()()

        def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            _LOCAL.hidden_dtype = input.dtype  # HF casts the weights to the hidden dtype
            return super().forward(input, *args, **kwargs)

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            """With the numerics knob ``router_gemm="hf"``, the router logits as transformers
            computes them: ``F.linear`` in the router dtype
            (fp32 where HF casts the input and the weight - GLM-4.5, DeepSeek-V3 -, else the
            hidden dtype) over the tokens as transformers' contiguous ``[b * s, h]`` rows
            (batch-major; with a router bias - gpt-oss - a strided ``[b, s, h]`` view would round
            the bias apart from the GEMM). Megatron-Core's
            ``router_gating_linear`` runs Transformer Engine's GEMM wherever TE is installed:
            another kernel, with a workspace of its own, so free to split the reduction over
            ``hidden`` for the few output columns of a router (Mixtral's 8). Same math; it keeps
            the input cast to the router dtype for the backward, which Megatron-Core's does not."""
            if self.zoo_gemm != "hf":
                return super().gating(input)
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            weight = self.weight.to(input.device, dtype)
            bias = None if self.bias is None else self.bias.to(input.device, dtype)
            if input.dim() != 3:
                return torch.nn.functional.linear(input.to(dtype), weight, bias)
            # transformers' rows: [b * s, h] batch-major and contiguous (a view when b == 1, THD). A
            # non-contiguous [b, s, h] view would make F.linear add a bias after the GEMM (its
            # matmul path) where the reference's contiguous rows add it inside (addmm)
            seq, batch = input.shape[0], input.shape[1]
            rows = input.transpose(0, 1).reshape(batch * seq, -1).to(dtype)
            logits = torch.nn.functional.linear(rows, weight, bias)
            return logits.view(batch, seq, -1).transpose(0, 1).contiguous()

        def routing(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            _install()
            _LOCAL.moe = self.zoo_moe
            _LOCAL.batch = logits.shape[1] if logits.dim() == 3 else 1  # [s, b, E]
            _LOCAL.expert_bias = self.expert_bias
            try:
                return super().routing(logits, *args, **kwargs)
            finally:
                _LOCAL.moe = None
                _LOCAL.expert_bias = None

    return HFRouter



def in_backward() -> bool:
    """Whether this runs inside an autograd backward pass: a module's forward there is activation
    recomputation (Megatron-Core's checkpointing reruns the forward in the backward)."""
    return torch._C._current_graph_task_id() != -1


@functools.lru_cache(maxsize=None)
def microbatch_router_replay_class() -> type:
    """Megatron-Core's ``RouterReplay`` for several forwards per record / replay block (the
    micro-batches of a pipeline schedule): recording appends each forward's indices, replay
    consumes the target rows in order, as many as each forward routes; a forward that finds too
    few rows left raises :class:`~mcore_zoo.errors.ZooError`, and :meth:`rows_left` tells how many
    the forwards left unused (:func:`mcore_zoo.routing.replay` refuses those).

    Activation recomputation: a forward rerun in the backward (:func:`in_backward`, or Megatron's
    ``REPLAY_BACKWARD`` action) routes the tokens to the experts of the forward it recomputes -
    the earliest one not yet recomputed: the schedules run the backwards of a chunk's
    micro-batches in the order of their forwards - and neither records nor consumes routes, so a
    record holds each token once and the routes of each token are given once, with or without
    recomputation."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class MicrobatchRouterReplay(RouterReplay):
        def __init__(self) -> None:
            super().__init__()
            self._recorded: list[torch.Tensor] = []
            self._cursor = 0
            self._forwards: list[torch.Tensor] = []  # each forward's experts, for its recomputation
            self.layer_number: Optional[int] = None  # the router's, for error messages (set by replay)

        def rows_left(self) -> int:
            """Target rows no forward has consumed yet (0 without a target)."""
            return 0 if self.target_topk_idx is None else int(self.target_topk_idx.shape[0]) - self._cursor

        def record_indices(self, topk_indices: torch.Tensor) -> None:
            super().record_indices(topk_indices)
            self._recorded.append(topk_indices)

        def get_recorded_indices(self) -> Optional[torch.Tensor]:
            return torch.cat(self._recorded) if self._recorded else None

        def set_target_indices(self, topk_indices: torch.Tensor) -> None:
            super().set_target_indices(topk_indices)
            self._cursor = 0

        def clear_indices(self) -> None:
            super().clear_indices()
            self._recorded, self._cursor, self._forwards = [], 0, []

        def check_rows_left(self, rows: int) -> None:
            """Raise :class:`~mcore_zoo.errors.ZooError` when a replaying forward of ``rows`` tokens
            would find too few routes left (a layer that routes its pack in several calls checks
            the whole pack first); nothing otherwise, or outside a replaying forward."""
            if self.router_replay_action is None or in_backward():
                return
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                self._require_rows(rows)

        def _require_rows(self, rows: int) -> None:
            target = self.target_topk_idx
            if target is None or self._cursor + rows > target.shape[0]:
                raise ZooError(f"routing replay, layer {self.layer_number}: this forward routes {rows} tokens,"
                               f" {self.rows_left()} of the replay routes are left (too few routes)")  # fmt: skip

        def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                            group_topk: Optional[int] = None, default_compute_topk: Any = None) -> Any:  # fmt: skip
            action = self.router_replay_action
            if action is None:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            rows = scores.shape[0]
            if action == RouterReplayAction.REPLAY_BACKWARD or in_backward():  # a recomputed forward
                if not self._forwards or self._forwards[0].shape[0] != rows:
                    raise ZooError(f"routing record / replay, layer {self.layer_number}: a recomputed forward of"
                                   f" {rows} tokens matches no earlier forward of the block")  # fmt: skip
                top_indices = self._forwards.pop(0).to(scores.device)
                return scores.gather(1, top_indices), top_indices
            if action == RouterReplayAction.RECORD:
                probs, top_indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self.record_indices(top_indices)
                self._forwards.append(top_indices)
                return probs, top_indices
            self._require_rows(rows)
            top_indices = self.target_topk_idx[self._cursor : self._cursor + rows].to(scores.device)
            self._cursor += rows
            self._forwards.append(top_indices)
            return scores.gather(1, top_indices), top_indices

    return MicrobatchRouterReplay


@functools.lru_cache(maxsize=None)
def hf_experts_class(experts: str = "grouped_mm", swiglu: Optional[ClampedSwiGLU] = None) -> type:
    """:class:`HFOrderSequentialMLP`; ``swiglu``: each expert is a gpt-oss clamped-SwiGLU expert in
    transformers' layout (:func:`~mcore_zoo.families.moe.clamped_swiglu.clamped_swiglu_expert`)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mcore_zoo.families.moe.clamped_swiglu import clamped_swiglu_expert
    from mcore_zoo.families.moe.grouped_mm import GROUPED_MM_DTYPES, grouped_experts_apply

    class HFOrderSequentialMLP(SequentialMLP):
        """``SequentialMLP`` that scales each expert's output by its routing weight after
        ``linear_fc2`` (HF: ``down_proj(act(gate) * up) * weight``), in the weight's dtype (HF
        Mixtral / GLM / DeepSeek-V3 keep fp32 weights; Qwen casts them to the hidden dtype first).
        With ``experts="grouped_mm"`` the experts run as transformers' ``grouped_mm`` experts do
        (:func:`~mcore_zoo.families.moe.grouped_mm.grouped_experts_apply`: one grouped GEMM per
        projection over the stacked weights), with ``"eager"`` one ``F.linear`` per expert as its
        eager experts do.
        transformers' ``grouped_mm`` experts keep that product in its dtype until the sum over a
        token's experts (the combine casts); its ``eager`` experts cast each product back to the
        hidden dtype before ``index_add_``."""

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                    permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:  # fmt: skip
            if self.config.fp8 or getattr(self.config, "fp4", None) or self.config.moe_apply_probs_on_input:
                raise NotImplementedError("HFOrderSequentialMLP: fp8/fp4 and moe_apply_probs_on_input are not supported")
            counts = tokens_per_expert.tolist()
            grouped = grouped_experts_apply(self.local_experts) if experts == "grouped_mm" and swiglu is None else None

            def run(rows: torch.Tensor) -> torch.Tensor:
                if grouped is not None and rows.dtype in GROUPED_MM_DTYPES:  # one grouped GEMM per projection
                    return grouped(rows, counts)
                outputs = []
                for expert, tokens in zip(self.local_experts, torch.split(rows, counts)):
                    if swiglu is not None:
                        outputs.append(clamped_swiglu_expert(expert, tokens, swiglu))
                        continue
                    output, bias = expert(tokens)
                    outputs.append(output if bias is None else output + bias)
                return torch.cat(outputs, dim=0)

            output = run_in_reference_order(run, permuted_local_hidden_states, counts, experts)
            weighted = output * permuted_probs.unsqueeze(-1)
            return (weighted if experts == "grouped_mm" else weighted.to(output.dtype)), None

    return HFOrderSequentialMLP



@functools.lru_cache(maxsize=None)
def hf_grouped_experts_class(experts: str = "grouped_mm") -> type:
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    class HFOrderTEGroupedMLP(TEGroupedMLP):
        """``TEGroupedMLP`` (every local expert in one grouped GEMM per projection) that scales
        each row by its routing weight after ``linear_fc2``, as :class:`HFOrderSequentialMLP` does:
        Megatron-Core's grouped forward runs with unit weights (``activation * 1``, exact: the
        activation is cast back to its dtype), then ``output * weight`` in the weight's dtype,
        kept there for transformers' ``grouped_mm`` combine, cast back for ``eager``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            config = self.config
            if config.fp8 or getattr(config, "fp4", None) or config.moe_apply_probs_on_input:
                raise NotImplementedError("HFOrderTEGroupedMLP: fp8/fp4 and moe_apply_probs_on_input are not supported")
            if getattr(config, "use_transformer_engine_op_fuser", False):
                raise NotImplementedError("HFOrderTEGroupedMLP: the TE op-fuser path applies the routing weights"
                                          " inside its fused kernel; use router='mcore' for it")  # fmt: skip

        def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                    permuted_probs: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
            ones = torch.ones_like(permuted_probs)

            def run(rows: torch.Tensor) -> torch.Tensor:
                return super(HFOrderTEGroupedMLP, self).forward(rows, tokens_per_expert, ones, *args, **kwargs)[0]

            output = run_in_reference_order(run, permuted_local_hidden_states, tokens_per_expert.tolist(), experts)
            weighted = output * permuted_probs.unsqueeze(-1)
            return (weighted if experts == "grouped_mm" else weighted.to(output.dtype)), None

    return HFOrderTEGroupedMLP


@functools.lru_cache(maxsize=None)
def hf_shared_experts_class(gemm: str = "fused") -> type:
    """:class:`HFOrderSharedExpertMLP`; ``gemm``: the numerics knob ``shared_expert_gemm``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from mcore_zoo.placement import group_size
    from mcore_zoo.specs.pack_rows import linear_each_sequence

    if gemm not in ("fused", "hf"):
        raise ValueError(f"shared_expert_gemm={gemm!r}; use 'fused' or 'hf'")

    class HFOrderSharedExpertMLP(SharedExpertMLP):
        """``SharedExpertMLP`` whose gate ``sigmoid(x @ gate.T)`` runs over the tokens in HF's
        (batch-major) order: the one-column GEMM and torch's vectorised sigmoid (which rounds the
        tail after the last full vector differently) both depend on where a token sits in the
        tensor. With ``gemm="hf"`` the gate and up projections are two GEMMs (the halves of
        ``linear_fc1``'s weight), as transformers' shared-expert MLP runs ``gate_proj`` and
        ``up_proj`` (:meth:`gate_up_apart` says where). Same math as the stock module."""

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            gated = self.use_shared_expert_gate and hidden_states.dim() == 3
            if not gated and not self.gate_up_apart():
                return super().forward(hidden_states)
            output = self._mlp(hidden_states)
            if not gated:
                return output
            by_batch = hidden_states.transpose(0, 1).contiguous()  # [b, s, h]: a view when b == 1 (THD)
            gate = torch.sigmoid(torch.nn.functional.linear(by_batch, self.gate_weight)).transpose(0, 1)
            return output * gate

        def gate_up_apart(self) -> bool:
            """Whether the gate and up projections run as two GEMMs: ``gemm="hf"``, Megatron-Core's
            own linear (not Transformer Engine's) on one tensor-parallel rank without sequence
            parallelism, no bias, and the plain gated activation ``act(gate) * up``."""
            config, fc1 = self.config, self.linear_fc1
            group = getattr(fc1, "tp_group", None)
            return (gemm == "hf" and isinstance(fc1, ColumnParallelLinear) and config.gated_linear_unit
                    and getattr(fc1, "bias", None) is None and (group is None or group_size(group) == 1)
                    and not config.sequence_parallel and not config.bias_activation_fusion
                    and not getattr(config, "use_te_activation_func", False) and not config.fp8
                    and getattr(config, "activation_func_clamp_value", None) is None
                    and not getattr(config, "glu_linear_offset", 0))  # fmt: skip

        def _mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """The shared expert's output (no bias: the shared experts have none)."""
            if not self.gate_up_apart():
                output, _ = super(SharedExpertMLP, self).forward(hidden_states)
                return output
            weight = self.linear_fc1.weight  # [gate rows; up rows]
            half = weight.shape[0] // 2
            gate = linear_each_sequence(hidden_states, weight[:half])
            up = linear_each_sequence(hidden_states, weight[half:])
            output, _ = self.linear_fc2(self.config.activation_func(gate) * up)
            return output

    return HFOrderSharedExpertMLP



def mark_expert_data_parallel(model: torch.nn.Module, config: Any) -> None:
    """Mark the routed experts' parameters as Megatron-Core marks expert-parallel ones
    (``allreduce=False``) when they are split over fewer tensor-parallel ranks than the dense layers
    (``expert_tensor_parallel_size < tensor_model_parallel_size``, e.g. gpt-oss's experts with
    biases at expert-TP 1) without expert parallelism, where Megatron-Core leaves them marked as
    dense. Under sequence parallelism each TP rank's experts see only that rank's tokens, so their
    gradients are summed over the expert data-parallel group (which holds those TP peers) - what a
    DDP wrapper and the zoo's own gradient reduction do for parameters so marked."""
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if config.num_moe_experts is None or config.expert_model_parallel_size > 1 or etp >= config.tensor_model_parallel_size:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in f".{name}":
            param.allreduce = False


def moe_mlp_submodule(arch: ArchConfig, pieces: dict[str, Any], router: str, experts: str = "grouped_mm",
                      grouped: bool = False, pack: str = "batch", router_gemm: str = "backend",
                      shared_gemm: str = "fused") -> Any:  # fmt: skip
    """The ``TransformerLayerSubmodules.mlp`` value of an MoE layer (this Megatron-Core version's
    form): ``MoELayer`` with sequential experts of ``pieces``' linears, shared experts, router.
    ``experts``: the transformers experts implementation whose combine ``router="hf"`` follows.
    ``pack``: the numerics knob ``pack_gemms`` (``router="hf"`` only; ``"each"`` needs the decoder
    layer to be :func:`mcore_zoo.specs.pack_rows.sequence_bounds_layer_class`'s). ``router_gemm``:
    the numerics knob (``router="hf"`` only): the router logits by Megatron-Core's GEMM or by
    ``F.linear`` as transformers computes them. ``shared_gemm``: the numerics knob
    ``shared_expert_gemm`` (``router="hf"`` only): the shared expert's gate and up projections
    as one GEMM or two.
    ``grouped``: Transformer Engine's grouped-GEMM experts instead, built as Megatron-Core's TE spec
    builds them with ``moe_grouped_gemm=True`` (:func:`mcore_zoo.compat.te_grouped_experts`):
    ``TEGroupedMLP``, or :class:`HFOrderTEGroupedMLP` for ``router="hf"``."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_zoo.compat import patch_moe_utils_without_te

    patch_moe_utils_without_te()
    moe = arch.moe
    assert moe is not None
    if router not in ("hf", "mcore"):
        raise ValueError(f"router={router!r}; use 'hf' or 'mcore'")
    linears = MLPSubmodules(linear_fc1=pieces["linear_fc1"], linear_fc2=pieces["linear_fc2"])
    if experts not in ("grouped_mm", "eager"):
        raise ValueError(f"moe_experts={experts!r}; use 'grouped_mm' or 'eager'")
    if grouped:
        from mcore_zoo.compat import te_grouped_experts

        experts_spec = te_grouped_experts(hf_grouped_experts_class(experts) if router == "hf" else None)
    else:
        experts_cls = hf_experts_class(experts, moe.clamped_swiglu) if router == "hf" else SequentialMLP
        experts_spec = ModuleSpec(module=experts_cls, submodules=linears)
    router_builder: Callable[..., Any] = (
        functools.partial(hf_router_class(), moe=moe, gemm=router_gemm) if router == "hf" else TopKRouter
    )
    submodules = MoESubmodules(
        experts=experts_spec,
        shared_experts=ModuleSpec(module=hf_shared_experts_class(shared_gemm) if router == "hf" else SharedExpertMLP,
                                  submodules=linears),  # fmt: skip
        router=router_builder,
    )
    layer_cls = hf_moe_layer_class(experts, pack) if router == "hf" else MoELayer
    if hasattr(MLP, "as_mlp_submodule"):  # 0.19: builder partials (see compat.mlp_submodule)
        return functools.partial(layer_cls, submodules=submodules)
    return ModuleSpec(module=layer_cls, submodules=submodules)

