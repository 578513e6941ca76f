"""Build Megatron-Core ``GPTModel`` instances for a registered architecture.

:func:`build_chunks` builds this rank's chunks (config conversion, spec, build, install RoPE;
:func:`mcore_zoo.build_model` adds the load, job-wide, in :mod:`mcore_zoo.distributed.build`);
:func:`model_provider` returns the ``(pre_process, post_process, vp_stage) -> GPTModel``
callable that Megatron's ``get_model`` and trainers built on it expect.

Every model built here carries a :class:`~mcore_zoo.handle.ModelHandle` (``chunk.mcore_zoo``)
with its architecture, converted config, build options and placement; loading, export and the
packed forward read it.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from . import compat, cpu_shim
from .architecture import Architecture
from .config.arch import ArchConfig
from .config.rope import inv_freq
from .config.transformer import (
    BuildOptions, default_expert_tp, gpt_model_kwargs, transformer_config_class, transformer_config_kwargs, validate_layout,
)  # fmt: skip
from .errors import ZooError
from .handle import ModelHandle, ModelOnOtherRanks
from .numerics.profiles import NumericsProfile, get_profile
from .placement import Parallelism, Placement
from .provenance import warn_amendments, warn_provider
from .vocab import install_logit_mask, padded_vocab_size


def _default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


@dataclass(frozen=True)
class BuildRequest:
    """What a caller asks to be built: the one set of build options that :func:`mcore_zoo.build_model`,
    :func:`model_provider`, :func:`prepare` and :func:`mcore_zoo.dist_checkpoint.meta_model` take
    (as a ``request=`` object, or as keyword arguments of the same names).

    Attributes:
        architecture: the registered architecture (default: looked up from the HF config).
        backend: ``"te"``, ``"local"`` or ``"portable"`` (see :mod:`mcore_zoo.specs.gpt`).
        numerics: profile name (``"default"``, ``"hf-exact"``, ...) or a NumericsProfile.
        params_dtype: default bf16 on CUDA, fp32 on CPU.
        parallel: layout; default: the initialised Megatron parallel state, else all 1 (the
            process group and Megatron groups are then created for a single process).
        overrides: extra ``TransformerConfig`` fields (names are checked).
        ignore_fields: ``{hf_field: reason}`` to accept HF config fields no rule classifies.
        trust_remote_code: let transformers run the checkpoint's own config code (never by default).
        perform_initialization: run Megatron-Core's random init; :func:`mcore_zoo.build_model` decides it
            (off when it loads weights).
        head: ``"lm"`` or ``"value"``: a critic whose output layer is a width-1 value head
            (:class:`~mcore_zoo.specs.heads.ValueHead`), loaded from the checkpoint's ``score``
            tensors (transformers' ``*ForTokenClassification`` with one label); the checkpoint's
            ``lm_head.weight``, if any, is skipped and reported as such.
        value_head_init: ``"zeros"`` / ``"normal"``: initialise the value head this way when the
            checkpoint has none (a causal-LM checkpoint); without it such a load fails.
        make_vocab_size_divisible_by: pad the embedding and output layer to a multiple of this
            times TP, as Megatron trainers do; loading and export stay exact (:mod:`mcore_zoo.vocab`).
        ranks: the job's global ranks to place the model on (a reward model on 2 of 8, say);
            default: every rank. ``parallel`` is laid out over those ranks, on process groups of
            the model's own (:mod:`mcore_zoo.model_groups`); every rank of the job still calls
            :func:`mcore_zoo.build_model`, and a rank outside them gets a
            :class:`~mcore_zoo.handle.ModelOnOtherRanks` (no parameters, nothing loaded).
    """

    architecture: Optional[Architecture] = None
    backend: str = "local"
    numerics: Union[str, NumericsProfile, None] = None
    params_dtype: Optional[torch.dtype] = None
    parallel: Optional[Parallelism] = None
    overrides: Optional[Mapping[str, Any]] = None
    ignore_fields: Optional[Mapping[str, str]] = None
    trust_remote_code: bool = False
    perform_initialization: bool = True
    head: str = "lm"
    value_head_init: Optional[str] = None
    make_vocab_size_divisible_by: Optional[int] = None
    ranks: Optional[Sequence[int]] = None

    @classmethod
    def of(cls, request: Optional["BuildRequest"] = None, /, **options: Any) -> "BuildRequest":
        """``request`` (default: all defaults) with ``options`` set; an unknown option is a
        ``TypeError`` naming it and the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown build option(s) {unknown}; the options are {sorted(known)}")
        if request is not None and not isinstance(request, cls):
            raise TypeError(f"request must be a BuildRequest, not {type(request).__name__}")
        return replace(request or cls(), **options)


@dataclass(frozen=True)
class BuildPlan:
    """Everything decided before a module is built: the architecture, its converted config, the
    build options (parallel sizes validated against the model) and the ``TransformerConfig``."""

    architecture: Architecture
    arch_config: ArchConfig
    options: BuildOptions
    transformer_config: Any

    def new_handle(self, placement: Optional[Placement] = None) -> ModelHandle:
        """A handle for a model built from this plan at ``placement`` (default: under the running
        parallel state)."""
        placement = placement or Placement.current().with_model_options(self.options.parallel)
        return ModelHandle(self.architecture, self.arch_config, self.options, self.transformer_config, placement)

    def build_chunk(self, *, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                    pg_collection: Any = None, placement: Optional[Placement] = None) -> torch.nn.Module:
        """One ``GPTModel``: a whole model, a pipeline stage or a virtual-pipeline chunk (no handle
        attached). ``placement``: where it sits (default: the running parallel state); on a
        placement with its own groups the chunk is built on them (``pg_collection``)."""  # fmt: skip
        from megatron.core.models.gpt import GPTModel

        cpu_shim.activate()
        compat.silence_gpt_model_deprecation()
        arch, options = self.arch_config, self.options
        placement = placement or Placement.current()
        stage: dict[str, Any] = {}
        if placement.own_groups:  # Megatron-Core would read the stage from parallel_state
            stage["pp_rank"] = placement.pp_rank
            pg_collection = pg_collection or placement.pg_collection
        specs = self.architecture.layer_specs(arch, options.backend, options.numerics,
                                              config=self.transformer_config, vp_stage=vp_stage, **stage)  # fmt: skip
        extra: dict[str, Any] = {}
        if vp_stage is not None:
            extra["vp_stage"] = vp_stage
        if pg_collection is not None:
            extra["pg_collection"] = pg_collection
        kwargs = gpt_model_kwargs(arch)
        if options.head == "value":  # the critic has no LM head to tie the embedding to
            kwargs["share_embeddings_and_output_weights"] = False
        model_class = GPTModel
        if arch.mtp_num_layers:  # multi-token prediction: the block lives on the last stage (families/mtp/spec.py)
            from .families.mtp.spec import mtp_block_spec, mtp_gpt_model_class

            model_class = mtp_gpt_model_class()
            if post_process:
                kwargs["mtp_block_spec"] = mtp_block_spec(arch, options.backend, options.numerics)
        # without random init (weights to be loaded) Megatron-Core would leave the tensor-parallel
        # attributes unset: its optimizer then counts sharded parameters as replicated
        construction = (contextlib.nullcontext() if self.transformer_config.perform_initialization
                        else compat.tensor_parallel_attributes_without_init(self.transformer_config))  # fmt: skip
        with construction:
            model = model_class(
                config=self.transformer_config,
                transformer_layer_spec=specs,
                pre_process=pre_process,
                post_process=post_process,
                **kwargs,
                **extra,
            )
        if options.head == "value" and post_process:
            from .specs.heads import ValueHead

            model.output_layer = ValueHead(self.transformer_config, options.value_head_init, tp_group=placement.groups.tp)
        _cast_parameters(model, options.params_dtype)
        if arch.moe is not None:
            from .families.moe.spec import mark_expert_data_parallel

            mark_expert_data_parallel(model, self.transformer_config)
        install_rope(model, arch, options.numerics)
        if options.numerics.rope_kernel == "triton":
            enable_rope_kernel(model, arch)
        if getattr(model, "rotary_pos_emb", None) is not None and not self.transformer_config.apply_rope_fusion:
            from .specs import thd_rope

            thd_rope.install()  # Megatron-Core's unfused THD RoPE over a whole pack at once (same bits)
        if arch.vision is not None:  # the vision tower before the decoder (families/vision_language)
            from .families.vision_language.spec import attach_vision_tower

            attach_vision_tower(model, arch, options.params_dtype)
        if options.numerics.kernels == "vllm":  # the output layer and RoPE on vLLM's kernels
            from .specs.vllm_exact import install

            install(model, arch, self.transformer_config, options.params_dtype)
        if options.head != "value":  # a value head has no vocabulary to mask
            install_logit_mask(model, arch, placement.tp_rank)
        if options.numerics.pack_gemms == "each" and post_process:
            from .specs.pack_rows import install_output_layer

            install_output_layer(model)  # the LM head's GEMM one sequence at a time, as the layers'
        return model


def prepare(source: Any, request: Optional[BuildRequest] = None, /, **options: Any) -> BuildPlan:
    """Convert and configure without building. The HF config is read once; the parallel layout
    (default: the initialised parallel state's, else all 1) is validated against the model here,
    before anything is built or read. ``request`` / ``options``: a :class:`BuildRequest`."""
    from megatron.core.transformer import TransformerConfig  # noqa: F401 - fail early if absent

    from .registry import lookup, read_config_dict

    req = BuildRequest.of(request, **options)
    remote = req.trust_remote_code and not isinstance(source, Mapping) and not hasattr(source, "to_dict")
    hf_config = source if remote else read_config_dict(source)  # the file is read once (remote code: by transformers)
    _check_head(req.head, req.value_head_init)
    architecture = req.architecture or lookup(_causal_lm_name(hf_config) if req.head == "value" else hf_config)
    warn_provider(architecture)  # a third-party plugin (or an override of a built-in) is named
    ignore_fields = req.ignore_fields
    if req.head == "value":
        ignore_fields = {**_value_head_fields(hf_config), **dict(ignore_fields or {})}
    arch = architecture.config_from_hf(hf_config, ignore_fields=ignore_fields, trust_remote_code=req.trust_remote_code)
    warn_amendments(arch)  # an extension that changed the converted config is named
    if req.head == "value" and arch.mtp_num_layers:
        raise ZooError(f"{arch.architecture}: a value head has no multi-token prediction; drop the MTP layers"
                       " with ignore_fields={'num_nextn_predict_layers': reason}")  # fmt: skip
    cuda = torch.cuda.is_available()
    parallel = default_expert_tp(arch, req.parallel) if req.parallel is not None else Placement.current().parallel
    if req.make_vocab_size_divisible_by is not None:  # Megatron's padded vocabulary (mcore_zoo.vocab)
        arch = arch.replace(padded_vocab_size=padded_vocab_size(arch.vocab_size, req.make_vocab_size_divisible_by, parallel.tp))
    validate_layout(arch, parallel)
    options = BuildOptions(
        backend=req.backend,
        parallel=parallel,
        params_dtype=req.params_dtype or _default_dtype(),
        numerics=get_profile(req.numerics).for_device(cuda),
        cpu=not cuda,
        overrides=dict(req.overrides or {}),
        perform_initialization=req.perform_initialization,
        head=req.head,
        value_head_init=req.value_head_init,
    )
    config = compat.make_transformer_config(transformer_config_class(arch), **transformer_config_kwargs(arch, options))
    return BuildPlan(architecture, arch, options, config)


def _check_head(head: str, value_head_init: Optional[str]) -> None:
    from .specs.heads import VALUE_HEAD_INITS

    if head not in ("lm", "value"):
        raise ZooError(f"unknown head {head!r}; use 'lm' or 'value'")
    if value_head_init is not None and (head != "value" or value_head_init not in VALUE_HEAD_INITS):
        raise ZooError(f"value_head_init={value_head_init!r}: one of {VALUE_HEAD_INITS}, with head='value' only")


#: HF classification-head class suffixes whose checkpoints a value-head model loads (the decoder
#: is the causal LM's; ``score`` is the head)
_HEAD_SUFFIXES = ("ForTokenClassification", "ForSequenceClassification")


def _config_dict(hf_config: Any) -> Mapping:
    return hf_config if isinstance(hf_config, Mapping) else (hf_config.to_dict() if hasattr(hf_config, "to_dict") else {})


def _causal_lm_name(hf_config: Any) -> Any:
    """The causal-LM architecture a critic checkpoint's decoder belongs to (``LlamaForTokenClassification``
    -> ``LlamaForCausalLM``); other configs are returned as they are."""
    names = list(_config_dict(hf_config).get("architectures") or [])
    for name in names:
        for suffix in _HEAD_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)] + "ForCausalLM"
    return hf_config


