"""Reference HF models with random weights that make parity tests able to fail.

transformers initialises linears with std 0.02 and norms to 1, biases to 0. At that scale attention
is almost uniform (a wrong RoPE base barely moves the logits), swapped norms are invisible (all
ones) and swapped biases too (all zeros). :func:`randomize_` gives every parameter a distinct,
unit-preserving random value and scales query/key projections so that attention logits have a
standard deviation of about ``attention_logit_std``: attention is sharp and position-sensitive.

:func:`write_reference_checkpoint` saves such a model the way users get checkpoints
(``save_pretrained``, safetensors); load the reference back with :func:`load_reference` which uses
``from_pretrained(dtype=...)`` - never ``.to(dtype)``, which would also round RoPE's ``inv_freq``
buffer to bf16.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

#: parameter-name patterns of query / key projections (fused ones are scaled whole)
QK_PATTERNS = (r"\bq_proj\.weight$", r"\bk_proj\.weight$", r"\bqkv_proj\.weight$", r"\bquery_key_value\.weight$",
               r"\bWqkv\.weight$", r"\bc_attn\.weight$", r"\bq_a_proj\.weight$", r"\bq_b_proj\.weight$",
               r"\bkv_a_proj_with_mqa\.weight$", r"\bkv_b_proj\.weight$")  # fmt: skip
_QK = re.compile("|".join(QK_PATTERNS))
_LN = re.compile(r"(^|\.)ln[_\w]*\.weight$")


def randomize_(model: torch.nn.Module, seed: int = 0, *, attention_logit_std: float = 3.0) -> torch.nn.Module:
    """Re-initialise every parameter of an HF model in place (see module docstring).

    * 1-D parameters named like norms: ``1 + N(0, 0.1)``; norm weights transformers initialises to
      zero (zero-centred norms, which scale by ``1 + weight``: Qwen3-Next) and other 1-D
      parameters (biases): ``N(0, 0.1)``.
    * embeddings: ``N(0, 1 / sqrt(hidden))`` (O(1) logits also when the output layer is tied).
    * query/key projections: ``N(0, sqrt(attention_logit_std / fan_in))``, so ``q.k / sqrt(d)``
      has std ~ ``attention_logit_std`` for unit-RMS inputs.
    * other matrices: ``N(0, 1 / sqrt(fan_in))``.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            data = torch.empty(param.shape, dtype=torch.float32)
            if param.dim() == 1:
                is_norm = "norm" in name or _LN.search(name) is not None
                data.normal_(0.0, 0.1, generator=gen)
                if is_norm and bool(param.any()):  # an all-zero norm weight is zero-centred: 1 + weight
                    data += 1.0
            elif "embed" in name or "wte" in name:
                # 1/sqrt(hidden): tied output layers then give O(1) logits like untied ones
                data.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=gen)
            else:
                fan_in = param.shape[-1]
                std = math.sqrt(attention_logit_std / fan_in) if _QK.search(name) else 1.0 / math.sqrt(fan_in)
                data.normal_(0.0, std, generator=gen)
            param.copy_(data.to(param.dtype))
        for name, buffer in model.named_buffers():
            # MoE expert-choice biases (GLM-4.5 / DeepSeek-V3 e_score_correction_bias): zeros by
            # default, which would hide a bias that is dropped or misplaced
            if name.endswith("e_score_correction_bias"):
                data = torch.empty(buffer.shape, dtype=torch.float32).normal_(0.0, 0.05, generator=gen)
                buffer.copy_(data.to(buffer.dtype))
    return model


