"""Weight map: HF checkpoints that transformers loads, sharded export, and every bad-input path
failing closed with the offending name. (The bitwise round trip of every built-in case is the
conformance suite's weight-map contract: ``tests/parity/test_builtin_conformance.py``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mcore_zoo
from mcore_zoo.handle import handle_of
from mcore_zoo.errors import (
    CheckpointFormatError,
    MissingTensorsError,
    ShapeMismatchError,
    UnexpectedTensorsError,
    UnmappedParametersError,
)
from mcore_zoo.weights.io import HFCheckpoint
from mcore_zoo.weights.rules import WeightMap


def _hf_state(ckpt: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def test_saved_checkpoint_loads_in_transformers(mpu, reference_checkpoint, hf_reference, tmp_path):
    ckpt = reference_checkpoint("Qwen2ForCausalLM")  # tied embeddings: no lm_head in the files
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt)
    out = tmp_path / "export"
    files = mcore_zoo.save_hf_checkpoint(model, out, max_shard_size="40KB")
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    reloaded = hf_reference("Qwen2ForCausalLM", out)
    original = hf_reference("Qwen2ForCausalLM", ckpt)
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)
    # the sharded export loads back into the zoo too
    again = mcore_zoo.build_model(out, backend="portable", load=out)
    for (n1, t1), (n2, t2) in zip(mcore_zoo.iter_hf_weights(model), mcore_zoo.iter_hf_weights(again)):
        assert n1 == n2 and torch.equal(t1, t2)


def test_export_casts_dtype_and_records_it(mpu, reference_checkpoint, tmp_path):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    state = _hf_state(tmp_path / "bf16")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_export_dtype_keeps_fp32_score_correction_bias(mpu, reference_checkpoint, tmp_path):
    """``dtype`` casts the parameters; the router's fp32 score-correction bias (a checkpoint-state
    buffer) is written unrounded, as published DeepSeek-V3 checkpoints store it and transformers
    loads it (its ``_keep_in_fp32_modules_strict``)."""
    ckpt = reference_checkpoint("DeepseekV3ForCausalLM")
    source = _hf_state(ckpt)
    biases = sorted(k for k in source if k.endswith("e_score_correction_bias"))
    assert biases and all(source[k].dtype == torch.float32 for k in biases)
    assert any(not torch.equal(source[k].to(torch.bfloat16).float(), source[k]) for k in biases)
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    state = _hf_state(tmp_path / "bf16")
    for k in biases:
        assert state[k].dtype == torch.float32 and torch.equal(state[k], source[k]), k
    assert {t.dtype for k, t in state.items() if k not in biases} == {torch.bfloat16}


def test_load_from_in_memory_state_dict(mpu, reference_checkpoint, hf_reference):
    ckpt = reference_checkpoint("Qwen3ForCausalLM")
    hf = hf_reference("Qwen3ForCausalLM", ckpt)
    model = mcore_zoo.build_model(ckpt, backend="local")
    mcore_zoo.load_hf_state_dict(model, hf.state_dict())
    for name, tensor in mcore_zoo.iter_hf_weights(model):
        assert torch.equal(tensor, hf.state_dict()[name])


# ---------------------------------------------------------------------------- bad input
def _copy(ckpt: Path, dst: Path) -> Path:
    shutil.copytree(ckpt, dst)
    return dst


def _rewrite(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(mpu, reference_checkpoint, tmp_path):
    ckpt = _copy(reference_checkpoint("LlamaForCausalLM"), tmp_path / "c")
    _rewrite(ckpt, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        mcore_zoo.build_model(ckpt, backend="local", load=ckpt)


def test_wrong_shape_is_named_before_anything_is_copied(mpu, reference_checkpoint, tmp_path):
    ckpt = _copy(reference_checkpoint("LlamaForCausalLM"), tmp_path / "c")

    def shrink(state):
        state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:-1]

    _rewrite(ckpt, shrink)
    model = mcore_zoo.build_model(ckpt, backend="local")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ShapeMismatchError) as err:
        mcore_zoo.load_hf_weights(model, ckpt)
    assert "model.layers.0.self_attn.k_proj.weight" in str(err.value) and "(31, 64)" in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_wrong_shape_in_one_expert_of_many_is_named(mpu, reference_checkpoint, tmp_path):
    """The load's checks keep the expected shapes once per transform and shape (an MoE model's
    experts share them): an expert that is not the first checked still has its own shape checked."""
    ckpt = _copy(reference_checkpoint("Qwen3MoeForCausalLM"), tmp_path / "c")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"

    def shrink(state):
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in state  # not the last expert either
        state[name] = state[name][:-1]

    _rewrite(ckpt, shrink)
    model = mcore_zoo.build_model(ckpt, backend="local")
    with pytest.raises(ShapeMismatchError) as err:
        mcore_zoo.load_hf_weights(model, ckpt)
    assert err.value.name == name


def test_unexpected_tensor_is_named(mpu, reference_checkpoint, tmp_path):
    ckpt = _copy(reference_checkpoint("MistralForCausalLM"), tmp_path / "c")
    _rewrite(ckpt, lambda s: s.__setitem__("model.layers.0.self_attn.mystery.weight", torch.zeros(2)))
    with pytest.raises(UnexpectedTensorsError, match="mystery"):
        mcore_zoo.build_model(ckpt, backend="local", load=ckpt)


def test_ignored_tensors_are_reported_not_loaded(mpu, reference_checkpoint, tmp_path):
    ckpt = _copy(reference_checkpoint("LlamaForCausalLM"), tmp_path / "c")
    _rewrite(ckpt, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    model = mcore_zoo.build_model(ckpt, backend="local")
    report = mcore_zoo.load_hf_weights(model, ckpt)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in report.ignored


def test_unmapped_parameter_would_stay_random_and_is_refused(mpu, reference_checkpoint):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local")
    info = handle_of(model)
    good = info.weight_map
    info._weight_map = WeightMap(good.arch, [r for r in good.rules if "pre_mlp_layernorm" not in r.mcore], good.ignored + [(r".*post_attention_layernorm.*", "test")])
    with pytest.raises(UnmappedParametersError, match=r"decoder\.layers\.0\.pre_mlp_layernorm\.weight"):
        mcore_zoo.load_hf_weights(model, ckpt)


def test_model_tensors_are_named_parameters_then_checkpoint_state_buffers(mpu, reference_checkpoint):
    """One walk of the module tree gives what ``named_parameters()`` and ``named_buffers()`` give:
    the same names in the same order, a tensor or module reached twice counted once under its
    first name, then the routers' ``expert_bias`` buffers."""
    from mcore_zoo.weights.rules import model_tensors

    model = mcore_zoo.build_model(reference_checkpoint("DeepseekV3ForCausalLM"), backend="local")
    shared = torch.nn.Linear(2, 2)
    model.extra_a, model.extra_b = shared, shared  # one module under two names
    model.decoder.extra_weight = shared.weight  # one parameter under two names
    want = dict(model.named_parameters())
    want.update({n: b for n, b in model.named_buffers() if n.endswith(".expert_bias")})
    got = model_tensors(model)
    assert list(got) == list(want) and all(got[n] is want[n] for n in want)
    assert "extra_b.weight" not in got and ("decoder.extra_weight" in got) != ("extra_a.weight" in got)
    assert sum(n.endswith(".expert_bias") for n in got) >= 1


