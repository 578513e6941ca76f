"""Build Megatron-Core ``GPTModel`` instances for a registered architecture.

:func:`build_model` is the one-call path (convert, spec, build, install RoPE, load weights);
:func:`model_provider` returns the ``(pre_process, post_process, vp_stage) -> GPTModel`` callable
that Megatron's ``get_model`` and trainers built on it expect.

Every model built here carries a :class:`ModelInfo` (``model.mcore_zoo``) with its architecture,
converted config, backend and numerics profile; loading, export and the packed forward read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from . import compat, cpu_shim
from .architecture import Architecture
from .config.arch import ArchConfig, Parallelism
from .config.rope import inv_freq
from .config.transformer import BuildOptions, gpt_model_kwargs, transformer_config_kwargs, validate_layout
from .errors import ZooError
from .provenance import warn_provider
from .vocab import install_logit_mask, padded_vocab_size
from .numerics.profiles import NumericsProfile, get_profile

INFO_ATTR = "mcore_zoo"


@dataclass
class ModelInfo:
    """What the zoo knows about a model it built (attached as ``model.mcore_zoo``)."""

    architecture: Architecture
    arch: ArchConfig
    options: BuildOptions
    config: Any  # TransformerConfig
    vp_stage: Optional[int] = None
    _weight_map: Any = field(default=None, repr=False)

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def numerics(self) -> NumericsProfile:
        return self.options.numerics

    @property
    def weight_map(self) -> Any:
        if self._weight_map is None:
            self._weight_map = self.architecture.weight_map(self.arch)
        return self._weight_map


def unwrap(model: Any) -> torch.nn.Module:
    """Strip DDP / Float16Module-style wrappers (``.module`` chains)."""
    while not hasattr(model, INFO_ATTR) and hasattr(model, "module"):
        model = model.module
    return model


def model_info(model: Any) -> ModelInfo:
    """The :class:`ModelInfo` of a zoo-built model (wrappers are looked through)."""
    inner = unwrap(model)
    info = getattr(inner, INFO_ATTR, None)
    if not isinstance(info, ModelInfo):
        raise ZooError("this model was not built by mcore_zoo.build_model (no ModelInfo attached)")
    return info


def as_chunks(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[torch.nn.Module]:
    """A model or a list of virtual-pipeline chunks, as a list of unwrapped chunks."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [unwrap(c) for c in chunks]


def _resolve(source: Any, architecture: Optional[Architecture]) -> Architecture:
    if architecture is not None:
        return architecture
    from .registry import lookup

    return lookup(source)


def _default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def prepare(
    source: Any,
    *,
    architecture: Optional[Architecture] = None,
    backend: str = "local",
    numerics: Union[str, NumericsProfile, None] = None,
    params_dtype: Optional[torch.dtype] = None,
    parallel: Optional[Parallelism] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    ignore_fields: Optional[Mapping[str, str]] = None,
    trust_remote_code: bool = False,
    perform_initialization: bool = True,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> tuple[Architecture, ArchConfig, BuildOptions, Any]:
    """Convert and configure without building: ``(architecture, arch, options, TransformerConfig)``.

    Validates the parallel layout against the model before anything is built or read.
    """
    from megatron.core.transformer import TransformerConfig  # noqa: F401 - fail early if absent

    architecture = _resolve(source, architecture)
    warn_provider(architecture)  # a third-party plugin (or an override of a built-in) is named
    arch = architecture.convert(source, ignore_fields=ignore_fields, trust_remote_code=trust_remote_code)
    cuda = torch.cuda.is_available()
    profile = get_profile(numerics).for_device(cuda)
    if parallel is None:
        from megatron.core import parallel_state

        parallel = Parallelism.from_mpu() if parallel_state.model_parallel_is_initialized() else Parallelism()
    if make_vocab_size_divisible_by is not None:  # Megatron's padded vocabulary (mcore_zoo.vocab)
        arch = arch.replace(padded_vocab_size=padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, parallel.tp))
    validate_layout(arch, parallel)
    options = BuildOptions(
        backend=backend,
        parallel=parallel,
        params_dtype=params_dtype or _default_dtype(),
        numerics=profile,
        cpu=not cuda,
        overrides=dict(overrides or {}),
        perform_initialization=perform_initialization,
    )
    config = compat.make_transformer_config(**transformer_config_kwargs(arch, options))
    return architecture, arch, options, config