def hf_config_object(config: Any, attn_implementation: str = "eager", fallback_model_type: Optional[str] = None) -> Any:
    """A transformers config object from a dict / path / config object.

    ``fallback_model_type``: the built-in config class to use for a dict whose ``model_type``
    transformers does not know (Kimi-K2's ``kimi_k2``, a DeepSeek-V3 published with remote code),
    as the zoo's config reading does (:func:`~mcore_zoo.config.normalize.normalize_with_defaults`);
    remote code never runs here. The object then carries the built-in model type."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):
        cfg = dict(config)
        model_type = cfg.pop("model_type")
        if model_type not in CONFIG_MAPPING and fallback_model_type in CONFIG_MAPPING:
            cfg.pop("auto_map", None)  # the remote code it names is not what runs
            model_type = fallback_model_type
        obj = AutoConfig.for_model(model_type, **cfg)
    else:
        obj = AutoConfig.from_pretrained(str(config))
    obj._attn_implementation = attn_implementation
    return obj


def write_reference_checkpoint(
    architecture: Any,
    config: Any,
    out_dir: Union[str, os.PathLike],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attention_logit_std: float = 3.0,
) -> str:
    """Build the HF reference model of ``architecture`` with random weights; save it to ``out_dir``.

    ``architecture`` is a registry :class:`~mcore_zoo.architecture.Architecture` (its entry names
    the transformers class). A vision-language model also gets the files of its transformers
    processor (:mod:`.processor_files`). Returns ``out_dir``.
    """
    cls = architecture.reference_model_class()
    hf_config = hf_config_object(config, fallback_model_type=architecture.entry.model_type)
    torch.manual_seed(seed)
    model = cls(hf_config).to(torch.float32)
    randomize_(model, seed, attention_logit_std=attention_logit_std)
    model = model.to(dtype)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _write_as_released(Path(str(out_dir)), hf_config.model_type)
    as_dict = hf_config.to_dict()
    if "vision_config" in as_dict:  # an engine builds the transformers processor from the directory
        from .processor_files import write_processor_files

        write_processor_files(out_dir, as_dict)
    return str(out_dir)


#: tensors (name suffixes) that transformers writes in its in-memory layout but releases hold
#: transposed (dims 1 and 2), by model type: Qwen3-VL-MoE's stacked experts (released as
#: ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``; transformers 5 reads both layouts)
RELEASED_TRANSPOSED = {"qwen3_vl_moe": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")}


def _write_as_released(out_dir: Path, model_type: str) -> None:
    """Rewrite the tensors :data:`RELEASED_TRANSPOSED` names for ``model_type`` in the released layout."""
    suffixes = RELEASED_TRANSPOSED.get(model_type)
    if not suffixes:
        return
    from safetensors.torch import load_file, save_file

    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        released = {n: (t.transpose(1, 2).contiguous() if n.endswith(suffixes) else t) for n, t in tensors.items()}
        save_file(released, str(shard), metadata={"format": "pt"})


def supports_attention(architecture: Any, attn_implementation: str) -> bool:
    """Whether the transformers reference class of ``architecture`` offers ``attn_implementation``
    (gpt-oss has no ``sdpa``: its attention sinks need the eager softmax)."""
    if attn_implementation != "sdpa":
        return True
    return bool(getattr(architecture.reference_model_class(), "_supports_sdpa", True))


def load_reference(
    architecture: Any,
    checkpoint: Union[str, os.PathLike],
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    device: Optional[Union[str, torch.device]] = None,
    experts_implementation: Optional[str] = None,
) -> torch.nn.Module:
    """Load the HF reference model the way users do: ``from_pretrained(dtype=...)``, with
    ``config.use_cache = False``: a forward is the whole-sequence computation a trainer's is. (With
    its cache, transformers runs a one-token input of a gated DeltaNet model as a decode step - the
    recurrent rule and the convolution's update, another op order than the chunked rule of any longer
    input - so its logits for that token depend on ``use_cache``.)
    ``experts_implementation`` (MoE models, transformers 5): ``"grouped_mm"`` (its default) or
    ``"eager"``; ``None`` leaves transformers' default."""
    cls = architecture.reference_model_class()
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    config = _builtin_config_for_remote_type(architecture, checkpoint, attn_implementation)
    if config is not None:
        kwargs["config"] = config
    model, info = cls.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation=attn_implementation,
                                      output_loading_info=True, **kwargs)  # fmt: skip
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        from ..errors import MissingTensorsError

        raise MissingTensorsError(missing, source=f"{checkpoint} (transformers' {cls.__name__} would leave these at"
                                                  " random init, so it is no reference)")  # fmt: skip
    for sub in (model.config, getattr(model.config, "text_config", None)):
        if sub is not None and hasattr(sub, "use_cache"):
            sub.use_cache = False
    if device is not None:
        model = model.to(device)
    return own_aligned_storage(model).eval()


def _builtin_config_for_remote_type(architecture: Any, checkpoint: Any, attn_implementation: str) -> Any:
    """For a checkpoint whose ``model_type`` transformers does not know (Kimi-K2's ``kimi_k2``,
    published with remote code): its config read with the architecture's built-in config class
    (:func:`hf_config_object`), else ``None``. transformers picks its checkpoint conversions (e.g.
    per-expert weights into fused experts) by the config's model type: with the unknown one it
    leaves those weights at random init."""
    from transformers import CONFIG_MAPPING

    from ..config.normalize import read_json_config

    path = Path(str(checkpoint))
    if not (path / "config.json").is_file():
        return None
    raw = read_json_config(path)
    if raw.get("model_type") in CONFIG_MAPPING or architecture.entry.model_type not in CONFIG_MAPPING:
        return None
    return hf_config_object(raw, attn_implementation, fallback_model_type=architecture.entry.model_type)


def own_aligned_storage(model: torch.nn.Module) -> torch.nn.Module:
    """Give every CPU parameter and buffer of ``model`` storage of its own (the allocator's 64-byte
    alignment), in place; returns ``model``.

    transformers 5 keeps tensors of a safetensors file memory-mapped when no cast is needed: a
    weight then starts wherever its offset puts it in the file (any multiple of its element size).
    A CPU GEMM's rounding can depend on that alignment (measured: the same weights from two files
    whose offsets differ by 8 bytes gave logits 3e-8 apart on an AVX512 CPU), so a bitwise
    comparison against such a model would depend on how the file happened to be laid out. Every
    zoo-built model owns allocator-aligned storage; the reference gets the same."""
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None and tensor.device.type == "cpu" and tensor.data_ptr() % 64:
                        tensor.data = tensor.data.clone()
    return model