def test_a_rule_whose_hf_name_has_a_placeholder_its_mcore_name_lacks_is_refused(mpu, reference_checkpoint):
    from mcore_zoo.weights.rules import rule

    wmap = handle_of(mcore_zoo.build_model(reference_checkpoint("LlamaForCausalLM"), backend="local")).weight_map
    bad = WeightMap(wmap.arch, [rule("decoder.final_layernorm.weight", "model.layers.{layer}.norm.weight")])
    with pytest.raises(KeyError, match="layer"):
        bad.expand_full()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors_is_a_clear_error(mpu, reference_checkpoint, tmp_path, damage):
    ckpt = _copy(reference_checkpoint("LlamaForCausalLM"), tmp_path / "c")
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{definitely not a header}" + data[40:])
    else:
        path.write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        mcore_zoo.build_model(ckpt, backend="local", load=ckpt)


def test_index_naming_a_missing_shard(mpu, reference_checkpoint, tmp_path):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    out = tmp_path / "sharded"
    mcore_zoo.save_hf_checkpoint(model, out, max_shard_size="40KB")
    victim = sorted(out.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointFormatError, match=victim.name):
        HFCheckpoint(out)


def test_pickle_weights_are_refused_by_default(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="allow_torch_load"):
        HFCheckpoint(tmp_path)
    assert HFCheckpoint(tmp_path, allow_torch_load=True).keys() == {"w"}


