"""The contracts a plugin's architectures must keep, and how a broken one is reported.

Each check of the conformance suite belongs to one contract. A failure raises
:class:`ContractError`, whose message names the contract, the architecture and example config it
broke for, what was observed, and how to fix it - not a bare assertion.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Contract:
    """One contract: ``name`` (as in test names and reports), what it checks, the usual fix."""

    name: str
    title: str
    checks: str
    fix: str


CONTRACTS: dict[str, Contract] = {
    c.name: c
    for c in (
        Contract(
            "registration",
            "the plugin loads through its entry point and owns its architectures",
            "the entry point imports, implements mcore_zoo_architectures and returns ModelEntry objects;"
            " no other plugin claims the same architecture; every entry has an example_config and a"
            " transformers reference class; importing the plugin module imports neither torch,"
            " Megatron-Core, Transformer Engine nor transformers",
            "install the package (pip install -e .) and declare the entry point in pyproject.toml:"
            " [project.entry-points.mcore_zoo] <name> = \"<package>.<module>\". Keep heavy imports inside"
            " the converter / weight-map functions and name them as 'module:attr' strings in ModelEntry.",
        ),
        Contract(
            "config",
            "every HF config field is mapped, ignored with a reason, or rejected",
            "transformers accepts the example config; the converter classifies every field of its"
            " normalised form (the config class's to_dict(), defaults included) and returns an"
            " ArchConfig; converting the normalised config again gives the same ArchConfig",
            "in the converter, read each field named above through the ConfigReader: reader.map(field,"
            " target) when it changes the model, reader.ignore(field, reason) when it cannot,"
            " reader.expect(...) / reader.unsupported(...) for values the model cannot honour exactly."
            " `mcore-zoo show ARCH` prints the classification.",
        ),
        Contract(
            "build",
            "the model is constructed from the example config: layer spec, GPTModel, parameters",
            "a single process builds the model of every example config on the CPU in fp32 with every"
            " backend the entry declares that runs there (portable, local), at random init; a failure"
            " while constructing the model in any other contract's run is reported here, not there",
            "read the traceback: a custom layer_spec names a module with the wrong constructor (Megatron-Core"
            " builds each submodule with config=..., hidden_size=... keywords: a q_layernorm / k_layernorm"
            " must accept them, like mcore_zoo.specs.norms.HFRMSNorm), a submodule slot the layer class"
            " does not have, or a converter that produced an ArchConfig the spec cannot honour.",
        ),
        Contract(
            "weight-map",
            "HF -> Megatron-Core -> HF is bitwise and covers every tensor and parameter",
            "a random reference checkpoint loads (every checkpoint tensor consumed or ignored with a"
            " reason, every mcore parameter given a source, every shape as the rules imply) and exports"
            " back to exactly the same tensor names and bits; every rule binds to a parameter",
            "compare `mcore-zoo show ARCH` with the HF model's state_dict(): every HF tensor needs a rule"
            " (a fused HF tensor: several Source(select=...) parts, see split_rows) or an ignore pattern"
            " with a reason; every mcore parameter needs a rule; each Transform.split must invert fuse.",
        ),
        Contract(
            "parity",
            "CPU fp32 logits equal transformers' bit for bit",
            "the packed (THD) portable model with HF-eager attention equals the transformers model on"
            " each sequence alone, and the local backend with numerics='hf-exact' equals it on a batch,"
            " bitwise (a one-token sequence within 1e-6 relative, 1e-5 for gated DeltaNet models; MoE models' THD packs within 1e-5,"
            " as each expert sees other row counts in a pack); a RoPE base off by 2x changes the"
            " logits by more than 1e-2 (the example config can fail)",
            "look for what differs from transformers: RoPE (theta, scaling, partial_rotary_factor), norm"
            " eps, biases, the q/k/v row order (mcore interleaves per query group: use the QKV"
            " transform), the gate/up order in fc1, the activation, the sliding window, softmax scale."
            " If the logits barely move when RoPE changes, make the example config less degenerate.",
        ),
        Contract(
            "thd",
            "a packed (THD) batch equals each sequence run alone",
            "packed_forward over sequences of different lengths equals the same model run on each"
            " sequence alone, bitwise; padding sequences to a multiple of 8 and packing a padded batch"
            " with an attention mask change nothing",
            "a custom layer spec or forward must honour PackedSeqParams (cu_seqlens, max_seqlen): every"
            " sequence attends only to itself and positions restart at 0 for each sequence.",
        ),
        Contract(
            "tensor-parallel",
            "TP=2 on gloo: sharded loading, packed forward and gathered export",
            "two ranks build the model with tensor_model_parallel_size=2, each loading only its chunks;"
            " the gathered logits equal transformers' (within 1e-5 relative) and agree across ranks; the"
            " gathered export equals the checkpoint bitwise",
            "check each source's tp_axis: column-parallel weights (linear_qkv, linear_fc1, embedding,"
            " output layer) split rows (tp_axis=0), row-parallel ones (linear_proj, linear_fc2) columns"
            " (tp_axis=1), norms and row-parallel biases are replicated (None). The example config must"
            " divide by 2 (heads, key/value heads, intermediate size, vocab).",
        ),
        Contract(
            "expert-parallel",
            "MoE models: EP=2 on gloo - each rank loads only its experts, forward and export gathered",
            "two ranks build every MoE example config with expert_model_parallel_size=2, each loading"
            " only its own experts (and the shared tensors); the packed logits equal transformers'"
            " (within 1e-5 relative) on both ranks and the export gathered over EP equals the"
            " checkpoint bitwise (dense architectures are skipped)",
            "expert rules must use '{expert}' in both names (local index on the mcore side, global on"
            " the HF side: mlp.experts.local_experts.{expert}. <- mlp.experts.{expert}.); router, shared"
            " experts and everything else are rules without '{expert}'. num_experts must divide by 2.",
        ),
        Contract(
            "gradients",
            "train_step gradients at TP=2 (MoE models also at EP=2) equal one process's, every parameter",
            "two gloo ranks build every example config (TP=2 with sequence parallelism for MoE models;"
            " then EP=2 for MoE models), run one train_step of a next-token loss over a pack and gather"
            " every gradient under its HF name; each equals the single-process step's within"
            " layout_bound (128 ulps of its largest entry, at least 1; 256 for gated DeltaNet models,"
            " whose recurrence carries rounding further)",
            "a parameter the layer keeps whole on every TP rank but uses on sharded activations (a q/k"
            " norm over the full width, a custom gate) needs its gradient summed over the TP group: use"
            " a TP-aware module (Megatron-Core's norms take the full width only before the split), or"
            " mark the parameter as Megatron-Core marks sequence-parallel weights so that"
            " finalize_model_grads all-reduces it; a qk_norm per head must see per-head shapes.",
        ),
        Contract(
            "bad-input",
            "unknown fields, unsupported values and damaged checkpoints fail closed, naming the culprit",
            "an HF config field nobody classifies raises UnclassifiedConfigFieldsError naming it; each"
            " unsupported value listed by the suite raises a ConfigError; a checkpoint with a missing,"
            " an unexpected or a mis-shaped tensor raises MissingTensorsError / UnexpectedTensorsError /"
            " ShapeMismatchError naming it before any parameter changes",
            "classify fields one by one (never `for k in reader.config: reader.ignore(k, ...)`); reject"
            " values the model cannot honour with reader.unsupported(field, value, reason); keep"
            " ignore patterns of the weight map narrow (full names, not '.*').",
        ),
    )
}


def markdown_table() -> str:
    """The contracts as a Markdown table (docs/adding-a-model.md embeds it; a test keeps it current)."""
    lines = ["| contract | what it guarantees | what is checked | usual fix |", "| --- | --- | --- | --- |"]
    for c in CONTRACTS.values():
        cells = [f"`{c.name}`", c.title, c.checks, c.fix]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


class ContractError(AssertionError):
    """A broken contract: which one, for what, what was observed, how to fix it."""

    def __init__(self, contract: str, subject: str, problem: str, fix: Optional[str] = None) -> None:
        self.contract = contract
        self.subject = subject
        self.problem = problem.rstrip()
        self.fix = fix if fix is not None else CONTRACTS[contract].fix
        super().__init__(self.render())

    def render(self) -> str:
        title = CONTRACTS[self.contract].title if self.contract in CONTRACTS else ""
        lines = [f"mcore-zoo contract '{self.contract}' broken for {self.subject}" + (f" ({title})" if title else "")]
        lines += ["", "what happened:"] + [f"  {line}" for line in self.problem.splitlines()]
        lines += ["", "how to fix:"] + [f"  {line}" for line in self.fix.splitlines()]
        return "\n".join(lines)


#: Exception type name -> fix hint that is more precise than the contract's general one.
_FIX_BY_ERROR = {
    "UnclassifiedConfigFieldsError": CONTRACTS["config"].fix,
    "UnsupportedConfigError": "the example config holds a value the converter refuses: change the example (or"
    " the variant) to values the plugin supports, or implement the value exactly.",
    "PluginConflictError": "another installed plugin registers the same architecture. Rename yours, uninstall or"
    " block the other (MCORE_ZOO_BLOCK_PLUGINS=<plugin name>), or let exactly one entry declare"
    " ModelEntry(override=True).",
    "MissingTensorsError": CONTRACTS["weight-map"].fix,
    "UnexpectedTensorsError": CONTRACTS["weight-map"].fix,
    "UnmappedParametersError": CONTRACTS["weight-map"].fix,
    "ShapeMismatchError": "a rule's sources do not have the shapes its transform implies: check the row counts of"
    " split_rows (q: heads*head_dim, k and v: kv_heads*head_dim), head_dim, and the transform.",
    "LayoutError": CONTRACTS["tensor-parallel"].fix,
}


def describe(exc: BaseException) -> str:
    """The exception as a problem statement; for errors outside mcore-zoo's own family (a bug in
    plugin code), the innermost frames of the traceback too."""
    from ..errors import ZooError

    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (ZooError, AssertionError)):
        return text
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = "".join(traceback.format_list(frames)).rstrip()
    return f"{text}\n\nraised at:\n{where}"


@contextlib.contextmanager
def contract(name: str, subject: str, *, fix: Optional[str] = None) -> Iterator[None]:
    """Run a block as part of contract ``name``: any exception becomes a :class:`ContractError`."""
    __tracebackhide__ = True
    try:
        yield
    except ContractError:
        raise
    except Exception as exc:  # anything the plugin's code raises is a broken contract
        hint = fix or _FIX_BY_ERROR.get(type(exc).__name__)
        raise ContractError(name, subject, describe(exc), hint) from exc


def fail(name: str, subject: str, problem: str, fix: Optional[str] = None) -> None:
    __tracebackhide__ = True
    raise ContractError(name, subject, problem, fix)