def _value_head_fields(hf_config: Any) -> dict[str, str]:
    """HF config fields of a classification head that a value head honours (one label, no
    dropout in effect); anything else is refused."""
    hf_config = _config_dict(hf_config)
    classifier = any(str(n).endswith(_HEAD_SUFFIXES) for n in hf_config.get("architectures") or [])
    labels = hf_config.get("id2label")
    if classifier and labels is not None and len(labels) != 1:
        raise ZooError(f"head='value' needs one output (num_labels=1); the config has {len(labels)} labels")
    dropout = hf_config.get("classifier_dropout")
    if dropout:
        raise ZooError(f"head='value': classifier_dropout={dropout} is not applied by the zoo's value head; set it to 0")
    reason = "value head: one output, no dropout"
    return {name: reason for name in ("id2label", "label2id", "num_labels", "classifier_dropout", "problem_type") if name in hf_config}


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter ``params_dtype``.

    Megatron-Core's torch-norm wrapper (``local`` / ``portable`` default norms) creates fp32
    weights whatever ``params_dtype`` says, relying on a trainer's ``Float16Module`` to cast later;
    HF keeps norm weights in the model dtype, so a model that is used as built must too. A
    parameter marked ``keep_fp32`` (one the reference keeps in fp32, e.g. a router's gate weight:
    :attr:`~mcore_zoo.config.arch.MoESpec.router_weight_dtype`) stays as it is.
    """
    with torch.no_grad():
        for param in model.parameters():
            if getattr(param, "keep_fp32", False):
                continue
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def install_rope(model: torch.nn.Module, arch: ArchConfig, numerics: NumericsProfile) -> None:
    """Give the model HF's RoPE frequencies (computed on the CPU as transformers does).

    They stay on the CPU (Megatron-Core's ``RotaryEmbedding`` moves them to the GPU on the first
    forward), except under a ``MultimodalRotaryEmbedding``, which never moves them: there they go
    to the device Megatron-Core built its own on (:func:`rope_frequency_device`), or multimodal
    RoPE's angles would be computed on the CPU next to GPU activations. ``forward`` is an
    ``lru_cache``, cleared here so no stale embedding survives.
    """
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    if numerics.rope_freqs == "mcore":
        if arch.rope.rope_type != "default":
            raise ZooError(
                f"{arch.architecture}: rope_freqs='mcore' cannot express rope_type={arch.rope.rope_type!r}"
            )
        return
    freqs, _scaling = inv_freq(arch.rope, arch.head_dim, arch.max_position_embeddings)
    if freqs.shape != rotary.inv_freq.shape:
        raise ZooError(f"RoPE frequency count {tuple(freqs.shape)} != mcore's {tuple(rotary.inv_freq.shape)}")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    if isinstance(rotary, MultimodalRotaryEmbedding):
        freqs = freqs.to(rope_frequency_device(rotary.inv_freq.device))  # a copy: the values unchanged
    rotary.inv_freq = freqs
    cached = getattr(type(rotary).forward, "cache_clear", None)  # multimodal RoPE computes per call
    if cached is not None:
        cached()


def enable_rope_kernel(model: torch.nn.Module, arch: ArchConfig) -> None:
    """Numerics knob ``rope_kernel="triton"``: the model's attention rotates through
    :mod:`mcore_zoo.kernels.rope` (``config.zoo_rope_kernel``, read by
    :mod:`mcore_zoo.specs.rope_dispatch`). Refused for RoPE it does not compute and without Triton."""
    from .kernels import rope as kernel
    from .kernels.triton_rows import refuse_without_triton
    from .specs import rope_dispatch

    config = getattr(model, "config", None)
    if arch.rope.interleaved or arch.rope.mrope_section is not None or arch.mla is not None:
        raise ZooError(f"{arch.architecture}: rope_kernel='triton' computes the plain half-rotation RoPE, not this"
                       " architecture's (interleaved, multimodal or MLA); use rope_kernel='torch'")  # fmt: skip
    if getattr(model, "rotary_pos_emb", None) is None or config is None:
        raise ZooError(f"{arch.architecture}: rope_kernel='triton' - this model applies no RoPE through Megatron-Core's attention")
    refuse_without_triton("rope_kernel", kernel.available())
    config.zoo_rope_kernel = "triton"
    rope_dispatch.install()


def rope_frequency_device(built_on: torch.device) -> torch.device:
    """Where HF's RoPE frequencies go under a rotary module Megatron-Core built its own on
    ``built_on``: that device, but the CPU for a meta build (a model without storage, whose
    frequencies must still hold values)."""
    return torch.device("cpu") if built_on.type == "meta" else built_on


def build_chunks(
    source: Any,
    request: Optional[BuildRequest] = None,
    /,
    *,
    device: Optional[Union[str, torch.device]] = None,
    **options: Any,
) -> list[torch.nn.Module]:
    """This rank's chunks of the model for an HF architecture: one ``GPTModel`` per virtual
    pipeline stage (one without ``parallel.vpp``), each carrying the one
    :class:`~mcore_zoo.handle.ModelHandle`. ``request`` / ``options``: a :class:`BuildRequest`
    (``perform_initialization=False`` when the weights are loaded next); ``device`` as in
    :func:`mcore_zoo.build_model`. Creates the parallel state if there is none. Loading is the
    caller's (:func:`mcore_zoo.build_model` with ``load=``, in :mod:`mcore_zoo.distributed.build`)."""
    from .parallel import placement_for

    # convert and validate the layout first: a layout that does not divide the model is an error
    # before any process group is created or any weight is read
    plan = prepare(source, request, **options)
    placement = placement_for(plan.options.parallel, plan.arch_config, BuildRequest.of(request, **options).ranks)
    if not placement.holds_model:  # placed on other ranks of the job: nothing to build here
        return [ModelOnOtherRanks(plan.new_handle(placement))]
    provide = _provider(plan, placement)
    target = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    return [c.to(target) for c in _build_stage_chunks(provide, placement)]


