"""The conformance checks, one function per contract (see :mod:`mcore_zoo.testing.contracts`).

Every check runs on the CPU in fp32 against the real transformers model of the architecture (random
weights from :mod:`mcore_zoo.parity.reference`), and raises
:class:`~mcore_zoo.testing.contracts.ContractError` on the first broken contract. ``subject`` names
the architecture and example config in messages. The functions are usable without pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from .common import (
    MOE_PACK_REL_TOL,
    PARITY_LENGTHS,
    TP_REL_TOL,
    assert_same,
    load_safetensors_dir,
    max_abs_diff,
    pack_tolerance,
    random_sequences,
)
from .contracts import CONTRACTS, ContractError, contract, describe, fail

#: Modules a plugin's entry-point module must not import (discovery stays cheap).
HEAVY_MODULES = ("torch", "megatron", "transformer_engine", "transformers")

#: The HF config field added by the unknown-field probe of the bad-input contract.
PROBE_FIELD = "zoo_conformance_unknown_field"

#: The checkpoint tensor added by the unexpected-tensor probe of the bad-input contract.
PROBE_TENSOR = "model.zoo_conformance_probe.weight"


# ---------------------------------------------------------------------------- helpers
def _torch() -> Any:
    import torch

    return torch


def _eager() -> Any:
    from ..numerics.profiles import get_profile

    return get_profile("default").with_knobs(attention="eager")


def build(architecture: Any, source: Any, *, backend: str = "portable", numerics: Any = None, load: Any = None,
          subject: Optional[str] = None) -> Any:  # fmt: skip
    """A single-process fp32 model of ``architecture`` built from ``source`` (config or checkpoint).

    With ``subject``, a failure while the model is constructed (the layer spec, ``GPTModel``, the
    parameters) breaks contract ``build`` for it, whichever contract asked for the model; the
    converter's errors (``config``) and the checkpoint's (``weight-map``) keep their own."""
    from ..distributed.build import build_model

    try:
        return build_model(
            str(source) if isinstance(source, Path) else source,
            architecture=architecture,
            backend=backend,
            numerics=numerics if numerics is not None else _eager(),
            load=str(load) if load is not None else None,
            params_dtype=_torch().float32,
        ).eval()
    except Exception as exc:
        if subject is not None and raised_while_constructing(exc):
            raise ContractError("build", f"{subject}, backend {backend!r}", describe(exc)) from exc
        raise


def raised_while_constructing(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by ``build_model``) came from constructing the model rather than from
    converting the config (a ``ConfigError``) or reading the checkpoint (a ``WeightMapError``, or
    anything raised under ``load_hf_weights``: a plugin's weight transform, say)."""
    from ..errors import ConfigError, WeightMapError

    if isinstance(exc, (ConfigError, WeightMapError, ContractError)):
        return False
    return not any(frame.name == "load_hf_weights" for frame in traceback.extract_tb(exc.__traceback__))


def reference(architecture: Any, checkpoint: Path, attn: str = "eager") -> Any:
    from ..parity.reference import load_reference

    return load_reference(architecture, checkpoint, attn_implementation=attn)


