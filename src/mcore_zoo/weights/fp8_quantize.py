"""Block FP8 quantization of trained weights for an engine that serves FP8 (vLLM 0.26 with a
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``
checkpoint): the quantizer, which tensors it quantizes, and the checkpoint's
``quantization_config``. Pure torch on the weights' own device, no collectives.

The quantizer (:func:`quantize_fp8_blocks`)
    vLLM's own block quantizer, ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` - the one its
    online block quantization (``Fp8PerBlockOnlineLinearMethod``) and its UE8M0 requantization
    (``requant_weight_ue8m0_inplace``) run - op for op, on blocks of ``[128, 128]`` elements
    counted from the tensor's origin (partial blocks on the bottom and right edges)::

        amax      = max(max |w| over the block, 1e-4)      (fp32; an all-zero block gets 1e-4)
        scale_inv = amax / 448                              (fp32, one rounding)
        scale_inv = 2 ** ceil(log2(scale_inv))              (scale_fmt "ue8m0" only)
        q         = float8_e4m3fn(float32(w) * (1 / scale_inv))   (1 / scale_inv rounded to fp32
                                                                   first; round to nearest even)

    That is DeepSeek-V3's ``amax / 448`` scale with vLLM's floor for zero blocks. It differs from
    transformers' quantizer (:func:`mcore_zoo.weights.fp8.quantize_block`: ``scale = 448 / amax``,
    ``scale_inv = 1 / scale``, zero blocks ``scale_inv = 1``) in the last bit of some scales and
    for zero blocks. The engine dequantizes ``float32(q) * scale_inv`` per block.

    ``scale_fmt="ue8m0"`` gives power-of-two scales stored as fp32 (what DeepGEMM's UE8M0 path on
    Hopper / Blackwell requantizes every block to after loading, ``VLLM_USE_DEEP_GEMM_E8M0=1``):
    that requantization keeps the values of weights quantized so (the block's largest fp8
    magnitude lies in ``[224, 448]``: the same power of two, or - where it rounded to 224 - half
    of it with every fp8 value doubled, exactly), where with fp32 scales it rounds them again.

Which tensors (:meth:`Fp8BlockScheme.quantizes`)
    The ``.weight`` of every linear layer vLLM builds with its FP8 method in the dense, MoE and MLA
    model files (``LinearBase`` and ``RoutedExperts`` with the model's ``quant_config``): attention
    q / k / v / o, MLA's q_a / q_b / kv_a_proj_with_mqa / kv_b, dense and shared-expert MLPs, routed
    experts. Kept in the training dtype, as the published FP8 checkpoints keep them: embeddings
    and the LM head (not linear layers in vLLM), MoE routers (``mlp.gate``; Qwen's FP8 checkpoints
    list them in ``modules_to_not_convert``) and shared-expert gates, norms, biases and every other
    1-D tensor. A weight of two or more dimensions that neither list names is refused by name:
    whether the engine quantizes it is not known here.

Tensor parallelism
    An engine rank's shard of a quantized tensor is cut on block boundaries, so its blocks are the
    blocks of the whole tensor and quantizing the shard equals cutting the quantized tensor
    (scales cut in block units). vLLM refuses other layouts when it builds the model
    (``validate_fp8_block_shape``, ``Fp8MoEMethod.create_weights``); the refit plan refuses them
    first (:func:`mcore_zoo.rollout.fp8.fp8_refit_plan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import ShapeMismatchError, ZooError
from .fp8 import FP8_E4M3_MAX, SCALE_SUFFIX, _check_block, _from_blocks, _to_blocks, scale_grid

#: vLLM's floor of a block's amax (``per_block_cast_to_fp8``: ``clamp(1e-4)``)
AMAX_FLOOR = 1e-4
SCALE_FORMATS = ("float", "ue8m0")

#: linear layers vLLM 0.26 builds with its FP8 method (dense, MoE and MLA model files)
QUANTIZED_LINEARS = frozenset((
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
))  # fmt: skip
#: modules whose weights stay in the training dtype (embeddings, LM head, MoE routers, shared-expert gates)
UNQUANTIZED_MODULES = frozenset(("embed_tokens", "lm_head", "gate", "shared_expert_gate"))
#: of those, the linear layers an engine would otherwise quantize: listed in ``modules_to_not_convert``
_LISTED = frozenset(("lm_head", "gate", "shared_expert_gate"))


def quantize_fp8_blocks(
    weight: torch.Tensor, block: Sequence[int] = (128, 128), scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., M, N]`` (any float dtype, any device) -> ``(q float8_e4m3fn [..., M, N],
    scale_inv float32 [..., ceil(M / bm), ceil(N / bn)])``, vLLM's block quantizer bit for bit
    (module docstring). Leading dimensions (stacked experts) are quantized matrix by matrix.
    Raises for a weight of fewer than two dimensions or holding inf / NaN."""
    block = _check_block(block)
    if scale_fmt not in SCALE_FORMATS:
        raise ZooError(f"FP8 scale format {scale_fmt!r}; use one of {SCALE_FORMATS}")
    if weight.dim() < 2:
        raise ShapeMismatchError("weight", ("...", "M", "N"), tuple(weight.shape),
                                 context="FP8 block quantization needs 2-D")  # fmt: skip
    blocks = _to_blocks(weight.detach(), block)  # [L, Rb, bm, Cb, bn], zero-padded at ragged edges
    amax = blocks.abs().float().amax(dim=(2, 4), keepdim=True)
    if not torch.isfinite(amax).all():
        raise ZooError("FP8 block quantization: a block holds inf or NaN")
    scale_inv = amax.clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(scale_inv.abs())))
    q = (blocks * (1.0 / scale_inv)).to(torch.float8_e4m3fn)
    return _from_blocks(q, weight.shape), scale_inv.reshape(scale_grid(weight.shape, block))


