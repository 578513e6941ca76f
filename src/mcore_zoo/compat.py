"""Megatron-Core version shims (0.16.x on Python 3.11, 0.19.x on Python 3.12), in one place.

Everything that differs between the supported Megatron-Core releases goes through this module:
config fields that were removed, the shape of MLP spec objects, keyword-only parallel-state
initialisation, the GPTModel deprecation warning. See ``docs/mcore-compat.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from typing import Any

#: Tested range (inclusive lower, exclusive upper).
SUPPORTED_MCORE = ((0, 16), (0, 20))


@functools.lru_cache(maxsize=None)
def mcore_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    parts = []
    for piece in package_info.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


#: Fields that exist only in some supported versions; dropped where unknown (with their default
#: meaning, so dropping is exact).
_VERSION_OPTIONAL_FIELDS = {
    "moe_use_legacy_grouped_gemm": False,
    "moe_extended_tp": False,
    "async_tensor_model_parallel_allreduce": False,
}


def make_transformer_config(cls: Any = None, **kwargs: Any) -> Any:
    """Build a ``TransformerConfig`` (or subclass), dropping fields this version lacks.

    Only fields listed as version-optional may be dropped, and only when they carry their neutral
    value; any other unknown field raises :class:`~mcore_zoo.errors.ConfigError` naming it.
    """
    from megatron.core.transformer import TransformerConfig

    cls = cls or TransformerConfig
    known = {f.name for f in dataclasses.fields(cls)}
    extras = {}
    for name in list(kwargs):
        if name in known:
            continue
        if name in _VERSION_OPTIONAL_FIELDS and kwargs[name] == _VERSION_OPTIONAL_FIELDS[name]:
            kwargs.pop(name)
        elif name.startswith("yarn_"):
            extras[name] = kwargs.pop(name)  # read with getattr by mcore; not dataclass fields
        else:
            from .errors import ConfigError

            raise ConfigError(f"{cls.__name__} (megatron-core {mcore_version()}) has no field {name!r}")
    config = cls(**kwargs)
    for name, value in extras.items():
        setattr(config, name, value)
    return config


def mlp_submodule(linear_fc1: Any, linear_fc2: Any, module: Any = None) -> Any:
    """The ``TransformerLayerSubmodules.mlp`` value for a dense MLP, in this version's form.

    0.16: ``ModuleSpec(MLP, submodules=MLPSubmodules(...))``; 0.19: ``partial(MLP.as_mlp_submodule,
    submodules=...)``. Keyword arguments only (field order differs between versions). ``module``:
    a subclass of mcore's ``MLP`` to build instead.
    """
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = module or MLP
    submodules = MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2)
    if hasattr(module, "as_mlp_submodule"):
        return functools.partial(module.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=module, submodules=submodules)


def te_grouped_experts(module: Any = None) -> Any:
    """``MoESubmodules.experts`` for Transformer Engine's grouped GEMM, as Megatron-Core's own TE
    layer spec builds it with ``moe_grouped_gemm=True`` (``TESpecProvider.grouped_mlp_modules``),
    in this version's form, with ``module`` (a ``TEGroupedMLP`` subclass) in place of
    ``TEGroupedMLP`` when given.

    0.16: ``ModuleSpec(TEGroupedMLP, MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
    linear_fc2=TERowParallelGroupedLinear, activation_func=TEActivationOp))`` (the activation set
    afterwards, as ``get_moe_module_spec_for_backend`` does); 0.19: ``partial(TEGroupedMLP,
    submodules=GroupedMLPSubmodules(...))`` with the same three. Raises
    :class:`~mcore_zoo.errors.ZooError` when the provider would fall back to another module (no
    Transformer Engine, or one too old for ``GroupedLinear``: the legacy ``GroupedMLP``)."""
    import warnings

    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .errors import ZooError

    provider = TESpecProvider()
    legacy = "moe_use_legacy_grouped_gemm" in inspect.signature(provider.grouped_mlp_modules).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 0.16 warns when it falls back to the legacy GroupedMLP
        built = provider.grouped_mlp_modules(True, False) if legacy else provider.grouped_mlp_modules(True)
    cls, submodules = built if legacy else (built.func, built.keywords.get("submodules"))
    if cls is not TEGroupedMLP or submodules is None:
        raise ZooError(f"grouped experts: Megatron-Core {mcore_version()} offers {getattr(cls, '__name__', cls)}"
                       " instead of TEGroupedMLP (Transformer Engine missing or without GroupedLinear)")  # fmt: skip
    if legacy:
        submodules.activation_func = provider.activation_func()
        return ModuleSpec(module=module or cls, submodules=submodules)
    return functools.partial(module or cls, *built.args, **built.keywords)


def take_moe_aux_losses(clear: bool = True) -> dict[str, Any]:
    """Megatron-Core's tracked per-layer MoE auxiliary losses (``{name: values}``, detached copies);
    ``clear``: forget them, entries included (the next model's are sized by its own layer count).

    0.16: the module-level dict of ``get_moe_layer_wise_logging_tracker()``, cleared in place.
    0.19: a ``MoEMetricsTracker`` (``moe_logging.get_moe_metrics_tracker()``); the legacy
    ``get_moe_layer_wise_logging_tracker()`` builds a new dict on every call, so clearing that
    clears nothing, and the tracker's own ``clear()`` keeps the entries. It is dropped
    (``destroy_moe_metrics_tracker``); the next router creates a fresh one."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # 0.16
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "get_moe_metrics_tracker"):
        metrics = moe_logging.get_moe_metrics_tracker().metrics
        values = {name: entry.values.detach().clone() for name, entry in metrics.items()}
        if clear:
            moe_logging.destroy_moe_metrics_tracker()
        return values
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    values = {name: entry["values"].detach().clone() for name, entry in tracker.items() if "values" in entry}
    if clear:
        tracker.clear()
    return values