# ---------------------------------------------------------------------------- registration
def check_registration(registry: Any, plugin: str) -> list[str]:
    """The plugin loaded through its entry point and owns its architectures; returns their names."""
    subject = f"plugin {plugin!r}"
    records = [r for r in registry.plugins.values() if r.name == plugin]
    if not records:
        installed = ", ".join(sorted(f"{r.name} ({r.distribution})" for r in registry.plugins.values()))
        fail(
            "registration",
            subject,
            f"no plugin named {plugin!r} is installed in the entry-point group 'mcore_zoo'.\n"
            f"Installed plugins: {installed or 'none'}",
            "install the package that provides it (pip install -e . in the plugin's directory) and check"
            f" that its pyproject.toml declares [project.entry-points.mcore_zoo] {plugin} = \"<package>.<module>\".",
        )
    for record in records:
        if record.status == "loaded":
            continue
        if record.status == "failed" and len(records) > 1 and any(r.status == "loaded" for r in records):
            fail("registration", subject, record.describe_failure(),
                 f"two distributions use the entry-point name {plugin!r}: rename yours.")  # fmt: skip
        if record.status == "failed":
            fail("registration", subject, f"{record.origin} failed to load:\n{record.error}",
                 "fix the error above: the plugin module must import without a GPU and implement"
                 " @hookimpl def mcore_zoo_architectures() returning a list of ModelEntry objects.")  # fmt: skip
        if record.status == "blocked":
            fail("registration", subject, f"{record.origin} is blocked", "remove it from MCORE_ZOO_BLOCK_PLUGINS.")
        if record.status == "disabled":
            fail("registration", subject, f"{record.origin} is not loaded: MCORE_ZOO_DISABLE_PLUGIN_AUTOLOAD is set",
                 f"unset it, or list the plugin in MCORE_ZOO_PLUGINS={plugin}.")  # fmt: skip
    record = next(r for r in records if r.status == "loaded")
    if not record.architectures:
        fail("registration", subject, "mcore_zoo_architectures() returned no ModelEntry",
             "return one ModelEntry per architecture the plugin provides.")  # fmt: skip
    for name in record.architectures:
        who = f"{name} ({record.origin})"
        with contract("registration", who):
            provider = registry.get(name)
        if provider.plugin != plugin:
            fail("registration", who, f"{provider.origin} overrides it (ModelEntry(override=True)), so this"
                 " plugin's entry is never used", "uninstall or block the overriding plugin while testing.")  # fmt: skip
        with contract("registration", who, fix="give the entry an example_config (a tiny HF config dict) and an"
                      " hf_model_class ('transformers:<Class>' or 'package.module:Class') naming the reference"
                      " model; ModelEntry.model_type must equal the HF config class's model_type."):  # fmt: skip
            provider.example_config()
            cls = provider.reference_model_class()
            if not hasattr(cls, "from_pretrained"):
                raise TypeError(f"hf_model_class {provider.entry.reference_class!r} is not a transformers model class")
            config_class = getattr(cls, "config_class", None)
            hf_type = getattr(config_class, "model_type", None)
            if hf_type and hf_type != provider.entry.model_type:
                raise ValueError(
                    f"ModelEntry.model_type={provider.entry.model_type!r} but {cls.__name__} uses model_type={hf_type!r}"
                )
    heavy = imports_of_plugin(plugin, record.distribution)
    if heavy:
        fail("registration", subject, f"importing the plugin module {record.module!r} and calling its hook imports"
             f" {', '.join(heavy)}: every `mcore-zoo list` and every lookup would pay for that",
             "import torch / megatron / transformers inside the converter and weight-map functions only, and"
             " name those functions in ModelEntry as 'package.module:function' strings.")  # fmt: skip
    return list(record.architectures)


_IMPORT_PROBE = """
import json, sys
from importlib import metadata
import mcore_zoo
name, dist = sys.argv[1], sys.argv[2]
eps = [ep for ep in metadata.entry_points(group="mcore_zoo") if ep.name == name
       and (ep.dist is None or ep.dist.metadata["Name"] == dist)]
if not eps:  # a built-in the source tree's pyproject.toml declares, as the registry reads it
    from mcore_zoo.registry import ENTRY_POINT_GROUP, source_tree_entry_points
    value = (source_tree_entry_points() or {}).get(name)
    eps = [metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)] if value else []
before = set(sys.modules)
plugin = eps[0].load()
plugin.mcore_zoo_architectures()
new = {m.split(".")[0] for m in set(sys.modules) - before}
print(json.dumps(sorted(new & set(sys.argv[3].split(",")))))
"""


def imports_of_plugin(plugin: str, distribution: str) -> list[str]:
    """Heavy top-level packages that loading ``plugin`` (and calling its hook) imports, measured in
    a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, plugin, distribution, ",".join(HEAVY_MODULES)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    if proc.returncode != 0:
        fail("registration", f"plugin {plugin!r}", f"loading the plugin in a fresh interpreter failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- config
def check_config(architecture: Any, config: Mapping[str, Any], subject: str) -> Any:
    """Field coverage of ``config``; returns the converted :class:`~mcore_zoo.ArchConfig`."""
    from ..parity.reference import hf_config_object

    with contract("config", subject, fix="the example config must be a valid config of the reference model's"
                  " config class (transformers validates it): fix the value it names."):  # fmt: skip
        hf_config_object(dict(config))
    with contract("config", subject):
        arch = architecture.config_from_hf(dict(config))
    blank = [r.field for r in arch.fields.records if not str(r.detail).strip()]
    if blank:
        fail("config", subject, f"fields classified without a target or reason: {blank}",
             "pass the mcore target to reader.map(...) and a reason to reader.ignore(...).")  # fmt: skip
    with contract("config", subject):
        again = architecture.config_from_hf(dict(arch.hf_config))
    if again != arch:
        first, second = arch.summary(), again.summary()
        diff = {k: (first[k], second.get(k)) for k in first if first[k] != second.get(k)}
        fail("config", subject, f"converting the normalised config again gives another ArchConfig: {diff}",
             "the converter must depend on the config only (no state kept between calls).")  # fmt: skip
    return arch


# ---------------------------------------------------------------------------- build
#: The backends the build contract constructs (those that run on the CPU), with their numerics.
CPU_BACKENDS = {"portable": None, "local": "default"}


def check_build(architecture: Any, config: Mapping[str, Any], subject: str) -> None:
    """Contract ``build``: the model of ``config`` is constructed at random init with every CPU
    backend the entry declares. A converter failure stays the ``config`` contract's."""
    for backend, numerics in CPU_BACKENDS.items():
        if backend not in architecture.entry.backends:
            continue
        with contract("config", subject):  # build() raises contract build itself for construction failures
            model = build(architecture, dict(config), backend=backend, numerics=numerics, subject=subject)
        if not any(True for _ in model.parameters()):
            fail("build", f"{subject}, backend {backend!r}", "the model has no parameters")