def _build_stage_chunks(provider: Callable[..., torch.nn.Module], placement: Placement) -> list[torch.nn.Module]:
    """This rank's chunks: the first (virtual) stage embeds, the last one holds the output layer."""
    if not placement.parallel.vpp:
        return [provider(pre_process=placement.first_stage, post_process=placement.last_stage)]
    last = placement.vpp - 1
    return [provider(pre_process=placement.first_stage and vp == 0, post_process=placement.last_stage and vp == last,
                     vp_stage=vp) for vp in range(placement.vpp)]  # fmt: skip


def _provider(plan: BuildPlan, placement: Optional[Placement] = None) -> Callable[..., torch.nn.Module]:
    """The provider callable; every chunk it builds joins one handle (created at the first call,
    at ``placement``, default: the parallel state in effect then)."""
    handles: list[ModelHandle] = []

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None, **kwargs: Any) -> torch.nn.Module:
        if not handles:
            handles.append(plan.new_handle(placement))
        chunk = plan.build_chunk(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                 placement=handles[0].placement, **kwargs)  # fmt: skip
        return handles[0].attach(chunk, vp_stage)

    provide.transformer_config = plan.transformer_config  # type: ignore[attr-defined]
    provide.arch_config = plan.arch_config  # type: ignore[attr-defined]
    return provide


def model_provider(source: Any, request: Optional[BuildRequest] = None, /, **options: Any) -> Callable[..., torch.nn.Module]:
    """A Megatron ``model_provider_func``: ``(pre_process, post_process, vp_stage=None) -> GPTModel``.

    Takes the build options of :func:`mcore_zoo.build_model` (a :class:`BuildRequest` and / or keywords),
    not ``load``/``device`` (a trainer loads after wrapping, with :func:`mcore_zoo.load_hf_weights`). Parallel state must be initialised
    (Megatron's ``get_model`` runs inside an initialised job). The callable exposes
    ``.transformer_config`` and ``.arch_config``; the chunks it builds share one model handle.
    """
    for key in ("load", "device", "ranks"):
        if key in options or (key == "ranks" and request is not None and request.ranks is not None):
            raise TypeError(f"model_provider does not take {key!r}")
    return _provider(prepare(source, request, **options))
