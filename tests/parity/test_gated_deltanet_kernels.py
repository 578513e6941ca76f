"""The gated DeltaNet layer's kernel choice (numerics knob ``linear_attention_kernel``) on the CPU, and
its ``te`` layer specs.

flash-linear-attention's Triton kernels do not run on the CPU: its two entry points are replaced by
stand-ins with fla's signatures that run transformers' torch fallbacks one sequence at a time from
``cu_seqlens`` (what fla computes per sequence). The layer with ``"fla"`` must call them as fla
expects - ``[b, t, channels]`` convolution input, q / k L2-normalised in the kernel, a THD pack as
one varlen call - and equal the ``"torch"`` layer on mixed-length packs, forward and backward. A
stand-in that carries its state across ``cu_seqlens`` must fail that comparison.
"""

from __future__ import annotations

import functools

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError
from mcore_zoo.families.gated_deltanet import kernels as linear_kernels

pytest.importorskip("megatron.core")

ARCH = "Qwen3NextForCausalLM"
DENSE = {"num_experts": 0}
#: short sequences around the 64-token chunk: one token, a partial chunk, two chunks
LENGTHS = [37, 1, 100, 5]


def _torch_fallback(name):
    from transformers.models.qwen3_next import modeling_qwen3_next

    function = getattr(modeling_qwen3_next, name)
    return getattr(function, "__wrapped__", function)  # transformers' torch path, whatever is installed


def _segments(cu_seqlens, total):
    cuts = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    return list(zip(cuts[:-1], cuts[1:]))


def _standin_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, leak=False, **kwargs):  # fmt: skip
    """fla's ``chunk_gated_delta_rule`` signature; transformers' torch fallback per sequence
    (``leak``: the whole pack as one sequence, a state carried across ``cu_seqlens``)."""
    assert use_qk_l2norm_in_kernel and scale is None and initial_state is None and not kwargs
    rule = _torch_fallback("torch_chunk_gated_delta_rule")
    if cu_seqlens is not None:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    if leak:
        cu_seqlens = None
    outs = [rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], use_qk_l2norm_in_kernel=True)[0]
            for a, b in _segments(cu_seqlens, q.shape[1])]  # fmt: skip
    return torch.cat(outs, dim=1), None


