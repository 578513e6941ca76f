"""Qwen3-Next's gated DeltaNet layers on the CPU: THD packs reset the recurrent state and the
convolution window at every sequence start (and so do Qwen3.5's, whose input projections are
split), the dense-MLP form is bitwise equal to transformers,
and the published Qwen3-Next-80B-A3B config converts with every field classified.

The conformance suite (``test_builtin_conformance.py``) runs every contract on the MoE example
config of ``Qwen3NextForCausalLM``; these tests add what it does not check.
"""

from __future__ import annotations

import json

import pytest
import torch

import mcore_zoo
from mcore_zoo.testing.common import assert_same

from ..conftest import CONFIGS, random_sequences

ARCH = "Qwen3NextForCausalLM"
#: every layer with the dense MLP; 70 tokens span two of the delta rule's 64-token chunks
DENSE = {"num_experts": 0}
#: the dense forms of the two input-projection layouts: Qwen3-Next's fused, Qwen3.5's split
LAYOUTS = pytest.mark.parametrize("arch_name, overrides", [(ARCH, DENSE), ("Qwen3_5ForCausalLM", {})],
                                  ids=["fused", "split"])  # fmt: skip
LENGTHS = [70, 9, 33, 1]


def _build(checkpoint, backend="portable", numerics="hf-exact"):
    return mcore_zoo.build_model(checkpoint, backend=backend, numerics=numerics, load=checkpoint,
                                 params_dtype=torch.float32).eval()  # fmt: skip


def _gap(a, b) -> float:
    """Largest |a - b| (0 for a one-token sequence, which has no next-token log-prob)."""
    return (a - b).abs().max().item() if a.numel() else 0.0


def _logprobs(model, seqs):
    with torch.no_grad():
        return mcore_zoo.packed_forward(model, seqs, seq_format="thd", align=1).logprobs


def test_dense_form_matches_transformers_on_bshd_and_thd(mpu, reference_checkpoint, hf_reference):
    """``num_experts: 0`` (a dense MLP on every layer): ``local`` ``hf-exact`` BSHD equals transformers
    bit for bit, and so does each sequence of a ``portable`` ``hf-exact`` THD pack - the one-token
    sequence too (``hf-exact`` runs each sequence's GEMMs on its own rows; transformers' reference
    runs without its cache, with which it would take a one-token input as a decode step:
    :func:`mcore_zoo.parity.reference.load_reference`)."""
    ckpt = reference_checkpoint(ARCH, DENSE)
    hf = hf_reference(ARCH, ckpt, "eager")
    ids = torch.stack(random_sequences([40, 40, 40], 256, seed=1))
    with torch.no_grad():
        local = _build(ckpt, backend="local")(ids, torch.arange(40).expand(3, -1), None)
        assert_same(local, hf(ids).logits, "local hf-exact BSHD logits", exact=True)
        seqs = random_sequences(LENGTHS, 256, seed=3)
        packed = mcore_zoo.packed_forward(_build(ckpt), seqs, seq_format="thd", align=1).logits
        for seq, logits in zip(seqs, packed):
            assert_same(logits, hf(seq[None]).logits[0], f"THD pack, {seq.numel()}-token sequence", exact=True)


