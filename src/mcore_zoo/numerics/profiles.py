"""Numerics profiles: which kernels and op orders a model build uses.

A profile is a set of named knobs. Each knob is one place where Megatron-Core / Transformer Engine
and the HF reference may compute the same math in a different order; the parity report measures
what each one costs (flip one knob, measure |dlogp| and KL).

Built-in profiles:

* ``default`` - the fast path: the backend's own norms and fusions (TE fused RoPE, fused
  bias-activation, fused softmax) where the device supports them. RoPE frequencies are still
  computed the HF way (it costs nothing and is required for Llama 3 / YaRN anyway).
* ``training`` - the backend's GEMMs, everything else in HF's op order: RMSNorm (fp32 normalise,
  cast, then the weight; not fused into the following GEMM), RoPE and SwiGLU unfused, biases added
  in the GEMM as ``torch.nn.Linear`` does, and attention as transformers' ``sdpa`` implementation
  calls ``scaled_dot_product_attention`` (one call per packed sequence). For the dense built-ins
  on ``te`` with a GPU the logits then equal those of transformers' sdpa model run on each
  sequence alone (Transformer Engine's GEMMs matched cuBLAS bit for bit in our runs; TP 1), so the
  distance to HF eager is transformers' own sdpa-vs-eager distance, at 1.3x ``default``'s
  training-step time (H100, Llama-8B-shaped layers, THD packs of 4 x 2048 and 16 x 512 tokens;
  docs/numerics.md). Meant for RL training on ``te``.
  ``with_knobs(attention="backend", linear_bias="separate")`` keeps Transformer Engine's fused
  attention (and its context-parallel ring): faster, and as close to HF eager as sdpa only on
  average.
* ``vllm-exact`` - vLLM's own batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``) in mcore's
  modules, with a backward: the trainer's log-probs bit-identical to what a vLLM engine in that
  mode computes (:mod:`mcore_zoo.specs.vllm_exact`). Needs vLLM and CUDA in the trainer process;
  backend ``local`` / ``portable``, dense models (any TP) and Qwen3-MoE at the layouts of vLLM's
  engine at data parallel 1 (TP N with expert-TP N, or with ``enable_expert_parallel`` TP N x EP N
  at expert-TP 1; on the GPU every sampled and prompt log-prob bitwise at TP1, TP2 and
  TP2 x EP2, docs/rollout.md), CP 1, no sequence parallelism.
* ``hf-exact`` - reproduce the HF op order: RMSNorm normalises in fp32, casts, then multiplies
  the weight; no fused RoPE / activation / softmax; attention computed as HF ``eager`` (or
  ``sdpa`` with ``attention="sdpa"``) math; a THD pack's GEMMs run one sequence at a time
  (``pack_gemms="each"``). With the ``local`` or ``portable`` backend this is bit-identical to
  transformers on CPU fp32 and GPU bf16 (see docs/parity), a packed sequence to transformers run on
  that sequence alone.

Knobs that need CUDA kernels are switched off automatically on a CPU-only machine, except
``grouped_experts`` (off in every built-in profile): it changes the module tree and the parameter
names, so a build that asks for it where it cannot be honoured is refused rather than downgraded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

from ..errors import ZooError


@dataclass(frozen=True)
class NumericsProfile:
    """Knobs (see module docstring).

    Attributes:
        norm: ``"mcore"`` (the backend's RMSNorm kernel) or ``"hf"`` (HF op order).
        norm_kernel: with ``norm="hf"``: ``"torch"`` (transformers' ops, autograd's backward) or
            ``"triton"`` (:mod:`mcore_zoo.kernels.hf_rmsnorm`: the same forward bits in three
            passes instead of six, a fused backward whose gradients are not autograd's bits;
            CUDA, Triton). Applies to the norms the GPT layer spec builds (input, pre-MLP, q / k
            and final norms); zero-centred norms (``1 + weight``) are refused with it.
        rope_freqs: ``"hf"`` (inv_freq computed on the CPU as transformers does, then moved) or
            ``"mcore"`` (Megatron-Core's own computation; only plain RoPE without scaling).
        rope_fusion: TE fused RoPE kernel (``te`` backend, CUDA only).
        rope_kernel: with ``rope_fusion`` off: ``"torch"`` (Megatron-Core's unfused ops) or
            ``"triton"`` (:mod:`mcore_zoo.kernels.rope`: the same arithmetic and bits, forward and
            backward, in one pass each; CUDA, Triton; no context parallelism, interleaved or MLA
            RoPE).
        bias_activation_fusion: fused (bias +) SwiGLU/GeLU kernel.
        swiglu_kernel: with ``bias_activation_fusion`` off: ``"torch"`` (Megatron-Core's unfused
            ``silu(gate) * (up + offset)``) or ``"triton"`` (:mod:`mcore_zoo.kernels.swiglu`: the same
            arithmetic, each op rounded as torch rounds it, in one pass each way; dense MLPs of
            SwiGLU models only - MoE models are refused; CUDA, Triton).
        masked_softmax_fusion: fused scale-mask-softmax (``local`` attention, CUDA only).
        attention: the core attention. ``"backend"``: the backend's own (mcore
            ``DotProductAttention`` for ``local``, ``TEDotProductAttention`` for ``te``, the
            portable ``auto`` kernel for ``portable``). Any other value puts the zoo's
            :class:`~mcore_zoo.specs.portable.PortableAttention` with that kernel into every
            backend: ``"auto"`` (CUDA: torch varlen flash attention, else flash-attn, else SDPA;
            CPU: SDPA), ``"sdpa"`` (as HF's sdpa implementation calls it), ``"eager"`` (HF eager op
            order), ``"varlen"`` (torch varlen_attn), ``"flash"`` (flash-attn package).
        fuse_norm_into_linear: ``te`` backend fuses input/pre-MLP norms into the next GEMM.
        linear_bias: ``"separate"`` (mcore: round the GEMM, then add the bias; MLP / output
            projections add it later still) or ``"fused"`` (``F.linear(x, W, b)``: bias in the GEMM
            epilogue, as ``torch.nn.Linear``; ``local`` / ``portable`` backends - TE linears
            always fuse it).
        router: MoE models only. ``"hf"``: routing weights in HF's op order (softmax or sigmoid
            over all experts, top-k, renormalise by division, scale) applied to each expert's
            output after ``linear_fc2``; ``"mcore"``: Megatron-Core's stock ``TopKRouter`` and
            ``SequentialMLP`` (weights applied before ``linear_fc2``). See
            :mod:`mcore_zoo.families.moe.spec`.
        router_gemm: MoE models with ``router="hf"`` only: the GEMM of the router logits.
            ``"backend"``: Megatron-Core's ``router_gating_linear`` (Transformer Engine's GEMM
            where TE is installed, which may split the reduction for a router's few columns; it
            keeps no copy of the input cast to fp32 for the backward). ``"hf"``: ``F.linear`` in
            the router dtype over the tokens in HF's batch-major order, as transformers computes
            them.
        shared_expert_gemm: MoE models with shared experts and ``router="hf"`` only: the shared
            expert's gate and up projections. ``"fused"``: Megatron-Core's one ``linear_fc1`` GEMM
            over both (``[2 * I, H]``); ``"hf"``: ``gate_proj`` and ``up_proj`` as two GEMMs of
            ``[I, H]`` each, as transformers' shared-expert MLP runs them (same math; on CUDA a
            GEMM of another width can be another cuBLAS kernel). Only without tensor or sequence
            parallelism of the shared expert, biases or fused activations (else ``"fused"``).
        moe_experts: MoE models with ``router="hf"`` only: which of transformers' experts
            implementations the combine of a token's experts follows. ``"grouped_mm"`` (the
            default of ``from_pretrained`` since transformers 5): each expert's weighted output
            stays in the product's dtype (fp32 where the routing weights are fp32), a token's
            outputs are summed over its top-k slots (``.sum(dim=1)``), then cast to the hidden
            dtype once. ``"eager"`` (``experts_implementation="eager"``, and transformers 4):
            each weighted output is cast to the hidden dtype, then added one expert at a time
            (``index_add_``). Both agree for two experts per token with weights in the hidden
            dtype (or fp32 models); otherwise they round differently.
        pack_gemms: how a THD pack's GEMMs are computed. ``"each"``: one sequence at a time - the
            zoo's own linears (``linear_bias="fused"``) and the MoE block (``router="hf"``: router,
            shared experts, expert GEMMs and combine) see one sequence's rows, as transformers run
            on that sequence alone sees them (a GEMM's rows can round differently at another row
            count: the CPU BLAS and cuBLAS pick kernels by shape); alignment padding runs apart,
            and the router's auxiliary losses are each sequence's. Needs the whole pack on this
            rank; the MoE block also needs no expert parallelism (else it runs the pack at once).
            ``"batch"``: every GEMM over the whole pack (faster; a sequence's rows then differ
            from a run alone by a few ulps per layer where the kernels change with the row count).
        linear_attention_pack: gated DeltaNet models only: how the zoo's gated DeltaNet layer
            computes a THD pack. ``"each"``: every sequence alone, one after the other (each
            sequence's result is bitwise what it gives run alone). ``"batch"``: the pack's sequences
            as one right-padded batch (what a BSHD batch of them costs: one pass of the delta rule's
            chunk loop over the longest sequence, not one per sequence); each sequence still starts
            from a zero state and convolution window, and the padding rows reach no sequence, but
            the batched products may round differently from a batch of one. ``"auto"``: ``"batch"``
            on CUDA, ``"each"`` on the CPU. ``default`` takes ``"auto"`` (measured on an H100, bf16, Qwen3-Next's layer: a mixed pack at 1.006x and a
            pack of 64 short sequences at 1.036x the padded batch's forward + backward, where
            ``"each"`` costs 1.43x and 10.1x); the exact profiles take ``"each"``. Not consulted
            where the layer runs on fla's kernels (``linear_attention_kernel``: a pack is then one
            varlen call).
        linear_attention_kernel: gated DeltaNet models only: the kernels of the zoo's gated
            DeltaNet layer (:mod:`mcore_zoo.families.gated_deltanet.kernels`). ``"torch"``:
            transformers' torch fallbacks op for op (bitwise vs transformers on its torch path).
            ``"fla"``: flash-linear-attention's Triton kernels (CUDA; the causal convolution and the
            chunked delta rule, a THD pack as one varlen call with ``cu_seqlens``); refused by name
            where ``fla`` is not importable or the model is on the CPU. ``"auto"``: ``"fla"`` on
            CUDA where importable, else ``"torch"``. ``default`` takes ``"auto"``; the exact
            profiles (and ``training``) keep ``"torch"``.
        kernels: ``"backend"`` (the modules the knobs above choose) or ``"vllm"``: every op of the
            decoder on vLLM's batch-invariant kernels (the ``vllm-exact`` profile; the other knobs
            are then not consulted).
        vllm_decode: ``kernels="vllm"`` only. ``"exact"`` refuses head sizes at which vLLM's
            FlashAttention-3 computes a decode step (one query per sequence) with another tiling
            than a prefill (head size <= 64: tokens at positions >= 128 that the engine sampled in
            decode steps would differ in the last bits; see :func:`mcore_zoo.kernels.vllm_ops.decode_equals_prefill`);
            ``"prefill"`` accepts them and computes every token as vLLM's prefill does.
    """

    name: str
    norm: str = "mcore"
    norm_kernel: str = "torch"
    rope_freqs: str = "hf"
    rope_fusion: bool = True
    rope_kernel: str = "torch"
    bias_activation_fusion: bool = True
    swiglu_kernel: str = "torch"
    masked_softmax_fusion: bool = True
    attention: str = "backend"
    fuse_norm_into_linear: bool = True
    linear_bias: str = "separate"
    router: str = "hf"
    router_gemm: str = "backend"
    shared_expert_gemm: str = "fused"
    moe_experts: str = "grouped_mm"
    grouped_experts: bool = False
    pack_gemms: str = "batch"
    linear_attention_pack: str = "each"
    linear_attention_kernel: str = "torch"
    kernels: str = "backend"
    vllm_decode: str = "exact"
    description: str = ""

    def __post_init__(self) -> None:
        checks = {
            "norm": ("mcore", "hf"),
            "norm_kernel": ("torch", "triton"),
            "rope_kernel": ("torch", "triton"),
            "swiglu_kernel": ("torch", "triton"),
            "rope_freqs": ("hf", "mcore"),
            "attention": ("backend", "auto", "sdpa", "eager", "varlen", "flash"),
            "linear_bias": ("separate", "fused"),
            "router": ("hf", "mcore"),
            "router_gemm": ("backend", "hf"),
            "shared_expert_gemm": ("fused", "hf"),
            "moe_experts": ("grouped_mm", "eager"),
            "pack_gemms": ("each", "batch"),
            "linear_attention_pack": ("each", "batch", "auto"),
            "linear_attention_kernel": ("torch", "fla", "auto"),
            "kernels": ("backend", "vllm"),
            "vllm_decode": ("exact", "prefill"),
        }
        for knob, allowed in checks.items():
            if getattr(self, knob) not in allowed:
                raise ZooError(f"numerics profile {self.name!r}: {knob}={getattr(self, knob)!r} not in {allowed}")
        if self.norm_kernel != "torch" and self.norm != "hf":
            raise ZooError(f"numerics profile {self.name!r}: norm_kernel={self.norm_kernel!r} is a kernel for norm='hf'"
                           f" (HF's op order), not norm={self.norm!r}")  # fmt: skip
        if self.rope_kernel != "torch" and self.rope_fusion:
            raise ZooError(f"numerics profile {self.name!r}: rope_kernel={self.rope_kernel!r} replaces the unfused RoPE;"
                           " it needs rope_fusion=False")  # fmt: skip
        triton = [k for k in ("norm_kernel", "rope_kernel", "swiglu_kernel") if getattr(self, k) != "torch"]
        if triton and self.kernels == "vllm":
            raise ZooError(f"numerics profile {self.name!r}: {triton[0]}={getattr(self, triton[0])!r} and kernels='vllm'"
                           " both replace that op (vLLM's kernels); choose one")  # fmt: skip
        if self.swiglu_kernel != "torch" and self.bias_activation_fusion:
            raise ZooError(f"numerics profile {self.name!r}: swiglu_kernel={self.swiglu_kernel!r} replaces the unfused"
                           " activation; it needs bias_activation_fusion=False")  # fmt: skip
        if not isinstance(self.grouped_experts, bool):
            raise ZooError(f"numerics profile {self.name!r}: grouped_experts={self.grouped_experts!r} must be true or false")
        if self.grouped_experts and self.name.split("+")[0] in HF_EXACT_PROFILES:
            raise ZooError(
                f"numerics profile {self.name!r}: grouped_experts=True is refused: this profile reproduces HF's"
                " op order bit for bit with one GEMM per expert (sequential experts); Transformer Engine's grouped"
                " GEMM computes the experts in other kernels. Use the 'default' or 'training' profile with"
                " backend 'te'"
            )

    def with_knobs(self, **knobs: Any) -> "NumericsProfile":
        valid = set(self.knobs())
        unknown = sorted(set(knobs) - valid)
        if unknown:
            from ..errors import ZooError

            raise ZooError(f"unknown numerics knob {unknown[0]!r}; knobs: {', '.join(sorted(valid))}")
        name = self.name + "".join(f"+{k}={v}" for k, v in sorted(knobs.items()))
        return dataclasses.replace(self, name=name, **knobs)

    def for_device(self, cuda: bool) -> "NumericsProfile":
        """Switch off knobs whose kernels need CUDA when running on the CPU."""
        if cuda:
            return self
        return dataclasses.replace(
            self, rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False
        )

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "description")}


#: profiles whose promise is HF's op order bit for bit (``with_knobs`` keeps the name as a prefix)
HF_EXACT_PROFILES = ("hf-exact", "hf-exact-sdpa")

PROFILES: dict[str, NumericsProfile] = {
    "default": NumericsProfile(
        name="default",
        linear_attention_pack="auto",
        linear_attention_kernel="auto",
        description="backend kernels and fusions; RoPE frequencies computed as HF does; gated DeltaNet layers on"
        " flash-linear-attention's kernels where importable on the GPU (else a THD pack's sequences as one padded"
        " batch on the GPU)",
    ),
    "hf-exact": NumericsProfile(
        name="hf-exact",
        norm="hf",
        rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        attention="eager",
        fuse_norm_into_linear=False,
        linear_bias="fused",
        router_gemm="hf",
        shared_expert_gemm="hf",
        pack_gemms="each",
        description="HF op order everywhere (norms, RoPE, attention math, biases); bitwise vs HF eager",
    ),
    "training": NumericsProfile(
        name="training",
        norm="hf",
        fuse_norm_into_linear=False,
        rope_fusion=False,
        bias_activation_fusion=False,
        attention="sdpa",
        linear_bias="fused",
        description="the backend's GEMMs; norms, RoPE, SwiGLU, biases and attention (sdpa) in HF's op order"
        " (on te: transformers' sdpa model's logits)",
    ),
    "hf-exact-sdpa": NumericsProfile(
        name="hf-exact-sdpa",
        norm="hf",
        rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        attention="sdpa",
        fuse_norm_into_linear=False,
        linear_bias="fused",
        router_gemm="hf",
        shared_expert_gemm="hf",
        pack_gemms="each",
        description="as hf-exact, attention as HF's sdpa implementation",
    ),
    "vllm-exact": NumericsProfile(
        name="vllm-exact",
        rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        fuse_norm_into_linear=False,
        kernels="vllm",
        description="vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): log-probs bitwise equal to the engine's",
    ),
}


def get_profile(profile: Union[str, NumericsProfile, None]) -> NumericsProfile:
    if profile is None:
        return PROFILES["default"]
    if isinstance(profile, NumericsProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ZooError(f"unknown numerics profile {profile!r}; known: {sorted(PROFILES)}") from None
