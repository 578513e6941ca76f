"""``mcore-zoo new-plugin NAME --arch HFArchName``: write a ready plugin package for an HF architecture.

The package (``mcore-zoo-NAME``) has a ``pyproject.toml`` declaring the ``mcore_zoo`` entry point,
a plugin module with the four contributions (config converter, weight map, layer spec, packed
forward) and a tiny example config, tests that run mcore-zoo's conformance suite, and a README.

The generator inspects the transformers class at a tiny size and starts from the Llama-like
dense decoder (``read_dense_decoder``, the dense weight table). What that does not cover is
written into the plugin module as TODO lists - the config fields nobody classifies yet and the HF
tensors no rule consumes yet - and is never papered over: until the author classifies those
fields, conversion stops with an error naming them (fail closed), and the conformance suite says
which contract is broken and how to fix it.
"""

from __future__ import annotations

import difflib
import json
import keyword
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import ZooError

#: Example-config sizes: small enough for CPU tests, large enough that random weights give sharp,
#: position-sensitive attention; every size divides by tensor-parallel 2.
TINY_SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}

#: How the built-in plugins classify fields the dense reader leaves to the family. Shown next to
#: the TODO entries as starting points - the author must check the architecture really uses them
#: that way.
FIELD_HINTS = {
    "attention_bias": 'q/k/v(/o) biases: bias = reader.map("attention_bias", "add_qkv_bias ...", False), then'
    " read_dense_decoder(reader, qkv_bias=bias, attn_output_bias=...) (see mcore_zoo.plugins.llama)",
    "mlp_bias": "MLP biases: Megatron-Core's add_bias_linear switches o_proj and MLP biases together"
    " (see mcore_zoo.plugins.llama)",
    "sliding_window": "window on every layer: read_dense_decoder(reader, sliding_window=...)"
    " (see mcore_zoo.plugins.mistral); per-layer windows: mcore_zoo.plugin_api.read_qwen_window",
    "use_sliding_window": "see mcore_zoo.plugin_api.read_qwen_window",
    "max_window_layers": "see mcore_zoo.plugin_api.read_qwen_window",
    "layer_types": "per-layer attention kinds: mcore_zoo.plugin_api.read_layer_types",
    "use_bias": "biases of every linear layer: read_dense_decoder(reader, qkv_bias=..., attn_output_bias=...)"
    " and ArchConfig.mlp_bias",
}
_DROPOUT = "dropout probability: reader.expect(field, 0.0, ...) unless the mcore model applies the same dropout"
_MULTIPLIER = "a scale the dense decoder does not apply: expect its neutral value, or implement it"


@dataclass
class Analysis:
    """What the generator found out about the architecture at the example config."""

    architecture: str
    model_type: str
    config_class: str
    example: dict
    todo_fields: dict = field(default_factory=dict)
    dense_error: Optional[str] = None
    unconsumed_tensors: dict = field(default_factory=dict)  # HF name template -> shape
    absent_tensors: list = field(default_factory=list)
    model_error: Optional[str] = None
    qkv_bias: bool = False


def _hint(name: str) -> str:
    if name in FIELD_HINTS:
        return FIELD_HINTS[name]
    if "dropout" in name or name.endswith("pdrop"):
        return _DROPOUT
    if "multiplier" in name or name.endswith(("_scale", "_scaling")):
        return _MULTIPLIER
    return ""


def _causal_lm_names() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return sorted(names)