# ---------------------------------------------------------------------------- weight map
def check_weight_map(architecture: Any, checkpoint: Path, subject: str) -> None:
    """Bitwise HF -> mcore -> HF round trip that covers every tensor; no dead rules."""
    from ..handle import handle_of
    from ..distributed.export import iter_hf_weights

    torch = _torch()
    with contract("weight-map", subject):
        model = build(architecture, checkpoint, backend="local", numerics="default", load=checkpoint, subject=subject)
        source = load_safetensors_dir(checkpoint)
        wmap = handle_of(model).weight_map
        exported: dict[str, Any] = {}
        for name, tensor in iter_hf_weights(model):
            if name in exported:
                raise AssertionError(f"export yields {name!r} twice")
            exported[name] = tensor
    missing = sorted(expected_export(wmap, source) - set(exported))
    extra = sorted(set(exported) - set(source))
    problems = []
    if missing:
        problems.append(f"export does not write {len(missing)} checkpoint tensor(s): {missing[:10]}")
    if extra:
        problems.append(f"export writes {len(extra)} tensor(s) the checkpoint does not have: {extra[:10]}")
    for name in sorted(set(exported) & set(source)):
        got, want = exported[name], source[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{name}: exported {tuple(got.shape)} {got.dtype}, checkpoint {tuple(want.shape)} {want.dtype}")
        elif not torch.equal(got, want):
            problems.append(f"{name}: exported tensor differs from the checkpoint (max |diff| {max_abs_diff(got, want):.3e})")
    expanded = {b.rule.mcore for b in wmap.expand_full()}
    bound = {b.rule.mcore for b in wmap.bind(model)}
    dead = [r.mcore for r in wmap.rules if r.export and r.mcore in expanded and r.mcore not in bound]
    if dead:
        problems.append(f"rules that match no parameter of the model (misspelt mcore name?): {dead}")
    if problems:
        fail("weight-map", subject, "\n".join(problems[:20]))


# ---------------------------------------------------------------------------- parity
def check_parity(architecture: Any, checkpoint: Path, subject: str, *, sensitivity: bool = True) -> None:
    """Bitwise CPU fp32 parity with transformers (THD portable + BSHD hf-exact) and a RoPE mutation
    that must break it. THD packs within :func:`~.common.pack_tolerance` (MoE models: experts see other row counts)."""
    from ..distributed.forward import packed_forward
    from ..handle import handle_of

    torch = _torch()
    with contract("parity", subject):
        hf = reference(architecture, checkpoint)
        model = build(architecture, checkpoint, load=checkpoint, subject=subject)
        local = build(architecture, checkpoint, backend="local", numerics="hf-exact", load=checkpoint, subject=subject)
    vocab = handle_of(local).arch_config.vocab_size
    seqs = random_sequences(PARITY_LENGTHS, vocab)
    ids = torch.stack(random_sequences([40, 40, 40], vocab, seed=1))
    problems = []
    packed_exact, packed_tol = pack_tolerance(handle_of(model).arch_config)
    with torch.no_grad(), contract("parity", subject):
        out = packed_forward(model, seqs, seq_format="thd")
        for seq, logits, logprobs in zip(seqs, out.logits, out.logprobs):
            ref = hf(seq[None]).logits[0]
            try:
                assert_same(logits, ref, f"portable THD, sequence of {seq.numel()} tokens: logits", exact=packed_exact,
                            rel_tol=packed_tol)  # fmt: skip
                if seq.numel() > 1:
                    ref_lp = torch.log_softmax(ref[:-1].float(), -1).gather(-1, seq[1:, None]).squeeze(-1)
                    assert_same(logprobs, ref_lp, f"portable THD, sequence of {seq.numel()} tokens: log-probs",
                                exact=packed_exact, rel_tol=packed_tol)  # fmt: skip
            except AssertionError as exc:
                problems.append(str(exc))
        try:
            assert_same(local(ids, torch.arange(40).expand(3, -1), None), hf(ids).logits,
                        "local backend, numerics='hf-exact', batch 3x40: logits", exact=True)  # fmt: skip
        except AssertionError as exc:
            problems.append(str(exc))
    if problems:
        where, hint = first_divergence(local, hf, ids)
        fix = f"{hint}\n{CONTRACTS['parity'].fix}" if hint else None
        fail("parity", subject, "\n".join(problems) + ("\n\n" + where if where else ""), fix)
    if sensitivity:
        check_rope_sensitivity(architecture, checkpoint, hf, seqs[:2], subject)


def check_rope_sensitivity(architecture: Any, checkpoint: Path, hf: Any, seqs: Sequence[Any], subject: str) -> None:
    """A model whose RoPE base is doubled must disagree with transformers by more than 1e-2."""
    from ..distributed.forward import packed_forward

    torch = _torch()
    config = dict(architecture.config_from_hf(str(checkpoint)).hf_config)
    text = language_model_fields(config)
    params = text.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        config.update(language_model_change(config, {"rope_parameters": dict(params, rope_theta=params["rope_theta"] * 2)}))
    elif text.get("rope_theta") is not None:
        config.update(language_model_change(config, {"rope_theta": text["rope_theta"] * 2}))
    else:
        return  # no RoPE base in the config: nothing to mutate
    with torch.no_grad(), contract("parity", subject):
        mutated = build(architecture, config, load=checkpoint)
        out = packed_forward(mutated, list(seqs)).logits
        diff = max(max_abs_diff(o, hf(s[None]).logits[0]) for o, s in zip(out, seqs))
    if diff <= 1e-2:
        fail("parity", subject, f"with the RoPE base doubled the logits still agree with transformers to {diff:.2e}:"
             " the parity check could not catch a RoPE bug at this example config",
             "make sure the converter maps rope_theta, and give the example config at least 2 heads of"
             " head_dim >= 8 (random weights from mcore_zoo.parity.reference make attention sharp).")  # fmt: skip


#: Where a difference first shows -> what usually causes it.
DIVERGENCE_HINTS = {
    "embedding": "the embedding rule, or a scale applied to the embeddings",
    "input norm": "the norm eps, RMSNorm vs LayerNorm, a (1 + weight) convention",
    "attention": "RoPE (theta, scaling, partial_rotary_factor, interleaved vs rotate-half pairs), the q/k/v row"
    " order (QKV transform), q/k norms, the softmax scale, the sliding window, biases",
    "pre-MLP norm": "the norm eps, RMSNorm vs LayerNorm, a (1 + weight) convention",
    "MLP": "the activation, the gate/up order in fc1, biases",
    "output": "the residual connections: extra norms or scales around the residual adds",
    "head": "the final norm and the output layer: tied embeddings, logit scaling or softcapping",
}

#: (Megatron-Core submodule, HF submodule, stage) of a decoder layer, in execution order.
_LAYER_STAGES = (
    ("input_layernorm", "input_layernorm", "input norm"),
    ("self_attention", "self_attn", "attention"),
    ("pre_mlp_layernorm", "post_attention_layernorm", "pre-MLP norm"),
    ("mlp", "mlp", "MLP"),
)


def first_divergence(model: Any, hf: Any, ids: Any) -> tuple[str, str]:
    """Where ``model`` (BSHD, batch ``ids``) first differs from ``hf``: ``(report, fix hint)``,
    comparing the embedding and, per decoder layer, the norms, attention, MLP and layer output.
    Empty strings when the models cannot be probed stage by stage."""
    torch = _torch()
    hf_model = getattr(hf, "model", None)
    hf_layers = getattr(hf_model, "layers", None)
    if hf_layers is None or getattr(hf_model, "embed_tokens", None) is None or not hasattr(model, "decoder"):
        return "", ""
    if len(hf_layers) != len(model.decoder.layers):
        return "", ""
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}

    def keep(store: dict, key: str, mcore: bool) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            if mcore and isinstance(output, tuple) and len(output) > 1 and isinstance(output[1], torch.Tensor):
                tensor = tensor + output[1]  # mcore returns the output bias separately (fused later)
            tensor = tensor.detach().clone()  # later ops may update the output in place (residual adds)
            store[key] = tensor.transpose(0, 1) if mcore else tensor

        return hook

    pairs = [(model.embedding, hf_model.embed_tokens, "embedding")]
    for i, (ours_layer, hf_layer) in enumerate(zip(model.decoder.layers, hf_layers)):
        for mine, other, stage in _LAYER_STAGES:
            a, b = getattr(ours_layer, mine, None), getattr(hf_layer, other, None)
            if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
                pairs.append((a, b, f"layer {i} {stage}"))
        pairs.append((ours_layer, hf_layer, f"layer {i} output"))
    handles = []
    for a, b, key in pairs:
        handles.append(a.register_forward_hook(keep(ours, key, True)))
        handles.append(b.register_forward_hook(keep(theirs, key, False)))
    try:
        with torch.no_grad():
            model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)
            hf(ids)
    except Exception:
        return "", ""
    finally:
        for handle in handles:
            handle.remove()
    lines = ["stage by stage (local backend, numerics='hf-exact', vs transformers):"]
    for _, _, key in pairs:
        if key not in ours or key not in theirs or ours[key].shape != theirs[key].shape:
            continue
        diff = max_abs_diff(ours[key], theirs[key])
        if diff == 0:
            lines.append(f"  {key}: equal")
            continue
        lines.append(f"  {key}: max |diff| {diff:.3e}  <- first difference")
        stage = key.split(" ", 2)[-1] if key.startswith("layer ") else key
        return "\n".join(lines), f"the first difference is in {key}: check {DIVERGENCE_HINTS.get(stage, stage)}."
    lines.append("  every layer output is equal")
    return "\n".join(lines), f"every decoder layer matches: check {DIVERGENCE_HINTS['head']}."