@pytest.mark.parametrize("arch_name", [ARCH, "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_hf_exact_pack_matches_transformers_on_each_sequence_bitwise(mpu, reference_checkpoint, hf_reference,
                                                                     arch_name):  # fmt: skip
    """The three architectures' examples (Qwen3-Next's and Qwen3.5-MoE's with their MoE blocks):
    every sequence of a ``local`` ``hf-exact`` THD pack - a one-token sequence included - equals
    transformers on that sequence alone bit for bit (each sequence's GEMMs, experts included, on its
    own rows)."""
    ckpt = reference_checkpoint(arch_name)
    hf = hf_reference(arch_name, ckpt, "eager")
    seqs = random_sequences(LENGTHS, 256, seed=5)
    with torch.no_grad():
        packed = mcore_zoo.packed_forward(_build(ckpt, backend="local"), seqs, seq_format="thd", align=1).logits
        for seq, logits in zip(seqs, packed):
            assert_same(logits, hf(seq[None]).logits[0], f"THD pack, {seq.numel()}-token sequence", exact=True)


@LAYOUTS
def test_thd_pack_leaks_nothing_across_sequences(mpu, reference_checkpoint, arch_name, overrides):
    """Changing one sequence of a pack (its last tokens sit right before the next sequence: a
    convolution window or recurrent state carried over would pass them on) leaves every other
    sequence's log-probs bitwise unchanged; and a pack of one sequence equals it in the full pack."""
    model = _build(reference_checkpoint(arch_name, overrides))
    seqs = random_sequences(LENGTHS, 256, seed=4)
    before = _logprobs(model, seqs)
    for changed in (0, 1):
        mutated = [s.clone() for s in seqs]
        mutated[changed][-3:] = (mutated[changed][-3:] + 1) % 256
        after = _logprobs(model, mutated)
        for i, (a, b) in enumerate(zip(before, after)):
            if i != changed:
                assert torch.equal(a, b), f"changing sequence {changed} changed sequence {i}'s log-probs"
        if seqs[changed].numel() > 3:
            assert not torch.equal(before[changed], after[changed]), "the mutation must change its own sequence"
    for i, seq in enumerate(seqs):
        assert torch.equal(_logprobs(model, [seq])[0], before[i]), f"sequence {i}: alone != in the pack"


@LAYOUTS
def test_batched_pack_runs_each_sequence_from_a_zero_state(mpu, reference_checkpoint, arch_name, overrides):
    """``linear_attention_pack="batch"`` (the pack's sequences as one right-padded batch inside the
    layer): every sequence within fp32 rounding of the pack run one sequence after the other, with
    alignment padding too; changing one sequence leaves the others' log-probs where they were (no
    state, window or padding row reaches another sequence); gradients flow to the layer's weights."""
    ckpt = reference_checkpoint(arch_name, overrides)
    batched = _build(ckpt, numerics=mcore_zoo.get_profile("hf-exact").with_knobs(linear_attention_pack="batch"))
    each = _build(ckpt)
    seqs = random_sequences(LENGTHS, 256, seed=7)
    want = _logprobs(each, seqs)
    got = _logprobs(batched, seqs)
    with torch.no_grad():
        aligned = mcore_zoo.packed_forward(batched, seqs, seq_format="thd", align=8).logprobs
    for i, (a, b, c) in enumerate(zip(got, want, aligned)):
        assert _gap(a, b) <= 1e-5, f"sequence {i}: batched pack vs one by one"
        assert _gap(c, b) <= 1e-5, f"sequence {i}: batched pack with alignment padding"
    mutated = [s.clone() for s in seqs]
    mutated[0][-3:] = (mutated[0][-3:] + 1) % 256
    after = _logprobs(batched, mutated)
    assert _gap(after[0], got[0]) > 1e-3, "the mutation must change its own sequence"
    for i in range(1, len(seqs)):
        assert _gap(after[i], got[i]) <= 1e-6, f"changing sequence 0 moved sequence {i}"
    batched.train()
    mcore_zoo.train_step(batched, seqs, lambda tokens: (-(tokens.logprobs * tokens.mask).sum(), {}))
    layer = batched.decoder.layers[0].self_attention
    assert layer.pack == "batch" and all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


@LAYOUTS
def test_alignment_padding_rows_stay_out_of_the_state(mpu, reference_checkpoint, arch_name, overrides):
    """A pack padded for alignment (``cu_seqlens_q_padded``): the padding rows after each sequence
    do not reach the next sequence's convolution window or state."""
    model = _build(reference_checkpoint(arch_name, overrides))
    seqs = random_sequences(LENGTHS, 256, seed=5)
    with torch.no_grad():
        plain = mcore_zoo.packed_forward(model, seqs, seq_format="thd", align=1).logprobs
        padded = mcore_zoo.packed_forward(model, seqs, seq_format="thd", align=8).logprobs
    for i, (a, b) in enumerate(zip(plain, padded)):
        assert torch.equal(a, b), f"sequence {i}: alignment padding changed its log-probs"


def test_published_80b_a3b_config_converts_with_every_field_classified():
    """``tests/fixtures/configs/qwen3-next-80b-a3b.json`` is Qwen3-Next-80B-A3B-Instruct's published
    ``config.json`` (``full_attention_interval`` rather than ``layer_types``, top-level ``rope_theta`` /
    ``partial_rotary_factor``, no MTP field although the checkpoint ships ``mtp.*`` tensors; sources
    in ``tests/fixtures/configs/README.md``). Every field is classified and the ``mtp.*`` tensors are
    ignored by name, as transformers' model skips them; a config that declares the MTP layer (as
    Qwen3.5's do) is refused by name unless the layer is dropped on request."""
    path = CONFIGS / "qwen3-next-80b-a3b.json"
    arch = mcore_zoo.lookup(ARCH)
    config = arch.config_from_hf(str(path))
    linear = config.gated_deltanet
    assert linear.layer_types == tuple(("linear_attention",) * 3 + ("full_attention",)) * 12
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim) == (16, 32, 128, 128)
    assert (linear.conv_kernel_dim, linear.conv_dim) == (4, 2 * 16 * 128 + 32 * 128)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_query_groups) == (48, 2048, 16, 2)
    assert config.head_dim == 256 and config.rope.partial_rotary_factor == 0.25 and config.rope.theta == 1e7
    assert config.ffn_hidden_size == 5120 and config.max_position_embeddings == 262144
    assert config.attention_output_gate and config.zero_centered_norm and config.qk_norm
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size, moe.shared_expert_ffn_hidden_size) == (512, 10, 512, 512)
    assert moe.shared_expert_gate and moe.normalize_topk and moe.layer_pattern is None
    published = json.loads(path.read_text())
    kinds = {r.field: r.kind for r in config.fields.records}
    # transformers' config class turns these into rope_parameters, dtype and layer_types
    renamed = {"rope_theta", "partial_rotary_factor", "rope_scaling", "torch_dtype", "full_attention_interval"}
    assert set(published) - renamed <= set(kinds)
    assert kinds["layer_types"] == "mapped" and set(kinds.values()) <= {"mapped", "ignored"}
    wmap = arch.weight_map(config)
    assert wmap.is_ignored("mtp.layers.0.mlp.experts.0.up_proj.weight")
    names = wmap.hf_names()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert "model.layers.3.self_attn.q_proj.weight" in names and "model.layers.3.linear_attn.A_log" not in names

    declared = {**published, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    with pytest.raises(mcore_zoo.UnsupportedConfigError, match="mtp_num_hidden_layers"):
        arch.config_from_hf(declared)
    dropped = arch.config_from_hf(declared, ignore_fields={"mtp_num_hidden_layers": "MTP layer not trained here"})
    assert {r.field: r.kind for r in dropped.fields.records}["mtp_num_hidden_layers"] == "ignored"
    assert "dropped on request" in arch.weight_map(dropped).is_ignored("mtp.layers.0.mlp.experts.0.up_proj.weight")


@pytest.mark.parametrize("layout, overrides", [
    ({"cp": 2}, {}),
    ({"tp": 2}, {**DENSE, "linear_num_key_heads": 1}),
    ({"tp": 2}, {"linear_num_key_heads": 1}),  # the MoE example splits whole key-head groups too
])  # fmt: skip
def test_layouts_the_layer_does_not_split_are_refused_by_name(layout, overrides):
    """Context parallelism and a tensor-parallel size that does not divide the key heads (each rank
    computes whole key-head groups) are refused by name; TP2 and PP2 of the dense form and PP2 / EP2 /
    TP2 with sequence parallelism of the MoE example are accepted (and computed:
    ``tests/distributed/test_gated_deltanet_layouts.py``, ``test_moe_layouts.py``)."""
    from mcore_zoo.config.transformer import validate_layout
    from mcore_zoo.placement import Parallelism

    arch = mcore_zoo.lookup(ARCH)
    config = arch.config_from_hf({**arch.example_config(), **overrides})
    (field, size), = layout.items()
    with pytest.raises(mcore_zoo.UnsupportedLayoutError, match=f"{field}={size}: the gated DeltaNet layer"):
        validate_layout(config, Parallelism(**layout))
    dense = arch.config_from_hf({**arch.example_config(), **DENSE})
    for accepted in (Parallelism(tp=2), Parallelism(pp=2), Parallelism(tp=2, pp=2, sequence_parallel=True)):
        validate_layout(dense, accepted)
    example = arch.config_from_hf(arch.example_config())
    for accepted in (Parallelism(pp=2), Parallelism(ep=2), Parallelism(pp=2, ep=2), Parallelism(tp=2, sequence_parallel=True)):
        validate_layout(example, accepted)


@pytest.mark.slow
@pytest.mark.parametrize("config, arch_name", [
    ("qwen3-next-80b-a3b.json", ARCH),
    ("qwen3.5-9b.json", "Qwen3_5ForConditionalGeneration"),
    ("qwen3.5-35b-a3b.json", "Qwen3_5MoeForConditionalGeneration"),
])  # fmt: skip
def test_published_config_parity_report_passes_at_tiny_scale(tmp_path, config, arch_name):
    """``parity-report --config <published> --random-weights --scale tiny`` passes on the CPU for the
    published Qwen3-Next-80B-A3B, Qwen3.5-9B and Qwen3.5-35B-A3B configs (the Qwen3.5 ones are
    vision-language configs: their ``text_config`` is scaled, their vision tower shrunk and fed images
    of random pixels). The tiny
    scale keeps one layer of each kind and caps the routed experts; the report records both, and
    the MTP layer the random weights do not carry."""
    from mcore_zoo.cli import main

    code = main(["parity-report", "--config", str(CONFIGS / config), "--random-weights", "--scale", "tiny",
                 "--lengths", "40,9", "--out", str(tmp_path), "-q", "--format", "json"])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / f"{arch_name}.json").read_text())
    changes = report["model"]["changes"]
    prefix = "" if arch_name == ARCH else "text_config."
    assert changes[prefix + "full_attention_interval"] == [4, 2] and changes[prefix + "num_hidden_layers"][1] == 2
    if arch_name == ARCH:
        assert changes["num_experts"] == [512, 64]
    else:
        assert changes["text_config.mtp_num_hidden_layers"] == [1, 0] and changes["vision_config.depth"][1] == 1
        assert report["inputs"]["vision"]["images"] >= 1  # the tower is built: images of random pixels fed
