"""An HF ``quantization_config`` read as data: the one quantized checkpoint format the zoo
accepts (FP8 blocks, as DeepSeek-V3 / R1 and Kimi-K2 publish theirs), every key classified.
Dequantizing and requantizing the tensors is :mod:`mcore_zoo.weights.fp8`'s."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import UnclassifiedConfigFieldsError, UnsupportedConfigError
from .reader import ConfigReader

#: ``quantization_config.fmt`` -> the checkpoint's FP8 dtype
FMT_DTYPES = {"e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Fp8BlockFormat:
    """An FP8 block-quantized checkpoint's ``quantization_config``, validated.

    ``modules_to_not_convert``: module-name patterns whose weights stay unquantized (transformers'
    matching: prefix up to a module boundary, regex with the same boundary, or suffix).
    """

    block: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return FMT_DTYPES[self.fmt]

    @classmethod
    def from_hf(
        cls, quantization_config: Mapping[str, Any] | Any, *, architecture: str = "checkpoint"
    ) -> Fp8BlockFormat:
        """Parse an HF ``quantization_config`` (dict, or a transformers config object), classifying
        every key: mapped, ignored (no effect on the weights) or refused with an error naming it."""
        if not isinstance(quantization_config, Mapping):
            to_dict = getattr(quantization_config, "to_dict", None)
            if to_dict is None:
                raise UnsupportedConfigError(
                    architecture, "quantization_config", quantization_config, "not a mapping"
                )
            quantization_config = to_dict()
        cfg = dict(quantization_config)

        def refuse(key: str, reason: str) -> UnsupportedConfigError:
            return UnsupportedConfigError(architecture, f"quantization_config.{key}", cfg.get(key), reason)

        method = cfg.pop("quant_method", None)
        if method != "fp8":
            raise UnsupportedConfigError(
                architecture, "quantization_config.quant_method", method,
                "only FP8 block quantization (quant_method 'fp8') is supported; load a dequantized checkpoint",
            )  # fmt: skip
        fmt = cfg.pop("fmt", "e4m3")
        if fmt not in FMT_DTYPES:
            raise UnsupportedConfigError(
                architecture, "quantization_config.fmt", fmt, "only e4m3 FP8 weights are supported"
            )
        scheme = cfg.pop("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise UnsupportedConfigError(
                architecture, "quantization_config.activation_scheme", scheme,
                "only 'dynamic' (no stored activation scales) is supported",
            )  # fmt: skip
        if "weight_block_size" not in cfg or cfg["weight_block_size"] is None:
            raise refuse("weight_block_size", "a block size is required (per-tensor FP8 is not supported)")
        block = cfg.pop("weight_block_size")
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
        ):
            raise UnsupportedConfigError(
                architecture, "quantization_config.weight_block_size", block, "must be two positive integers"
            )
        skip = cfg.pop("modules_to_not_convert", None)
        ignored = cfg.pop("ignored_layers", None)
        if skip is not None and ignored is not None and list(skip) != list(ignored):
            raise UnsupportedConfigError(
                architecture, "quantization_config.ignored_layers", ignored,
                f"differs from modules_to_not_convert={skip!r}; give one skip list",
            )  # fmt: skip
        skip = skip if skip is not None else ignored
        if skip is not None and (isinstance(skip, str) or not all(isinstance(p, str) for p in skip)):
            raise UnsupportedConfigError(
                architecture,
                "quantization_config.modules_to_not_convert",
                skip,
                "must be a list of module names",
            )
        if cfg.get("scale_fmt", "float") != "float":
            raise refuse("scale_fmt", "only fp32 scales ('float') are supported (not UE8M0)")
        cfg.pop("scale_fmt", None)
        if cfg.get("modules_to_convert"):
            raise refuse("modules_to_convert", "quantized embeddings are not supported")
        cfg.pop("modules_to_convert", None)
        if cfg.get("expert_dtype", "fp8") != "fp8":
            raise refuse("expert_dtype", "only FP8 experts are supported (not FP4)")
        cfg.pop("expert_dtype", None)
        cfg.pop("dequantize", None)  # transformers' loading switch; loading here always dequantizes
        if cfg:
            raise UnclassifiedConfigFieldsError(
                architecture, {f"quantization_config.{k}": v for k, v in cfg.items()}
            )
        return cls(
            block=(block[0], block[1]),
            fmt=fmt,
            activation_scheme=scheme,
            modules_to_not_convert=tuple(skip or ()),
        )

    def is_skipped(self, module: str) -> bool:
        """Whether module ``module`` (a tensor name without ``.weight``) is in the skip list."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return any(
            re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.modules_to_not_convert
        )


def read_quantization(reader: ConfigReader) -> Optional[dict]:
    """``quantization_config``: an FP8 block-quantized checkpoint (DeepSeek-V3 / R1, Kimi-K2 publish
    theirs so) is dequantized on load; every other quantization is refused, naming it."""
    q = reader.peek("quantization_config")
    if not q:
        reader.ignore("quantization_config", "null")
        return None
    fmt = Fp8BlockFormat.from_hf(q, architecture=reader.architecture)  # refusals name quantization_config.<key>
    reader.map("quantization_config", f"FP8 block-quantized checkpoint ({fmt.fmt}, blocks {list(fmt.block)}):"
               " F8 weights dequantized with their weight_scale_inv into the model dtype on load;"
               " save_hf_checkpoint(fp8=True) writes the format back")  # fmt: skip
    return dict(q)