# ---------------------------------------------------------------------------- THD
def check_thd(architecture: Any, checkpoint: Path, subject: str) -> None:
    """Packed THD == each sequence alone; alignment padding and masked padded batches change nothing."""
    from ..handle import handle_of
    from ..numerics.profiles import get_profile
    from ..distributed.forward import packed_forward

    torch = _torch()
    problems = []
    with torch.no_grad(), contract("thd", subject):
        model = build(architecture, checkpoint, numerics=get_profile("default").with_knobs(attention="sdpa"), load=checkpoint,
                      subject=subject)
        arch_config = handle_of(model).arch_config
        vocab = arch_config.vocab_size
        moe = arch_config.moe is not None  # experts see other row counts: MOE_PACK_REL_TOL
        packed_exact, packed_tol = pack_tolerance(arch_config)
        seqs = random_sequences(PARITY_LENGTHS, vocab, seed=2)
        packed = packed_forward(model, seqs, seq_format="thd", align=1).logits
        for seq, got in zip(seqs, packed):
            alone = model(seq[None], torch.arange(seq.numel())[None], None)[0]
            try:
                assert_same(got, alone, f"packed vs alone, sequence of {seq.numel()} tokens",
                            exact=packed_exact, rel_tol=packed_tol)  # fmt: skip
            except AssertionError as exc:
                problems.append(str(exc))
        padded = packed_forward(model, seqs, seq_format="thd", align=8).logits
        for seq, a, b in zip(seqs, packed, padded):
            if moe and max_abs_diff(a, b) <= MOE_PACK_REL_TOL * max(1.0, a.abs().max().item()):
                continue
            if not torch.equal(a, b):
                problems.append(f"padding every sequence to a multiple of 8 changes the logits of the"
                                f" {seq.numel()}-token sequence (max |diff| {max_abs_diff(a, b):.3e})")  # fmt: skip
        batch = torch.zeros(2, 12, dtype=torch.long)
        mask = torch.zeros(2, 12, dtype=torch.long)
        batch[0, 4:], mask[0, 4:] = seqs[2][:8], 1  # left padded
        batch[1], mask[1] = seqs[2], 1
        from_batch = packed_forward(model, batch, mask).logprobs
        from_list = packed_forward(model, [seqs[2][:8], seqs[2]]).logprobs
        if not all(torch.equal(x, y) for x, y in zip(from_batch, from_list)):
            problems.append("a left-padded batch with its attention mask packs differently from the list of sequences")
    if problems:
        fail("thd", subject, "\n".join(problems))