def test_no_partial_output_when_export_fails(mpu, reference_checkpoint, tmp_path, monkeypatch):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    from mcore_zoo.distributed import export as export_mod

    real = export_mod.hf_items

    def failing(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 5:
                raise RuntimeError("disk full")
            yield item

    monkeypatch.setattr(export_mod, "hf_items", failing)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        mcore_zoo.save_hf_checkpoint(model, out, max_shard_size="10KB")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_to_overwrite(mpu, reference_checkpoint, tmp_path):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_fused_hf_tensors_via_selected_parts(mpu, reference_checkpoint):
    """Phi-3-style fused ``qkv_proj`` / ``gate_up_proj``: one HF tensor split into several sources
    by ``select`` ranges loads like the separate tensors and exports back fused, bitwise."""
    from mcore_zoo.weights.dense import HF_LAYER
    from mcore_zoo.weights.rules import GATE_UP, QKV, Rule, split_rows

    ckpt = reference_checkpoint("LlamaForCausalLM")
    source = _hf_state(ckpt)
    plain = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    model = mcore_zoo.build_model(ckpt, backend="local")
    info = handle_of(model)
    arch = info.arch_config
    q, kv, ffn = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim, arch.ffn_hidden_size
    fused_rules = []
    for r in info.weight_map.rules:
        if r.mcore.endswith("linear_qkv.weight"):
            r = Rule(r.mcore, split_rows(HF_LAYER + "self_attn.qkv_proj.weight", [q, kv, kv]), QKV)
        elif r.mcore.endswith("linear_fc1.weight"):
            r = Rule(r.mcore, split_rows(HF_LAYER + "mlp.gate_up_proj.weight", [ffn, ffn]), GATE_UP)
        fused_rules.append(r)
    info._weight_map = WeightMap(arch, fused_rules, info.weight_map.ignored)
    fused = {}
    for name, tensor in source.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            prefix = name.split("q_proj")[0]
            fused[prefix + "qkv_proj.weight"] = torch.cat([tensor, source[prefix + "k_proj.weight"], source[prefix + "v_proj.weight"]])
        elif ".gate_proj." in name:
            prefix = name.split("gate_proj")[0]
            fused[prefix + "gate_up_proj.weight"] = torch.cat([tensor, source[prefix + "up_proj.weight"]])
        else:
            fused[name] = tensor
    mcore_zoo.load_hf_state_dict(model, fused)
    for (n1, p1), (n2, p2) in zip(plain.named_parameters(), model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    exported = dict(mcore_zoo.iter_hf_weights(model))
    assert set(exported) == set(fused) and all(torch.equal(exported[k], fused[k]) for k in fused)
    # a fused tensor with one row too many is a shape error naming it
    bad = dict(fused)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    bad[name] = torch.cat([bad[name], bad[name][:1]])
    with pytest.raises(ShapeMismatchError, match="qkv_proj"):
        mcore_zoo.load_hf_state_dict(model, bad)


def test_a_tp_slice_is_the_same_box_for_reading_cutting_and_indexing():
    """Rank r's slice of a rule source: its select range, cut into equal chunks along the TP axis;
    ``box`` (what a checkpoint read takes), ``cuts`` (what export and the refit plan narrow by)
    and ``index`` describe the same elements."""
    from mcore_zoo.errors import LayoutError
    from mcore_zoo.weights.rules import TPSlice

    full = torch.arange(24.0 * 4).reshape(24, 4)
    part = TPSlice(axis=0, rank=1, size=2, select=(0, 8, 16))  # rows 8..16 (k of a fused qkv), rank 1's half
    assert part.box(full.shape) == [(12, 16), (0, 4)]
    assert part.cuts(full.shape) == ((0, 8, 8), (0, 4, 4))
    assert torch.equal(part.cut(full), full[12:16])
    assert torch.equal(full[part.index(full.shape)], full[12:16])
    columns = TPSlice(axis=1, rank=0, size=2)
    assert torch.equal(columns.cut(full), full[:, :2]) and columns.index(full.shape) == (slice(0, 24), slice(0, 2))
    assert TPSlice().cuts(full.shape) == () and TPSlice().index(full.shape) is None
    with pytest.raises(LayoutError, match="not divisible into 5 chunks"):
        TPSlice(axis=0, size=5).box(full.shape)