def build_chunk(
    architecture: Architecture,
    arch: ArchConfig,
    options: BuildOptions,
    config: Any,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    pg_collection: Any = None,
) -> torch.nn.Module:
    """Build one ``GPTModel`` (a whole model, a pipeline stage, or a virtual-pipeline chunk)."""
    from megatron.core.models.gpt import GPTModel

    cpu_shim.activate()
    compat.silence_gpt_model_deprecation()
    specs = architecture.layer_specs(arch, options.backend, options.numerics, config=config, vp_stage=vp_stage)
    kwargs = gpt_model_kwargs(arch)
    extra: dict[str, Any] = {}
    if vp_stage is not None:
        extra["vp_stage"] = vp_stage
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    model = GPTModel(
        config=config,
        transformer_layer_spec=specs,
        pre_process=pre_process,
        post_process=post_process,
        **kwargs,
        **extra,
    )
    _cast_parameters(model, options.params_dtype)
    install_rope(model, arch, options.numerics)
    install_logit_mask(model, arch)
    setattr(model, INFO_ATTR, ModelInfo(architecture, arch, options, config, vp_stage))
    return model


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter ``params_dtype``.

    Megatron-Core's torch-norm wrapper (``local`` / ``portable`` default norms) creates fp32
    weights whatever ``params_dtype`` says, relying on a trainer's ``Float16Module`` to cast later;
    HF keeps norm weights in the model dtype, so a model that is used as built must too.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def install_rope(model: torch.nn.Module, arch: ArchConfig, numerics: NumericsProfile) -> None:
    """Give the model HF's RoPE frequencies (computed on the CPU as transformers does).

    Megatron-Core moves ``inv_freq`` to the GPU on the first forward; its ``forward`` is an
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
    rotary.inv_freq = freqs  # CPU; mcore moves it to the current device on first use
    type(rotary).forward.cache_clear()


def build_model(
    source: Any,
    *,
    architecture: Optional[Architecture] = None,
    backend: str = "local",
    numerics: Union[str, NumericsProfile, None] = None,
    params_dtype: Optional[torch.dtype] = None,
    parallel: Optional[Parallelism] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    ignore_fields: Optional[Mapping[str, str]] = None,
    load: Any = None,
    trust_remote_code: bool = False,
    device: Optional[Union[str, torch.device]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> Union[torch.nn.Module, list[torch.nn.Module]]:
    """Build the Megatron-Core model for an HF architecture.

    Args:
        source: HF config (object or dict), checkpoint directory, config.json path, or an
            architecture name together with ``load``/an example config.
        backend: ``"te"``, ``"local"`` or ``"portable"`` (see :mod:`mcore_zoo.specs.gpt`).
        numerics: profile name (``"default"``, ``"hf-exact"``, ...) or a NumericsProfile.
        params_dtype: default bf16 on CUDA, fp32 on CPU.
        parallel: layout; default: the initialised Megatron parallel state, else all 1 (the
            process group and Megatron groups are then created for a single process).
        overrides: extra ``TransformerConfig`` fields.
        ignore_fields: ``{hf_field: reason}`` to accept HF config fields no rule classifies.
        load: an HF checkpoint directory to load weights from (every parameter must be covered).
        device: where the model lives (default: the current CUDA device, else CPU).
        make_vocab_size_divisible_by: pad the embedding and output layer to a multiple of this
            times TP, as Megatron trainers do; loading and export stay exact (:mod:`mcore_zoo.vocab`).

    Returns:
        One ``GPTModel`` for this rank's pipeline stage, or a list of virtual-pipeline chunks when
        ``parallel.vpp`` is set. Each carries ``.mcore_zoo`` (:class:`ModelInfo`).
    """
    from .parallel import ensure_model_parallel

    # convert and validate the layout first: a layout that does not divide the model is an error
    # before any process group is created or any weight is read
    architecture, arch, options, config = prepare(
        source,
        architecture=architecture,
        backend=backend,
        numerics=numerics,
        params_dtype=params_dtype,
        parallel=parallel,
        overrides=overrides,
        ignore_fields=ignore_fields,
        trust_remote_code=trust_remote_code,
        perform_initialization=load is None,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    ensure_model_parallel(options.parallel)
    provider = _provider(architecture, arch, options, config)
    chunks = _build_stage_chunks(provider, options.parallel)
    target = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    chunks = [c.to(target) for c in chunks]
    if load is not None:
        from .weights.load import load_hf_weights

        load_hf_weights(chunks, load)
    return chunks if options.parallel.vpp else chunks[0]


def _build_stage_chunks(provider: Callable[..., torch.nn.Module], parallel: Parallelism) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps

    if not parallel.vpp:
        return [provider(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())]
    chunks = []
    for vp in range(parallel.vpp):
        chunks.append(
            provider(
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
            )
        )
    return chunks


def _provider(architecture: Architecture, arch: ArchConfig, options: BuildOptions, config: Any) -> Callable[..., torch.nn.Module]:
    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None, **kwargs: Any) -> torch.nn.Module:
        return build_chunk(
            architecture, arch, options, config,
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, **kwargs,
        )  # fmt: skip

    provide.transformer_config = config  # type: ignore[attr-defined]
    provide.arch = arch  # type: ignore[attr-defined]
    return provide


def model_provider(source: Any, **kwargs: Any) -> Callable[..., torch.nn.Module]:
    """A Megatron ``model_provider_func``: ``(pre_process, post_process, vp_stage=None) -> GPTModel``.

    Takes the same arguments as :func:`build_model` except ``load``/``device`` (a trainer loads
    after wrapping, with :func:`mcore_zoo.load_hf_weights`). Parallel state must be initialised
    (Megatron's ``get_model`` runs inside an initialised job). The callable exposes
    ``.transformer_config`` and ``.arch``.
    """
    for key in ("load", "device"):
        if key in kwargs:
            raise TypeError(f"model_provider does not take {key!r}")
    architecture, arch, options, config = prepare(source, **kwargs)
    return _provider(architecture, arch, options, config)