# ---------------------------------------------------------------------------- tensor parallel
TP_LENGTHS = (23, 9, 40)


def tensor_parallel_rank(cases: Sequence[tuple[str, str, str]], tp: int, ep: int = 1) -> dict[str, dict]:
    """Runs on every rank of a :func:`mcore_zoo.distributed.launch`: for each ``(subject,
    architecture, checkpoint)`` build with ``tensor_model_parallel_size=tp`` loading only this rank's
    chunks, run a packed forward and a gathered export. Errors are returned per case."""
    from ..handle import handle_of
    from ..placement import Parallelism
    from ..distributed.forward import packed_forward
    from ..parallel import ensure_model_parallel
    from ..distributed.export import iter_hf_weights

    torch = _torch()
    ensure_model_parallel(Parallelism(tp=tp, ep=ep))

    def run(architecture: Any, checkpoint: str) -> dict:
        use_layout(case_layout(architecture, checkpoint, Parallelism(tp=tp, ep=ep)))
        model = build(architecture, checkpoint, load=checkpoint)
        seqs = random_sequences(TP_LENGTHS, handle_of(model).arch_config.vocab_size, seed=5)
        with torch.no_grad():
            out = packed_forward(model, seqs)
        return {"seqs": seqs, "logits": out.logits, "exported": dict(iter_hf_weights(model))}

    return _per_case(cases, run)


def case_layout(architecture: Any, checkpoint: str, parallel: Any) -> Any:
    """``parallel`` as a build of this architecture takes it (the expert tensor-parallel size it
    defaults to: 1 for experts with biases, :func:`~mcore_zoo.config.transformer.default_expert_tp`)."""
    from ..config.transformer import default_expert_tp

    return default_expert_tp(architecture.config_from_hf(checkpoint), parallel)


def use_layout(parallel: Any) -> None:
    """Megatron-Core's parallel state for ``parallel``: the one in place when its sizes agree
    (expert tensor parallelism included), else made anew (the launch's cases share one process
    group; a case whose experts need another expert-TP size gets its own groups)."""
    from megatron.core import parallel_state

    from ..parallel import ensure_model_parallel
    from ..placement import Placement

    if parallel_state.model_parallel_is_initialized():
        current = Placement.current().parallel
        if (current.etp or current.tp) == (parallel.etp or parallel.tp):
            return
        parallel_state.destroy_model_parallel()
    ensure_model_parallel(parallel)