def hf_class(architecture: str) -> Any:
    """The transformers model class named ``architecture``, or a ZooError with suggestions."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None or not hasattr(cls, "config_class"):
        close = difflib.get_close_matches(architecture, _causal_lm_names(), n=5, cutoff=0.6)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise ZooError(
            f"transformers {transformers.__version__} has no model class {architecture!r}.{hint}"
            " new-plugin generates plugins for architectures transformers implements (the conformance"
            " suite tests against them)."
        )
    return cls


def tiny_example_config(cls: Any) -> dict:
    """A tiny example config for HF class ``cls``: the size fields its config class has, shrunk."""
    config_class = cls.config_class
    defaults = config_class().to_dict()
    example: dict[str, Any] = {"architectures": [cls.__name__], "model_type": config_class.model_type}
    for name, value in TINY_SIZES.items():
        if name in defaults:
            example[name] = value
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = defaults.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= TINY_SIZES["vocab_size"]:
            example[name] = None  # outside the tiny vocabulary
    return example


def analyse(architecture: str) -> Analysis:
    """Convert the tiny example with the dense decoder reader and compare the dense weight table
    with the HF model's tensors (built on the meta device)."""
    import torch

    from .config.common import read_dense_decoder
    from .config.normalize import normalize_hf_config
    from .config.reader import ConfigReader
    from .weights.dense import dense_decoder_weight_map

    cls = hf_class(architecture)
    example = tiny_example_config(cls)
    result = Analysis(architecture, cls.config_class.model_type, cls.config_class.__name__, example)
    config = normalize_hf_config(example)
    reader = ConfigReader(config, architecture)
    arch = None
    try:
        arch = read_dense_decoder(reader)
    except ZooError as exc:
        result.dense_error = str(exc)
    result.todo_fields = {k: reader.config[k] for k in sorted(reader.unclassified())}
    try:
        with torch.device("meta"):
            model = cls(cls.config_class.from_dict(dict(example)))
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    except Exception as exc:  # a model that cannot be built at this size: reported in the TODO list
        result.model_error = f"{type(exc).__name__}: {exc}"
        return result
    if arch is None:
        return result
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    wmap = dense_decoder_weight_map(arch)
    dense = wmap.hf_names()
    templates: dict[str, tuple] = {}
    for name in sorted(set(shapes) - dense):
        if wmap.is_ignored(name) is None:
            templates.setdefault(re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", name), shapes[name])
    result.unconsumed_tensors = templates
    result.absent_tensors = sorted({re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", n) for n in dense - set(shapes)})
    return result


# ---------------------------------------------------------------------------- rendering
def _names(name: str) -> tuple[str, str]:
    """(distribution, package) for plugin ``name``."""
    return f"mcore-zoo-{name.replace('_', '-')}", f"mcore_zoo_{name.replace('-', '_')}"


def _todo_fields_block(a: Analysis) -> str:
    if not a.todo_fields and not a.dense_error:
        return ""
    lines = [f"# TODO: classify these fields of {a.config_class}. read_dense_decoder does not read them, so until",
             "# each is mapped (reader.map), ignored with a reason (reader.ignore) or rejected (reader.expect /",
             "# reader.unsupported), conversion stops with UnclassifiedConfigFieldsError naming them:"]  # fmt: skip
    width = max((len(k) for k in a.todo_fields), default=0)
    for name, value in a.todo_fields.items():
        lines.append(f"#   {name:<{width}} = {value!r}")
        hint = _hint(name)
        if hint:
            lines += [f"#       {line}" for line in textwrap.wrap(hint, 90)]
    if a.dense_error:
        lines.append(f"# read_dense_decoder refuses the example config: {a.dense_error}")
    return textwrap.indent("\n".join(lines), "    ") + "\n"


def _todo_tensors_block(a: Analysis) -> str:
    lines = []
    if a.model_error:
        lines.append(f"# TODO: transformers could not build {a.architecture} at the example config: {a.model_error}")
    if a.unconsumed_tensors:
        lines.append(f"# TODO: tensors of {a.architecture} that no rule below consumes yet (name: shape at the")
        lines.append("# example config). Give each a rule, or an ignore pattern with a reason. A fused tensor")
        lines.append("# (e.g. qkv_proj) becomes several sources: split_rows(name, [rows of each part], tp_axis=0).")
        for name, shape in a.unconsumed_tensors.items():
            lines.append(f"#   {name}: {list(shape)}")
    if a.absent_tensors:
        lines.append(f"# TODO: rules below whose HF tensors {a.architecture} does not have (fix or remove them):")
        lines += [f"#   {name}" for name in a.absent_tensors]
    return textwrap.indent("\n".join(lines), "    ") + "\n" if lines else ""


def render_plugin_module(a: Analysis, name: str, *, override: bool) -> str:
    _, package = _names(name)
    example = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in a.example.items()) + "}"
    fields_todo = _todo_fields_block(a)
    tensors_todo = _todo_tensors_block(a)
    status = "TODO list below" if (fields_todo or tensors_todo) else "no TODO found by the generator"
    return f'''"""mcore-zoo plugin for {a.architecture} (transformers ``{a.model_type}``), generated by
``mcore-zoo new-plugin`` ({status}).

This module is what the ``mcore_zoo`` entry point names. Importing it must stay cheap (no torch,
Megatron-Core or transformers at module level): the four contributions are functions that import
what they need when called, and the ModelEntry names them as "module:function" strings.

1. ``convert``     HF config -> ArchConfig (every field mapped, ignored with a reason, or rejected)
2. ``weight_map``  the one HF <-> Megatron-Core weight table (loading, export, TP sharding, checks)
3. ``layer_spec``  the Megatron-Core layer spec per backend (the zoo's generic GPT spec)
4. ``forward``     the THD-packed forward (the zoo's generic one)

Run the conformance suite (``pytest``) after every change: it names the contract a change breaks.
"""

from __future__ import annotations

from mcore_zoo.plugin_api import ModelEntry, hookimpl

#: A tiny {a.architecture} for tests and parity runs (random weights make sense at this size).
EXAMPLE_CONFIG = {example}


def convert(reader):  # type: ignore[no-untyped-def]
    """HF ``{a.config_class}`` -> :class:`mcore_zoo.ArchConfig`, classifying every field."""
    from mcore_zoo.plugin_api import read_dense_decoder

{fields_todo}    return read_dense_decoder(reader)


def weight_map(arch):  # type: ignore[no-untyped-def]
    """HF {a.architecture} tensors <-> Megatron-Core parameters (``{{layer}}``: decoder layer index)."""
    from mcore_zoo.plugin_api import GATE_UP, HF_LAYER, LAYER, QKV, ROTARY_BUFFER_IGNORED, WeightMap, embedding_rules, rule

{tensors_todo}    attn = HF_LAYER + "self_attn."
    mlp = HF_LAYER + "mlp."
    rules = embedding_rules(arch) + [
        rule(LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight"),
        rule(
            LAYER + "self_attention.linear_qkv.weight",
            [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
            tp_axis=0,
            transform=QKV,
        ),
        rule(LAYER + "self_attention.linear_proj.weight", attn + "o_proj.weight", tp_axis=1),
        rule(LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight"),
        rule(
            LAYER + "mlp.linear_fc1.weight",
            [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
            tp_axis=0,
            transform=GATE_UP,
        ),
        rule(LAYER + "mlp.linear_fc2.weight", mlp + "down_proj.weight", tp_axis=1),
    ]
    if arch.qkv_bias:
        rules.append(rule(LAYER + "self_attention.linear_qkv.bias",
                          [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"], tp_axis=0, transform=QKV))
    if arch.attn_output_bias:
        rules.append(rule(LAYER + "self_attention.linear_proj.bias", attn + "o_proj.bias"))
    if arch.mlp_bias:
        rules.append(rule(LAYER + "mlp.linear_fc1.bias", [mlp + "gate_proj.bias", mlp + "up_proj.bias"],
                          tp_axis=0, transform=GATE_UP))
        rules.append(rule(LAYER + "mlp.linear_fc2.bias", mlp + "down_proj.bias"))
    if arch.qk_norm:
        rules.append(rule(LAYER + "self_attention.q_layernorm.weight", attn + "q_norm.weight"))
        rules.append(rule(LAYER + "self_attention.k_layernorm.weight", attn + "k_norm.weight"))
    ignored = [ROTARY_BUFFER_IGNORED]
    if arch.tie_word_embeddings:
        ignored.append(("lm_head.weight", "tie_word_embeddings: the output layer is model.embed_tokens.weight"))
    return WeightMap(arch, rules, ignored)


def layer_spec(arch, backend, numerics, **kwargs):  # type: ignore[no-untyped-def]
    """Megatron-Core layer specs for ``backend`` ("te", "local", "portable"): the zoo's GPT spec.
    Replace only if {a.architecture} needs modules a Llama-like decoder layer does not have."""
    from mcore_zoo.plugin_api import gpt_layer_specs

    return gpt_layer_specs(arch, backend, numerics, **kwargs)


def forward(handle, sequences, attention_mask=None, **options):  # type: ignore[no-untyped-def]
    """THD-packed forward, called by ``mcore_zoo.packed_forward`` for this architecture: the zoo's
    generic one (cu_seqlens, every parallel layout, per-sequence log-probs). Wrap it to add inputs
    or outputs; the contract is ``mcore_zoo.plugin_api.FORWARD_CONTRACT``."""
    from mcore_zoo.plugin_api import generic_forward

    return generic_forward(handle, sequences, attention_mask, **options)


@hookimpl
def mcore_zoo_architectures():  # type: ignore[no-untyped-def]
    return [
        ModelEntry(
            architecture={a.architecture!r},
            model_type={a.model_type!r},
            converter="{package}.plugin:convert",
            weight_rules="{package}.plugin:weight_map",
            layer_spec="{package}.plugin:layer_spec",
            forward="{package}.plugin:forward",
            example_config=EXAMPLE_CONFIG,
            hf_model_class="transformers:{a.architecture}",
            override={override!r},
            description="{a.architecture} (plugin {name})",
        )
    ]
'''


def render_pyproject(name: str) -> str:
    dist, package = _names(name)
    from ._version import __version__

    return f'''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "mcore-zoo plugin {name}"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["mcore-zoo>={__version__}"]

[project.optional-dependencies]
test = ["pytest>=8"]

# how mcore-zoo finds the plugin: entry-point name = plugin module
[project.entry-points.mcore_zoo]
{name} = "{package}.plugin"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-ra"
# Megatron-Core's import-time notices about optional packages (Transformer Engine, Apex)
filterwarnings = [
    "ignore:.*Transformer Engine and Apex are not installed.*",
    "ignore:Apex is not installed.*",
    "ignore::DeprecationWarning:megatron\\\\..*",
    "ignore:full scope is deprecated:UserWarning",
    "ignore::DeprecationWarning:torch.jit.*",
]
'''


def render_tests(name: str, a: Analysis) -> str:
    return f'''"""mcore-zoo's conformance suite for every architecture this plugin registers ({a.architecture})."""

from mcore_zoo.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    plugin = "{name}"
'''


def render_readme(name: str, a: Analysis) -> str:
    dist, package = _names(name)
    todo = []
    if a.todo_fields:
        todo.append(f"- **Config fields** ({len(a.todo_fields)}): classify {', '.join(f'`{k}`' for k in a.todo_fields)}"
                    " in `convert` (see the TODO list there).")  # fmt: skip
    if a.dense_error:
        todo.append(f"- **Converter**: the dense decoder reader refuses the example config: {a.dense_error}")
    if a.unconsumed_tensors or a.absent_tensors:
        todo.append(f"- **Weight map**: {len(a.unconsumed_tensors)} HF tensor(s) without a rule,"
                    f" {len(a.absent_tensors)} rule source(s) the HF model does not have (see `weight_map`).")  # fmt: skip
    if a.model_error:
        todo.append(f"- **Example config**: transformers cannot build the model at it: {a.model_error}")
    todo.append(f"- **Numerics**: the generated plugin assumes a Llama-like decoder (RMSNorm, gated MLP, rotate-half"
                f" RoPE). Where {a.architecture} differs (interleaved RoPE, norm placement, scales, softcapping),"
                " the parity contract fails and names the first layer that differs.")  # fmt: skip
    todo.append("- **Description and variants**: the one-line `description` shown by `mcore-zoo list`, and"
                " `variants` of the example config in `tests/test_conformance.py` for the code paths it does"
                " not take (tied embeddings, biases, windows).")  # fmt: skip
    return f"""# {dist}

[mcore-zoo](https://pypi.org/project/mcore-zoo/) plugin for `{a.architecture}`: trains the transformers
architecture on Megatron-Core `GPTModel`, with bitwise parity checked by mcore-zoo's conformance suite.
Generated by `mcore-zoo new-plugin {name} --arch {a.architecture}`.

## What you must fill in

{chr(10).join(todo)}

Until the config fields are classified, conversion stops with an error naming them: nothing is
silently ignored.

## Develop

```bash
pip install -e ".[test]"
mcore-zoo plugins                 # lists {name} ({dist} 0.1.0)
mcore-zoo show {a.architecture}   # field classification, TransformerConfig, weight map
pytest                            # mcore-zoo's conformance suite: every contract, CPU fp32
```

`pytest` runs, for every architecture the plugin registers: registration, config field coverage,
the weight map's bitwise round trip, bitwise parity with `transformers.{a.architecture}`, THD
packing, a tensor-parallel run on two gloo ranks, and fail-closed behaviour on bad input. A failure
names the contract and how to fix it. See mcore-zoo's `docs/adding-a-model.md`.

## Layout

```
pyproject.toml                    entry point: [project.entry-points.mcore_zoo] {name} = "{package}.plugin"
src/{package}/plugin.py   the four contributions and the example config
tests/test_conformance.py         the conformance suite (one class)
```
"""


def generate(name: str, architecture: str, out: Optional[Path] = None, *, override: bool = False,
             force: bool = False, registry: Any = None) -> tuple[Path, Analysis]:  # fmt: skip
    """Write the plugin package; return its directory and the analysis."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ZooError(f"plugin name {name!r}: use lowercase letters, digits and '_' (it names the entry point"
                       " and the package mcore_zoo_<name>)")  # fmt: skip
    if registry is None:
        from .registry import get_registry

        registry = get_registry()
    if architecture in registry.architectures() and not override:
        claims = registry.conflicts().get(architecture)
        who = "; ".join(c.origin for c in claims) if claims else registry.get(architecture).origin
        raise ZooError(f"{architecture} is already provided by {who}. Pass --override to generate a plugin that"
                       " takes it over (ModelEntry(override=True)), or choose another architecture.")  # fmt: skip
    dist, package = _names(name)
    out = Path(out) if out is not None else Path(dist)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (pass --force to write into it)")
    analysis = analyse(architecture)
    files = {
        "pyproject.toml": render_pyproject(name),
        "README.md": render_readme(name, analysis),
        f"src/{package}/__init__.py": f'"""mcore-zoo plugin {name}: {architecture}."""\n\n__version__ = "0.1.0"\n',
        f"src/{package}/plugin.py": render_plugin_module(analysis, name, override=override),
        "tests/test_conformance.py": render_tests(name, analysis),
    }
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return out, analysis


# ---------------------------------------------------------------------------- CLI
def cmd_new_plugin(args: Any) -> int:
    out, a = generate(args.name, args.arch, args.out, override=args.override, force=args.force)
    dist, package = _names(args.name)
    if args.json:
        print(json.dumps({
            "directory": str(out), "distribution": dist, "package": package, "architecture": a.architecture,
            "todo_fields": sorted(a.todo_fields), "unconsumed_tensors": sorted(a.unconsumed_tensors),
            "absent_tensors": a.absent_tensors, "converter_error": a.dense_error, "model_error": a.model_error,
        }, indent=2))  # fmt: skip
        return 0
    print(f"wrote {dist} for {a.architecture} in {out}/")
    todo = len(a.todo_fields) + len(a.unconsumed_tensors) + len(a.absent_tensors)
    todo += bool(a.dense_error) + bool(a.model_error)
    if todo:
        print(f"\nTODO in src/{package}/plugin.py ({todo} item(s)):")
        for k, v in a.todo_fields.items():
            print(f"  config field {k} = {v!r}: map, ignore with a reason, or reject")
        if a.dense_error:
            print(f"  converter: {a.dense_error}")
        for k, shape in a.unconsumed_tensors.items():
            print(f"  HF tensor {k} {list(shape)}: no rule consumes it")
        for k in a.absent_tensors:
            print(f"  rule source {k}: not a tensor of {a.architecture}")
        if a.model_error:
            print(f"  example config: {a.model_error}")
    else:
        print("\nThe generator found nothing left to classify; the conformance suite checks the numerics.")
    print(f"\nnext: cd {out} && pip install -e '.[test]' && pytest")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("new-plugin", help="write a plugin package for an HF architecture (with conformance tests)")
    p.add_argument("name", help="plugin (entry-point) name, e.g. phi3: package mcore_zoo_<name>")
    p.add_argument("--arch", required=True, help="the transformers class, e.g. Phi3ForCausalLM")
    p.add_argument("--out", type=Path, default=None, help="directory to write (default: ./mcore-zoo-<name>)")
    p.add_argument("--override", action="store_true", help="take over an architecture another plugin provides")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.add_argument("--json", action="store_true", help="print what was generated as JSON")
    p.set_defaults(func=cmd_new_plugin)
