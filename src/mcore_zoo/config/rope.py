"""RoPE: read HF rope fields (transformers 4.x and 5.x forms) and compute frequencies as HF does.

transformers 4.x configs carry ``rope_theta`` and ``rope_scaling`` (``{"type"|"rope_type": ...}``);
5.x folds both into ``rope_parameters``. :func:`read_rope` accepts either and classifies every
sub-key; an unknown RoPE type or sub-key is rejected, never approximated.

:func:`inv_freq` reproduces ``transformers.modeling_rope_utils`` operation for operation (float32,
on the CPU), so the frequencies installed into Megatron-Core's ``RotaryEmbedding`` are bitwise the
ones the HF reference uses. Megatron-Core cannot express Llama 3 scaling with non-default
parameters, or YaRN frequencies for a plain GPT model, so the zoo always installs its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import torch

from .arch import RopeSpec
from .reader import ConfigReader

#: Sub-keys each RoPE type understands (besides ``rope_type``/``type``/``rope_theta``).
_KEYS = {
    "default": {"partial_rotary_factor"},
    "linear": {"factor", "partial_rotary_factor"},
    "llama3": {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
    },
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "partial_rotary_factor",
    },
}
SUPPORTED_ROPE_TYPES = tuple(_KEYS)


def _valid_theta(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


#: M-RoPE sub-keys (Qwen3-VL's text rotary embedding, which Qwen3.5 text models use)
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _read_text_mrope(reader: ConfigReader, source: str, params: dict[str, Any]) -> Optional[list]:
    """Pop and check the M-RoPE sub-keys of ``params``; return ``mrope_section`` (None if absent).

    transformers' Qwen3.5 text model expands 1-D position ids to the same ids for all three
    sections (temporal, height, width), so its interleaved recomposition picks every frequency
    from identical angles: plain RoPE, bit for bit. The zoo feeds text position ids only."""
    section = params.pop("mrope_section", None)
    interleaved = params.pop("mrope_interleaved", None)
    if section is not None and not (isinstance(section, (list, tuple)) and len(section) == 3
                                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in section)):  # fmt: skip
        raise reader.unsupported(f"{source}.mrope_section", section, "expected three non-negative integers")
    if interleaved is not None and not isinstance(interleaved, bool):
        raise reader.unsupported(f"{source}.mrope_interleaved", interleaved, "expected true or false")
    return None if section is None else list(section)


def read_rope(reader: ConfigReader, *, max_position_embeddings: int, text_mrope: bool = False,
              multimodal_rope: bool = False, interleaved_mrope: bool = False) -> RopeSpec:
    """Read and classify the RoPE fields of an HF config (4.x or 5.x form).

    ``text_mrope``: accept the M-RoPE sub-keys (:data:`MROPE_KEYS`) of a text model whose three
    position sections always carry the same ids (:func:`_read_text_mrope`); refused otherwise.
    ``multimodal_rope``: the language model of a vision-language model, fed 3-D position ids:
    ``mrope_section`` is required and kept (``RopeSpec.mrope_section``); the interleaved layout
    (``mrope_interleaved``, Qwen3-VL) is kept (``RopeSpec.mrope_interleaved``) where
    ``interleaved_mrope`` says the model computes it, refused otherwise."""
    params: dict[str, Any]
    if reader.has("rope_parameters") and reader.peek("rope_parameters") is not None:
        params = dict(reader.peek("rope_parameters"))
        source = "rope_parameters"
        if reader.has("rope_theta"):
            reader.expect(
                "rope_theta", _valid_theta, reason="RoPE base must be a positive number",
                detail="duplicated in rope_parameters.rope_theta, which is used",
            )  # fmt: skip
        if reader.has("rope_scaling"):
            reader.ignore("rope_scaling", "duplicated in rope_parameters, which is used")
    else:
        scaling = reader.peek("rope_scaling")
        params = dict(scaling) if scaling else {}
        source = "rope_scaling"
        if "rope_theta" not in params:
            params["rope_theta"] = reader.map("rope_theta", "RotaryEmbedding base (rope_theta)", 10000.0)
        if reader.has("rope_parameters"):
            reader.ignore("rope_parameters", "null")
    if reader.has("partial_rotary_factor"):
        if "partial_rotary_factor" not in params:
            params["partial_rotary_factor"] = reader.map(
                "partial_rotary_factor", "rotary_percent (share of head_dim rotated)"
            )
        else:  # transformers 5 copies the top-level field into rope_parameters, which wins
            reader.expect(
                "partial_rotary_factor",
                params["partial_rotary_factor"],
                reason=f"differs from {source}.partial_rotary_factor={params['partial_rotary_factor']!r},"
                " which transformers uses",
                detail=f"duplicated in {source}.partial_rotary_factor, which is used",
            )

    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _KEYS:
        raise reader.unsupported(
            f"{source}.rope_type",
            rope_type,
            f"RoPE type {rope_type!r} is not implemented; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    section = _read_text_mrope(reader, source, params) if text_mrope or multimodal_rope else None
    if multimodal_rope:
        interleaved = reader.peek(source).get("mrope_interleaved") if isinstance(reader.peek(source), dict) else None
        if interleaved and not interleaved_mrope:
            raise reader.unsupported(f"{source}.mrope_interleaved", interleaved,
                                     "this model's multimodal RoPE has contiguous sections, not interleaved ones")  # fmt: skip
        if section is None:
            raise reader.unsupported(f"{source}.mrope_section", None, "multimodal RoPE needs its three sections")
    theta = params.pop("rope_theta", None)
    if theta is None:
        raise reader.unsupported(f"{source}.rope_theta", None, "RoPE base is missing")
    if not _valid_theta(theta):
        raise reader.unsupported(f"{source}.rope_theta", theta, "RoPE base must be a positive number")
    unknown = set(params) - _KEYS[rope_type]
    if unknown:
        key = sorted(unknown)[0]
        raise reader.unsupported(
            f"{source}.{key}", params[key], f"not understood for rope_type {rope_type!r}"
        )
    if rope_type in ("linear", "llama3") and params.get("factor") is None:
        raise reader.unsupported(f"{source}.factor", None, f"rope_type {rope_type!r} needs a factor")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise reader.unsupported(f"{source}.{key}", None, "llama3 RoPE needs it")
        if params["high_freq_factor"] == params["low_freq_factor"]:
            raise reader.unsupported(f"{source}.high_freq_factor", params["high_freq_factor"], "equals low_freq_factor")
    if rope_type == "yarn" and params.get("original_max_position_embeddings") is None:
        raise reader.unsupported(f"{source}.original_max_position_embeddings", None, "yarn RoPE needs it")
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]

    spec = RopeSpec(theta=float(theta), rope_type=rope_type, **params)
    if multimodal_rope:
        spec = dataclasses.replace(spec, mrope_section=tuple(section),  # summed against head_dim by the caller
                                   mrope_interleaved=bool(interleaved))  # fmt: skip
    if source == "rope_parameters":
        mrope = "" if section is None else f" (M-RoPE sections {section} over identical text position ids: plain RoPE)"
        if multimodal_rope:
            layout = "interleaved " if spec.mrope_interleaved else ""
            mrope = f" ({layout}multimodal RoPE: sections {section} (temporal, height, width) over 3-D position ids)"
        reader.map("rope_parameters", f"RoPE {describe(spec)}{mrope}")
    elif reader.has("rope_scaling"):
        if reader.peek("rope_scaling") is None:
            reader.ignore("rope_scaling", "null: no RoPE scaling")
        else:
            reader.map("rope_scaling", f"RoPE {describe(spec)}")
    return spec


def describe(spec: RopeSpec) -> str:
    parts = [f"type={spec.rope_type}", f"theta={spec.theta:g}"]
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = getattr(spec, key)
        if value is not None:
            parts.append(f"{key}={value:g}")
    if spec.partial_rotary_factor != 1.0:
        parts.append(f"partial_rotary_factor={spec.partial_rotary_factor:g}")
    return ", ".join(parts)


def rotary_dim(spec: RopeSpec, head_dim: int) -> int:
    return int(head_dim * spec.partial_rotary_factor)


def inv_freq(spec: RopeSpec, head_dim: int, max_position_embeddings: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` exactly as transformers computes them (float32, CPU).

    ``inv_freq`` has ``rotary_dim // 2`` entries; ``attention_scaling`` multiplies cos and sin
    (1.0 except for YaRN).
    """
    dim = rotary_dim(spec, head_dim)
    base = spec.theta
    if spec.rope_type in ("default", "linear", "llama3"):
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        if spec.rope_type == "linear":
            freqs /= spec.factor
        elif spec.rope_type == "llama3":
            freqs = _llama3(freqs, spec)
        return freqs, 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, dim, base)
    raise ValueError(f"unsupported rope_type {spec.rope_type!r}")


def _llama3(inv: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    factor = spec.factor
    low_freq_factor = spec.low_freq_factor
    high_freq_factor = spec.high_freq_factor
    old_context_len = spec.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(spec: RopeSpec) -> float:
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.mscale and spec.mscale_all_dim:
        return float(yarn_mscale(spec.factor, spec.mscale) / yarn_mscale(spec.factor, spec.mscale_all_dim))
    return yarn_mscale(spec.factor)


def _yarn(spec: RopeSpec, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor = spec.factor
    beta_fast = spec.beta_fast or 32
    beta_slow = spec.beta_slow or 1
    original = spec.original_max_position_embeddings

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    freqs = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return freqs, yarn_attention_factor(spec)


def hf_rope_reference(hf_config: Any) -> tuple[torch.Tensor, float]:
    """The frequencies transformers itself computes for ``hf_config`` (for tests and parity)."""
    from transformers import modeling_rope_utils as mru

    params: Mapping[str, Any] = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if params else "default"
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return mru.ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
