r"""Make flash-linear-attention 0.6.0's Triton kernels run under ``TRITON_INTERPRET=1`` on the CPU
(Triton 3.6 interpreter; diagnosis only). Import before fla. Patches: ``__index__`` of size-1
tensors; bf16 (stored as uint16 by the interpreter) taken exactly to fp32 in dots and rounded back
to bf16 after elementwise ops / reductions; fla's autotuners pinned (bench/gpu/fla_pinned.py).
fla's own source needs one edit: ``i_t.to(tl.int64)`` on a Python loop int in fla/ops/common/*.py
-> ``tl.full([], i_t, tl.int64)`` (``sed -i 's/i_t_int64 = i_t\.to(tl\.int64)/i_t_int64 =
tl.full([], i_t, tl.int64)/' fla/ops/common/*.py`` in a private install). fp32 dots are exact
(ieee) unless ``CPU_FLA_TF32=1``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import triton.runtime.interpreter as interp

_orig = interp._patch_lang_tensor


def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))


interp._patch_lang_tensor = _patched
from fla_pinned import pin_fla_autotuners  # noqa: E402

pin_fla_autotuners()

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402

_orig_dot = interp.InterpreterBuilder.create_dot


def _f32(h):
    if h.dtype.scalar == tl.bfloat16:
        return interp.TensorHandle(interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
    return h


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    # the interpreter stores bf16 as uint16 and would matmul the bit patterns: take bf16 operands
    # exactly to fp32 (a GPU's bf16 MMA multiplies exactly and accumulates in fp32)
    return _orig_dot(self, _f32(a), _f32(b), d, input_precision, max_num_imprecise_acc)


interp.InterpreterBuilder.create_dot = _create_dot

import torch  # noqa: E402


def _bf16_to_f32(data):
    return (np.asarray(data).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(data):
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(data, dtype=np.float32))).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _wrap(name, pick):
    orig = getattr(interp.InterpreterBuilder, name)

    def op(self, *args):
        handles = [a for a in args if isinstance(a, interp.TensorHandle)]
        if not any(pick(h) for h in handles):
            return orig(self, *args)
        conv = [interp.TensorHandle(_bf16_to_f32(a.data), tl.float32) if isinstance(a, interp.TensorHandle)
                and a.dtype.scalar == tl.bfloat16 else a for a in args]
        out = orig(self, *conv)
        if out.dtype.scalar == tl.float32:  # a float result of bf16 inputs: rounded to bf16 as on the GPU
            return interp.TensorHandle(_f32_to_bf16(out.data), tl.bfloat16)
        return out

    setattr(interp.InterpreterBuilder, name, op)


_is_bf16 = lambda h: h.dtype.scalar == tl.bfloat16  # noqa: E731
for _name in ("binary_op", "unary_op", "create_fma"):
    _wrap(_name, _is_bf16)
# ternary: clamp on bf16 (select moves bits and is fine)


def _wrap_reduce(cls, name):
    orig = getattr(cls, name)

    def op(self, input, *args, **kwargs):
        if input.dtype.scalar != tl.bfloat16:
            return orig(self, input, *args, **kwargs)
        data = _bf16_to_f32(input.handle.data)
        out = orig(self, tl.core.tensor(interp.TensorHandle(data, tl.float32), input.type.with_element_ty(tl.float32)
                   if input.type.is_block() else tl.float32), *args, **kwargs)  # fmt: skip

        def back(t):
            if isinstance(t, list):
                return [back(x) for x in t]
            if t is None or t.dtype != tl.float32:
                return t
            return tl.core.tensor(interp.TensorHandle(_f32_to_bf16(t.handle.data), tl.bfloat16),
                                  t.type.with_element_ty(tl.bfloat16) if t.type.is_block() else tl.bfloat16)

        return tuple(back(x) for x in out) if isinstance(out, tuple) else back(out)

    setattr(cls, name, op)


_wrap_reduce(interp.ReduceOps, "sum")
_wrap_reduce(interp.ReduceOps, "min_max")
_wrap_reduce(interp.ScanOps, "cumsum")

# CPU_FLA_TF32=1: fp32 dots at Triton's default precision (TF32 on NVIDIA GPUs unless TRITON_F32_DEFAULT
# says otherwise) take their operands cut to TF32's 10-bit mantissa (round to nearest, ties away), as an
# H100's tensor cores do; explicit ieee dots (allow_tf32=False) stay exact
import os as _os  # noqa: E402
from triton._C.libtriton import ir as _ir  # noqa: E402

_TF32 = _os.environ.get("CPU_FLA_TF32") == "1"


def _tf32(h):
    bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32)
    bits = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    return interp.TensorHandle(bits.view(np.float32), tl.float32)


_exact_dot = interp.InterpreterBuilder.create_dot
DOT_COUNT = {"tf32": 0, "exact": 0}


def _create_dot_tf32(self, a, b, d, input_precision, max_num_imprecise_acc):
    if _TF32 and a.dtype.scalar == tl.float32 and input_precision == _ir.INPUT_PRECISION.TF32:
        DOT_COUNT["tf32"] += 1
        a, b = _tf32(a), _tf32(b)
    else:
        DOT_COUNT["exact"] += 1
    return _exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


interp.InterpreterBuilder.create_dot = _create_dot_tf32