def _per_case(cases: Sequence[tuple[str, str, str]], run: Callable[[Any, str], dict]) -> dict[str, dict]:
    """``{subject: run(architecture, checkpoint)}`` for each ``(subject, architecture name,
    checkpoint)`` of a rank; an exception becomes that case's ``{"error": ..., "constructing": ...}``
    (the parent reports it per case: :func:`rank_error`)."""
    from ..registry import get_registry

    results: dict[str, dict] = {}
    for subject, arch_name, checkpoint in cases:
        try:
            results[subject] = run(get_registry().get(arch_name), checkpoint)
        except Exception as exc:  # reported per case by the parent (a construction failure as contract build)
            results[subject] = {"error": describe(exc), "constructing": raised_while_constructing(exc)}
    return results


def rank_error(name: str, where: str, subject: str, ranks: Sequence[Mapping[str, dict]]) -> None:
    """Fail contract ``name`` for the first rank whose run of ``subject`` raised (contract
    ``build`` when the model could not be constructed there)."""
    for rank, results in enumerate(ranks):
        result = results.get(subject, {"error": "no result"})
        if "error" in result:
            fail("build" if result.get("constructing") else name, where, f"rank {rank}: {result['error']}")


#: The numerics of the gradient contract on both sides: HF's op order, with norms that support
#: sequence parallelism (which MoE models under TP train with).
GRADIENT_NUMERICS = "hf-exact"


def _next_token_loss(tokens: Any) -> Any:
    return -(tokens.logprobs * tokens.mask).sum(), {}


def gradient_step(model: Any) -> dict[str, Any]:
    """One ``train_step`` of :func:`_next_token_loss` over the :data:`TP_LENGTHS` pack; every
    gradient gathered under its HF name (collective: every rank of the model calls it)."""
    from ..distributed.export import iter_hf_weights
    from ..distributed.train import train_step
    from ..handle import handle_of

    model.train()
    model.zero_grad(set_to_none=True)
    seqs = random_sequences(TP_LENGTHS, handle_of(model).arch_config.vocab_size, seed=6)
    train_step(model, seqs, _next_token_loss)
    return {name: grad.clone() for name, grad in iter_hf_weights(model, grads=True)}


def gradient_rank(cases: Sequence[tuple[str, str, str]], tp: int, ep: int = 1, dtype: str = "float32") -> dict[str, dict]:
    """Runs on every rank of a :func:`mcore_zoo.distributed.launch`: for each ``(subject,
    architecture, checkpoint)`` build at TP ``tp`` x EP ``ep`` (sequence parallelism for MoE
    models under TP, as Megatron-Core's MoE layer trains only so) with ``dtype`` parameters, load,
    and run :func:`gradient_step`. Errors are returned per case."""
    from ..distributed.build import build_model
    from ..parallel import ensure_model_parallel
    from ..placement import Parallelism

    torch = _torch()
    ensure_model_parallel(Parallelism(tp=tp, ep=ep))

    def run(architecture: Any, checkpoint: str) -> dict:
        moe = architecture.config_from_hf(checkpoint).moe is not None
        parallel = case_layout(architecture, checkpoint, Parallelism(tp=tp, ep=ep, sequence_parallel=moe and tp > 1))
        use_layout(parallel)
        model = build_model(checkpoint, architecture=architecture, backend="portable", numerics=GRADIENT_NUMERICS,
                            load=checkpoint, params_dtype=getattr(torch, dtype), parallel=parallel)  # fmt: skip
        return {"grads": gradient_step(model)}

    return _per_case(cases, run)


def run_gradients(cases: Sequence[tuple[str, str, str]], tp: int = 2, ep: int = 1, dtype: str = "float32") -> list[dict[str, dict]]:
    """Launch :func:`gradient_rank` on ``tp * ep`` gloo ranks (one launch for all cases)."""
    from ..distributed.launch import launch

    return launch(gradient_rank, tp * ep, [tuple(map(str, c)) for c in cases], tp, ep, dtype)


def check_gradients(architecture: Any, checkpoint: Path, subject: str, ranks: Sequence[Mapping[str, dict]], where: str) -> None:
    """Every rank's gathered gradients for ``subject`` against one process's step, tensor by
    tensor within :func:`~mcore_zoo.testing.common.layout_bound`."""
    from ..handle import handle_of
    from .common import layout_bound, layout_ulps

    rank_error("gradients", f"{subject}, {where}", subject, ranks)
    with contract("gradients", f"{subject}, one process"):
        model = build(architecture, checkpoint, numerics=GRADIENT_NUMERICS, load=checkpoint, subject=subject)
        ulps = layout_ulps(handle_of(model).arch_config)
        want = gradient_step(model)
    problems = []
    for rank, results in enumerate(ranks):
        got = results[subject]["grads"]
        if set(got) != set(want):
            problems.append(f"rank {rank}: gradients of {sorted(set(got) ^ set(want))[:6]} on one side only")
            continue
        off = {n: max_abs_diff(got[n], want[n]) for n in want if max_abs_diff(got[n], want[n]) > layout_bound(want[n], ulps)}
        for name in sorted(off, key=off.get, reverse=True)[:6]:
            problems.append(f"rank {rank}: {name}: max |dgrad| {off[name]:.3e} (largest entry {want[name].abs().max().item():.3g},"
                            f" bound {layout_bound(want[name], ulps):.2e})")  # fmt: skip
    if problems:
        fail("gradients", f"{subject}, {where}", "\n".join(problems))