@dataclass(frozen=True)
class Fp8BlockScheme:
    """The FP8 block format a rollout engine serves: ``block`` (``weight_block_size``) and the
    scales' form (``"float"``: ``amax / 448``; ``"ue8m0"``: its power of two above)."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"

    def __post_init__(self) -> None:
        _check_block(self.block)
        if self.scale_fmt not in SCALE_FORMATS:
            raise ZooError(f"FP8 scale format {self.scale_fmt!r}; use one of {SCALE_FORMATS}")

    def quantizes(self, name: str, shape: Sequence[int] | None = None) -> bool:
        """Whether the HF tensor ``name`` (of ``shape``, where known) is stored quantized. Raises,
        naming it, for a weight of two or more dimensions of a module neither list names."""
        module, _, leaf = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if leaf == "weight" and kind in QUANTIZED_LINEARS:
            return True
        kept = leaf == "weight" and kind in UNQUANTIZED_MODULES
        if not kept and shape is not None and len(shape) >= 2:
            raise ZooError(f"FP8 rollout: no rule for {name!r} {list(shape)}: whether the engine quantizes it is"
                           f" not known (quantized: the weights of {sorted(QUANTIZED_LINEARS)}; kept: those of"
                           f" {sorted(UNQUANTIZED_MODULES)} and 1-D tensors)")  # fmt: skip
        return False

    @staticmethod
    def scale_name(name: str) -> str:
        """``X.weight`` -> ``X.weight_scale_inv``."""
        return name + SCALE_SUFFIX

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return scale_grid(tuple(shape), self.block)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_blocks(weight, self.block, self.scale_fmt)

    def quantize_items(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` items in this format: each quantized ``X.weight`` becomes its fp8
        tensor followed by ``X.weight_scale_inv``; every other tensor passes unchanged."""
        for name, tensor in items:
            if self.quantizes(name, tuple(tensor.shape)):
                q, scale_inv = self.quantize(tensor)
                yield name, q
                yield self.scale_name(name), scale_inv
            else:
                yield name, tensor

    def scale_names(self, names: Iterable[str]) -> set[str]:
        """The ``X.weight_scale_inv`` tensors a checkpoint of these HF tensors holds."""
        return {self.scale_name(n) for n in names if self.quantizes(n)}

    def quantization_config(self, names: Iterable[str]) -> dict:
        """The checkpoint's ``quantization_config`` for a model with these HF tensors: vLLM's and
        transformers' FP8 block format, ``modules_to_not_convert`` naming (in full, as vLLM
        matches them) the LM head, routers and shared-expert gates kept in the training dtype."""
        kept = sorted({n.rpartition(".")[0] for n in names
                       if n.endswith(".weight") and n.rpartition(".")[0].rpartition(".")[2] in _LISTED})  # fmt: skip
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": kept}  # fmt: skip


__all__ = ["Fp8BlockScheme", "quantize_fp8_blocks", "QUANTIZED_LINEARS", "UNQUANTIZED_MODULES", "AMAX_FLOOR"]