class _DropGPTDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


@functools.lru_cache(maxsize=None)
def silence_gpt_model_deprecation() -> None:
    """0.19 logs a deprecation warning on every GPTModel construction; the zoo knows (GPTModel is
    still what every trainer uses) and filters that one message."""
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropGPTDeprecation())


def initialize_model_parallel(**kwargs: Any) -> None:
    """``parallel_state.initialize_model_parallel`` by keyword, dropping arguments this version
    does not accept when they carry their default (positional order differs between versions)."""
    from megatron.core import parallel_state

    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    accepted = {}
    for name, value in kwargs.items():
        if name in params:
            accepted[name] = value
        elif value not in (None, False, 1):
            raise TypeError(f"initialize_model_parallel of megatron-core {mcore_version()} has no {name!r}")
    parallel_state.initialize_model_parallel(**accepted)


def accepts_name_kwarg() -> bool:
    """0.19 passes ``name=`` to submodule builders."""
    return mcore_version() >= (0, 19, 0)


#: The Megatron-Core attributes this module sets: ``(module, attribute, why, scope)``. Listed with
#: every other patch by :func:`mcore_zoo.specs.patching.patches`.
PATCHES = (
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
     "defined as None where Transformer Engine is absent (0.16.1 reads it unconditionally); the value the"
     " code's own torch.mm fallback expects", "process (set once, only where undefined)"),
    ("megatron.core.tensor_parallel.layers", "_initialize_affine_weight_cpu / _initialize_affine_weight_gpu",
     "set the tensor-parallel attributes without initialising: a model built to be loaded (also in"
     " moe.experts and extensions.transformer_engine)", "while tensor_parallel_attributes_without_init builds; restored"),
)  # fmt: skip
_IN_EFFECT: set[str] = set()  # the PATCHES entries (by attribute) in place now


def patches_in_effect() -> frozenset[str]:
    """The attributes of :data:`PATCHES` this module has in place now."""
    return frozenset(_IN_EFFECT)


def patch_moe_utils_without_te() -> None:
    """0.16.1: ``moe_utils.RouterGatingLinearFunction`` reads the module global ``te_general_gemm``,
    which is only defined when Transformer Engine imports (``NameError`` otherwise). Define it as
    ``None`` - the value the code's own fallback (``torch.mm`` in the router dtype) expects - when
    absent. A no-op where Transformer Engine is installed or the release defines it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _IN_EFFECT.add("te_general_gemm")


#: Modules that call Megatron-Core's weight-initialisation helpers by their imported name.
_INIT_HELPER_MODULES = (
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.experts",
    "megatron.core.extensions.transformer_engine",
)


def _keep(tensor: Any) -> Any:
    """An init method that leaves the tensor as it is (and returns it, as ``normal_`` does)."""
    return tensor


@contextlib.contextmanager
def tensor_parallel_attributes_without_init(config: Any) -> Any:
    """Build modules under ``config`` with ``perform_initialization=False`` semantics (no random
    initialisation: every weight will be loaded) while Megatron-Core still sets each parameter's
    tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``) exactly as its own initialisation does.

    Megatron-Core sets those attributes only inside its weight-init helpers
    (``_initialize_affine_weight_cpu`` / ``_gpu``), which run only when ``perform_initialization``
    is on; without them its optimizer counts TP-sharded parameters as replicated (gradient norm and
    clipping wrong under TP). Its Transformer Engine layers already work this way (an init method
    that does nothing, ``condition_init_method``). So, for the construction only:
    ``perform_initialization`` on, the config's init methods replaced by one that does nothing, and
    the two helpers replaced by ones that set the attributes with the partition dim and stride they
    are given and skip the initialisation (the CPU helper's full-size master weight included).
    The config is restored afterwards."""
    import importlib

    from megatron.core.tensor_parallel import layers

    def cpu_helper(weight: Any, output_size: Any, input_size: Any, per_partition_size: Any, partition_dim: int,
                   init_method: Any, stride: int = 1, return_master_weight: bool = False, *args: Any,
                   skip_set_tensor_parallel_attributes: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
        return None

    def gpu_helper(weight: Any, init_method: Any, partition_dim: int, stride: int = 1, is_expert: bool = False) -> None:
        layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)

    saved_fields = {name: getattr(config, name) for name in ("perform_initialization", "init_method",
                                                             "output_layer_init_method", "embedding_init_method")
                    if hasattr(config, name)}  # fmt: skip
    patched = []
    try:
        for module_name in _INIT_HELPER_MODULES:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - e.g. the TE extension without Transformer Engine
                continue
            for name, helper in (("_initialize_affine_weight_cpu", cpu_helper), ("_initialize_affine_weight_gpu", gpu_helper)):
                if hasattr(module, name):
                    patched.append((module, name, getattr(module, name)))
                    setattr(module, name, helper)
        _IN_EFFECT.add(PATCHES[1][1])
        config.perform_initialization = True
        for name in saved_fields:
            if name != "perform_initialization":
                setattr(config, name, _keep)
        yield
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
        _IN_EFFECT.discard(PATCHES[1][1])
        for name, value in saved_fields.items():
            setattr(config, name, value)