def run_tensor_parallel(cases: Sequence[tuple[str, str, str]], tp: int = 2, ep: int = 1) -> list[dict[str, dict]]:
    """Launch :func:`tensor_parallel_rank` on ``tp * ep`` gloo ranks (one launch for all cases)."""
    from ..distributed.launch import launch

    return launch(tensor_parallel_rank, tp * ep, [tuple(map(str, c)) for c in cases], tp, ep)


#: the rank function of each multi-process contract (:func:`contracts_rank`)
CONTRACT_RANKS: dict[str, Callable[..., dict[str, dict]]] = {
    "tensor-parallel": tensor_parallel_rank,
    "expert-parallel": tensor_parallel_rank,
    "gradients": gradient_rank,
}


def contracts_rank(jobs: Sequence[tuple[str, Sequence[tuple[str, str, str]], int, int]]) -> list[dict[str, dict]]:
    """Runs on every rank of a :func:`mcore_zoo.distributed.launch`: for each ``(contract, cases,
    tp, ep)`` of ``jobs`` in order, that contract's rank function (:data:`CONTRACT_RANKS`) on
    ``cases`` at TP ``tp`` x EP ``ep``, Megatron-Core's parallel state made anew for it. The
    results in job order (each ``{subject: result}``, errors per case)."""
    from megatron.core import parallel_state

    results = []
    for name, cases, tp, ep in jobs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        results.append(CONTRACT_RANKS[name](cases, tp, ep))
    return results


def run_contracts(jobs: Sequence[tuple[str, Sequence[tuple[str, str, str]], int, int]], world_size: int) -> list[list[dict[str, dict]]]:
    """Launch :func:`contracts_rank` on ``world_size`` gloo ranks (one launch for the multi-process
    contracts whose layouts need that many ranks); per job, every rank's results in rank order."""
    from ..distributed.launch import launch

    ranks = launch(contracts_rank, world_size, [(name, [tuple(map(str, c)) for c in cases], tp, ep)
                                                for name, cases, tp, ep in jobs])  # fmt: skip
    return [[rank[i] for rank in ranks] for i in range(len(jobs))]


def check_tensor_parallel(architecture: Any, checkpoint: Path, subject: str, ranks: Sequence[Mapping[str, dict]], tp: int,
                          name: str = "tensor-parallel") -> None:  # fmt: skip
    """Compare every rank's results for ``subject`` with transformers and the checkpoint (``name``:
    the contract, ``tensor-parallel`` or ``expert-parallel``)."""
    torch = _torch()
    problems = []
    where = f"{subject}, TP={tp}" if name == "tensor-parallel" else f"{subject}, EP={len(ranks)}"
    rank_error(name, where, subject, ranks)
    with contract(name, subject):
        hf = reference(architecture, checkpoint)
        source = load_safetensors_dir(checkpoint)
        expected = expected_export(architecture.weight_map(architecture.config_from_hf(str(checkpoint))), source)
    first = ranks[0][subject]
    with torch.no_grad():
        for seq, logits in zip(first["seqs"], first["logits"]):
            try:
                assert_same(logits, hf(seq[None]).logits[0], f"TP={tp} logits, sequence of {seq.numel()} tokens",
                            exact=False, rel_tol=TP_REL_TOL)  # fmt: skip
            except AssertionError as exc:
                problems.append(str(exc))
    for rank, results in enumerate(ranks):
        result = results[subject]
        if rank and not all(torch.equal(a, b) for a, b in zip(result["logits"], first["logits"])):
            problems.append(f"rank {rank}'s gathered logits differ from rank 0's")
        exported = result["exported"]
        wrong = sorted(n for n in set(source) & set(exported) if not torch.equal(exported[n], source[n]))
        missing = sorted(expected - set(exported))
        extra = sorted(set(exported) - set(source))
        if wrong or missing or extra:
            problems.append(f"rank {rank}: gathered export differs from the checkpoint: differing {wrong[:6]},"
                            f" missing {missing[:6]}, unexpected {extra[:6]}")  # fmt: skip
    if problems:
        fail(name, where, "\n".join(problems))