def _standin_conv(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
    """fla's ``causal_conv1d`` signature (``x`` ``[b, t, channels]``); transformers' torch fallback
    per sequence."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[0] and residual is None and not kwargs
    conv = _torch_fallback("causal_conv1d_fn")
    outs = [conv(x[:, a:b].transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
            for a, b in _segments(cu_seqlens, x.shape[1])]  # fmt: skip
    return torch.cat(outs, dim=1), None


@pytest.fixture
def fla_standin(monkeypatch):
    """fla's kernels replaced by the stand-ins, runnable on the CPU; ``fla_standin(leak=True)``
    swaps in a delta rule that leaks its state across sequences."""

    def install(leak: bool = False) -> None:
        kernels = linear_kernels.FlaKernels(functools.partial(_standin_delta_rule, leak=leak), _standin_conv,
                                            device_types=("cpu",), version="stand-in")  # fmt: skip
        monkeypatch.setattr(linear_kernels, "load_fla", lambda: kernels)

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # the stand-ins' fp32 is exact, as fla's under ieee dots
    install()
    return install


def _build(checkpoint, kernel, backend="portable", pack="each"):
    numerics = mcore_zoo.get_profile("hf-exact").with_knobs(linear_attention_kernel=kernel, linear_attention_pack=pack)
    return mcore_zoo.build_model(checkpoint, backend=backend, numerics=numerics, load=checkpoint,
                                 params_dtype=torch.float32)  # fmt: skip


def _pack(lengths, hidden, seed, align=1):
    """A THD pack of random rows; ``align > 1``: each sequence padded to a multiple of ``align`` rows
    (``cu_seqlens_q_padded``), the padding rows random too."""
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(seed)
    bounds = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    padded = torch.tensor([0] + [-(-n // align) * align for n in lengths]).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             cu_seqlens_q_padded=padded if align > 1 else None,
                             cu_seqlens_kv_padded=padded if align > 1 else None,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip
    return torch.randn(int(padded[-1]), 1, hidden, generator=gen), params


def _forward_backward(layer, x, params):
    """The layer's output and the gradients of its input and parameters for a fixed output gradient."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, None, packed_seq_params=params)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


def _max_gap(a, b):
    """The largest difference of the tensors of ``a`` and ``b``, relative to each tensor's largest entry
    (the fla path's projections are GEMMs over the whole pack, the torch path's over one sequence:
    their rows may round differently in fp32)."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


@pytest.mark.parametrize("arch_name, overrides", [(ARCH, DENSE), ("Qwen3_5ForCausalLM", {})], ids=["fused", "split"])
def test_fla_layer_equals_torch_on_a_mixed_thd_pack(mpu, reference_checkpoint, fla_standin, arch_name, overrides):
    """The gated DeltaNet layer on fla's calling convention (one varlen call per pack) equals the
    torch layer (each sequence alone) on a pack of 37, 1, 100 and 5 tokens, forward and backward, and
    on a BSHD batch, and on the pack padded for alignment (``cu_seqlens_q_padded``: the padding rows
    segments of their own in fla's varlen call, their outputs zero), within fp32 rounding; a delta
    rule whose state crosses ``cu_seqlens`` is caught; with ``linear_attention_pack="batch"`` the pack runs
    as one right-padded batch on fla's kernels, equal too."""
    ckpt = reference_checkpoint(arch_name, overrides)
    torch_layer = _build(ckpt, "torch").decoder.layers[0].self_attention
    fla_layer = _build(ckpt, "fla").decoder.layers[0].self_attention
    assert type(fla_layer).__name__ == "PortableGatedDeltaNet" and fla_layer.kernel == "fla"
    x, params = _pack(LENGTHS, fla_layer.out_proj.out_features, seed=0)
    want = _forward_backward(torch_layer, x, params)
    assert _max_gap(_forward_backward(fla_layer, x, params), want) <= 1e-5
    bshd = x[:64].view(32, 2, -1)  # [s, b, h]
    assert _max_gap(_forward_backward(fla_layer, bshd, None), _forward_backward(torch_layer, bshd, None)) <= 1e-5
    aligned, aligned_params = _pack(LENGTHS, x.shape[-1], seed=1, align=8)
    got = _forward_backward(fla_layer, aligned, aligned_params)
    assert _max_gap(got, _forward_backward(torch_layer, aligned, aligned_params)) <= 1e-5
    assert got[0][37:40].abs().max() == 0, "padding rows give zeros"
    # linear_attention_pack="batch": the pack as one right-padded batch on fla's kernels, no cu_seqlens
    batched = _build(ckpt, "fla", pack="batch").decoder.layers[0].self_attention
    assert _max_gap(_forward_backward(batched, x, params), want) <= 1e-5
    assert _max_gap(_forward_backward(batched, aligned, aligned_params), got) <= 1e-5
    fla_standin(leak=True)
    assert _max_gap(_forward_backward(fla_layer, x, params)[:1], want[:1]) > 1e-3, "a leaking state must be caught"


def test_pack_boundaries_cut_padding_into_segments_of_their_own():
    cuts, spans = linear_kernels.pack_boundaries([0, 3, 3, 8], [0, 4, 8, 16], 18)
    assert spans == [(0, 3), (8, 5)]
    assert cuts == [0, 3, 8, 13, 18]
    assert linear_kernels.pack_boundaries([0, 3, 8], [0, 3, 8], 8) == ([0, 3, 8], [(0, 3), (3, 5)])


def test_a_packs_layout_is_made_once_and_shared_by_every_layer():
    """The varlen layout (fla's ``cu_seqlens`` on the device and the host, the padding mask, the
    batch gather indices) is read from the pack once: every layer of a forward gets the same tensor
    objects (fla's own caches are keyed by them), a new pack or an in-place change gets new ones."""
    from types import SimpleNamespace

    from mcore_zoo.families.gated_deltanet.spec import _varlen_layout

    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    params = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=torch.tensor([0, 4, 8, 16], dtype=torch.int32))
    first = _varlen_layout(params, 18, torch.device("cpu"))
    assert _varlen_layout(params, 18, torch.device("cpu")) is first
    assert first.fla_arguments["cu_seqlens"].tolist() == [0, 3, 8, 13, 18]
    assert first.keep.tolist() == [True] * 3 + [False] * 5 + [True] * 5 + [False] * 5
    assert (first.longest, first.rows.tolist(), first.slots.tolist()) == (5, [0, 1, 2, 8, 9, 10, 11, 12], [0, 1, 2, 5, 6, 7, 8, 9])
    unpadded = _varlen_layout(SimpleNamespace(cu_seqlens_q=cu), 8, torch.device("cpu"))
    assert unpadded is not first and unpadded.keep is None and unpadded.spans == [(0, 3), (3, 5)]
    cu[1] = 2  # changed in place: read again
    assert _varlen_layout(params, 18, torch.device("cpu")).spans == [(0, 2), (4, 1), (8, 5)]


def test_fla_is_refused_by_name_where_it_cannot_run(mpu, reference_checkpoint):
    """No ``fla`` here (or a CPU build): ``linear_attention_kernel="fla"`` is refused naming the knob,
    never replaced by the torch path; ``"auto"`` takes torch on the CPU."""
    ckpt = reference_checkpoint(ARCH, DENSE)
    with pytest.raises(ZooError, match="linear_attention_kernel='fla'"):
        _build(ckpt, "fla")
    with pytest.raises(ZooError, match="linear_attention_kernel='fla'"):
        linear_kernels.resolve_kernel("fla", torch.zeros(1))
    assert linear_kernels.resolve_kernel("auto", torch.zeros(1)) == "torch"


def test_fla_on_cpu_tensors_is_refused_even_where_fla_imports(monkeypatch):
    kernels = linear_kernels.FlaKernels(_standin_delta_rule, _standin_conv)  # CUDA only, as fla's
    monkeypatch.setattr(linear_kernels, "load_fla", lambda: kernels)
    with pytest.raises(ZooError, match="Triton kernels run on cuda tensors, not cpu"):
        linear_kernels.check_kernel("fla", "cpu")
    assert linear_kernels.resolve_kernel("auto", torch.zeros(1)) == "torch"


def test_fla_fp32_gradients_need_fp32_dots(monkeypatch):
    """fla's fp32 backward at Triton's default TF32 dots gets the decay's gradients (A_log, dt_bias,
    the ``a`` projection) wrong by their own size: ``"fla"`` on float32 activations with gradients
    recorded is refused by name unless ``TRITON_F32_DEFAULT`` asks for fp32 dots; bf16 activations
    and calls without gradients run."""
    kernels = linear_kernels.FlaKernels(_standin_delta_rule, _standin_conv, device_types=("cpu",))
    monkeypatch.setattr(linear_kernels, "load_fla", lambda: kernels)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    x = torch.zeros(1, 4, 8)
    with pytest.raises(ZooError, match="linear_attention_kernel='fla' on float32.*TRITON_F32_DEFAULT"):
        linear_kernels.resolve_kernel("fla", x)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    assert "'tf32'" in linear_kernels.fp32_gradient_problem(x)
    with torch.no_grad():
        assert linear_kernels.resolve_kernel("fla", x) == "fla"
    assert linear_kernels.resolve_kernel("fla", x.bfloat16()) == "fla"
    for precision in linear_kernels.FP32_DOT_PRECISIONS:
        monkeypatch.setenv("TRITON_F32_DEFAULT", precision)
        assert linear_kernels.resolve_kernel("fla", x) == "fla"


def test_exact_profiles_keep_the_torch_kernels():
    assert mcore_zoo.get_profile("default").linear_attention_kernel == "auto"
    for name in ("hf-exact", "hf-exact-sdpa", "training"):
        assert mcore_zoo.get_profile(name).linear_attention_kernel == "torch", name
    with pytest.raises(ZooError, match="linear_attention_kernel"):
        mcore_zoo.get_profile("default").with_knobs(linear_attention_kernel="triton")