def expected_export(wmap: Any, source: Mapping[str, Any]) -> set[str]:
    """The checkpoint tensors an export must write: all but those the weight map ignores (copies,
    such as an MTP layer's embedding copy, are written)."""
    needed = wmap.export_names()
    return {n for n in source if n in needed or not wmap.is_ignored(n)}


# ---------------------------------------------------------------------------- bad input
def default_rejected(config: Mapping[str, Any]) -> dict[str, dict]:
    """The unsupported values every architecture must refuse: dynamic-NTK RoPE scaling (the zoo
    implements default, linear, llama3 and yarn only)."""
    params = language_model_fields(config).get("rope_parameters")
    if isinstance(params, dict):
        change = {"rope_parameters": dict(params, rope_type="dynamic", factor=2.0)}
    else:
        change = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    return {"rope-dynamic": language_model_change(config, change)}


def language_model_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: a vision-language config's ``text_config``, else the config."""
    from ..config.language_model import text_hf_config

    return text_hf_config(config)


def language_model_change(config: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level overrides that make ``changes`` to the language model's fields: inside
    ``text_config`` for a vision-language config, else ``changes`` themselves."""
    from ..config.language_model import TEXT

    text = language_model_fields(config)
    return {TEXT: {**text, **changes}} if text is not config else dict(changes)


def check_bad_input(architecture: Any, config: Mapping[str, Any], checkpoint: Path, subject: str,
                    rejected: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:  # fmt: skip
    """Unknown fields, unsupported values and damaged checkpoints fail closed, naming the culprit."""
    from ..handle import handle_of
    from ..errors import (
        ConfigError,
        MissingTensorsError,
        ShapeMismatchError,
        UnclassifiedConfigFieldsError,
        UnexpectedTensorsError,
    )
    from ..distributed.load import load_hf_state_dict

    torch = _torch()
    try:
        architecture.config_from_hf({**config, PROBE_FIELD: 1})
    except UnclassifiedConfigFieldsError as exc:
        if PROBE_FIELD not in exc.fields:
            fail("bad-input", subject, f"UnclassifiedConfigFieldsError does not name the unknown field: {exc}")
    except Exception as exc:
        fail("bad-input", subject, f"an unknown config field {PROBE_FIELD!r} raised {describe(exc)}, expected"
             " UnclassifiedConfigFieldsError naming it")  # fmt: skip
    else:
        fail("bad-input", subject, f"the converter accepted the unknown config field {PROBE_FIELD!r}: it"
             " classifies fields it does not know (a field that changes the model would pass silently)")  # fmt: skip
    for probe, overrides in (rejected if rejected is not None else default_rejected(config)).items():
        try:
            architecture.config_from_hf({**config, **overrides})
        except ConfigError:
            pass
        except Exception as exc:
            fail("bad-input", subject, f"unsupported value {probe!r} {dict(overrides)} raised {describe(exc)},"
                 " expected a ConfigError naming the field")  # fmt: skip
        else:
            fail("bad-input", subject, f"unsupported value {probe!r} {dict(overrides)} was accepted: it must be"
                 " refused (UnsupportedConfigError), never approximated")  # fmt: skip

    with contract("bad-input", subject):
        state = load_safetensors_dir(checkpoint)
        model = build(architecture, checkpoint, backend="local", numerics="default", subject=subject)
        wmap = handle_of(model).weight_map
    victim = next(
        (n for b in wmap.expand_full() if "{layer}" in b.rule.mcore for n in b.hf if n in state and state[n].dim() == 2),
        None,
    )
    if victim is None:
        fail("bad-input", subject, "no 2-D per-layer HF tensor in the weight map to damage", "the weight map has no"
             " '{layer}' rules: decoder layers must be mapped with '{layer}' templates.")  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    damaged = [
        ("missing", {k: v for k, v in state.items() if k != victim}, MissingTensorsError, victim),
        ("unexpected", {**state, PROBE_TENSOR: torch.zeros(2)}, UnexpectedTensorsError, PROBE_TENSOR),
        ("mis-shaped", {**state, victim: state[victim][:-1]}, ShapeMismatchError, victim),
    ]
    for what, damaged_state, error, name in damaged:
        try:
            load_hf_state_dict(model, damaged_state)
        except error as exc:
            if name not in str(exc):
                fail("bad-input", subject, f"a {what} tensor raised {type(exc).__name__} without naming {name!r}: {exc}")
        except Exception as exc:
            fail("bad-input", subject, f"a {what} tensor ({name!r}) raised {describe(exc)}, expected {error.__name__}")
        else:
            fail("bad-input", subject, f"a checkpoint with a {what} tensor ({name!r}) loaded without error")
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        if changed:
            fail("bad-input", subject, f"the failed load of a checkpoint with a {what} tensor changed parameters {changed[:5]}")


__all__ = [
    "ContractError",
    "check_bad_input",
    "check_config",
    "check_parity",
    "check_registration",
    "check_tensor_parallel",
    "check_thd",
    "check_weight_map",
    "run_contracts",
    "run_tensor_parallel",
]
