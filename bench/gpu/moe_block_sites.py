"""Where one MoE block of the zoo departs from transformers' (the ``moe-sites`` phase of ``run_all.sh``).

The reports of ``parity-report`` and ``moe_exact_packs.py`` compare whole layers; this compares the
sites inside one MoE block. For an MoE built-in (``--config`` a published config, ``--set`` fields,
``--scale``), it writes a random-weight checkpoint (the project's seeding, ``prepare_model``), loads
transformers' model from it (eager attention, the experts implementation that the numerics knob
``moe_experts`` names) and the zoo's model (``build_model`` with ``load=``, backend ``local``, the
``--numerics`` profile and ``--knob`` overrides), takes the input of one MoE block (``--layer``;
default the first MoE layer) from transformers' run of the model, and feeds it to both blocks in
each form:

* ``alone``: every sequence of ``--lengths`` alone (the zoo's block as ``[s, 1, h]``);
* ``thd``: the zoo's block on the THD pack of all of them (the pack's bounds on the thread, as
  the decoder layer keeps them for ``pack_gemms``), against transformers on each sequence alone;
* ``bshd``: a ``--batch BxL`` batch (the zoo's block as ``[L, B, h]``, transformers' as ``[B, L, h]``).

Sites captured on both sides (forward hooks on the blocks' submodules, and a recorder of every GEMM
call - ``F.linear``, ``torch.matmul``, ``torch.mm``, ``grouped_mm`` - made inside the block, each
named by the weight it multiplies): ``router.logits``, ``router.topk_indices`` (same experts? same
order?), ``router.weights``, the shared expert's ``gate_proj`` / ``up_proj`` (transformers' two
GEMMs against the zoo's fused ``linear_fc1`` halves), ``shared.act``, ``shared.down_proj``,
``shared.gate_logits``, ``shared.gated``, each routed expert's input rows, ``experts.fc1``
(gate+up) output, ``experts.fc2_input`` and ``experts.fc2`` output (per expert: rows routed, max
|d|), ``experts.combine`` (the weighted sum over a token's experts; its note says which combine summed
the zoo's rows - the HF-order combine or Megatron-Core's own ``unpermute`` - under which token
dispatcher, and both sides' dtypes) and ``block.output``. Every
site gives its max |d| and the shapes, strides and dtypes of the GEMM calls each side ran; the first
differing site is named, and a differing GEMM site is re-run in isolation both ways (each side's
call again on its own tensors, and each side's call on the other side's input where the layouts
allow) to tell the GEMM from its input.

Writes ``OUT/<name>.json`` and ``OUT/<name>.md``; exits 1 when a form is not bitwise, 0 otherwise.
Run from the repository root (``PYTHONPATH=src``), with cuBLAS split-K off as ``run_all.sh`` sets it::

    python bench/gpu/moe_block_sites.py --config tests/fixtures/configs/qwen3-30b-a3b.json \\
        --set num_hidden_layers=1 --knob moe_experts=eager --out OUT

The CPU run at the ``tiny`` scale (what ``tests/parity/test_moe_block_sites.py`` runs)::

    python bench/gpu/moe_block_sites.py --device cpu --scale tiny --lengths 13,7,3 --batch 2x5 \\
        --config tests/fixtures/configs/qwen3-next-80b-a3b.json --set num_hidden_layers=1 --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: the sites of an MoE block, in data-flow order (router, shared expert, routed experts, combine)
SITES = ("router.logits", "router.topk_indices", "router.weights", "shared.gate_proj", "shared.up_proj", "shared.act",
         "shared.down_proj", "shared.gate_logits", "shared.gated", "experts.fc1_input", "experts.fc1",
         "experts.fc2_input", "experts.fc2", "experts.combine", "block.output")  # fmt: skip
#: the zoo's GEMMs that run over the tokens in transformers' batch-major order (the HF-order router and
#: shared-expert gate); its others run in Megatron-Core's sequence-major order
ZOO_IN_HF_ORDER = ("router", "shared.gate_logits")
#: sites that are one GEMM's output (re-run in isolation where they differ), and their input site
GEMM_SITES = {"router.logits": None, "shared.gate_proj": None, "shared.up_proj": None, "shared.down_proj": "shared.act",
              "shared.gate_logits": None, "experts.fc1": "experts.fc1_input", "experts.fc2": "experts.fc2_input"}  # fmt: skip


# ---------------------------------------------------------------------------------------- GEMM calls
@dataclass
class Gemm:
    """One GEMM call made inside a block: the function, its arguments, its output, and its role
    (``router``, ``shared.gate_proj``, ``shared.fc1``, ``expert.fc1`` with ``expert``, ``experts.fc1``
    for a grouped call over all experts, ...; ``None``: not a site of the block)."""

    op: str
    fn: Callable[..., torch.Tensor]
    args: tuple
    kwargs: dict
    output: torch.Tensor
    role: str | None = None
    expert: int | None = None

    @property
    def input(self) -> torch.Tensor:
        return self.args[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.args[1]

    @property
    def offsets(self) -> list[int] | None:
        offs = self.kwargs.get("offs", self.args[2] if self.op == "grouped_mm" and len(self.args) > 2 else None)
        return None if offs is None else [int(o) for o in offs.tolist()]

    def rerun(self, input: torch.Tensor | None = None) -> torch.Tensor:
        """The same call again (on ``input`` instead of the recorded one, when given)."""
        args = self.args if input is None else (input, *self.args[1:])
        return self.fn(*args, **self.kwargs)

    def signature(self) -> dict[str, Any]:
        """The call's op, and its operands' shapes, strides and dtypes (what picks a GEMM kernel)."""

        def describe(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return None
            return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).replace("torch.", "")}

        sig = {"op": self.op, "input": describe(self.input), "weight": describe(self.weight), "output": describe(self.output)}
        if self.op == "grouped_mm":
            sig["groups"] = len(self.offsets or [])
        elif len(self.args) > 2 and isinstance(self.args[2], torch.Tensor):
            sig["bias"] = describe(self.args[2])
        return sig


class GemmRecorder:
    """Records every ``F.linear`` / ``torch.matmul`` (and ``@``) / ``torch.mm`` / ``grouped_mm`` call made while
    active (process-wide functions patched, restored on exit). ``roles``: ``(kind, data_ptr)`` of a
    weight (kind ``"grouped"`` for ``grouped_mm`` calls, else ``"gemm"``) -> ``(role, expert)``;
    ``fallback(gemm)`` names the rest (or leaves them ``None``)."""

    def __init__(self, roles: dict[tuple[str, int], tuple[str, int | None]],
                 fallback: Callable[[Gemm], tuple[str | None, int | None]]) -> None:  # fmt: skip
        self.roles, self.fallback = roles, fallback
        self.calls: list[Gemm] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[GemmRecorder]:
        F = torch.nn.functional
        targets = [(F, "linear", "linear"), (torch, "matmul", "matmul"), (torch, "mm", "mm"),
                   (torch.Tensor, "__matmul__", "matmul")]  # fmt: skip
        if hasattr(F, "grouped_mm"):
            targets.append((F, "grouped_mm", "grouped_mm"))
        elif hasattr(torch, "_grouped_mm"):
            targets.append((torch, "_grouped_mm", "grouped_mm"))
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        busy = [False]  # a recorded op calling another (matmul -> mm) is one call

        def make(fn: Callable[..., torch.Tensor], op: str) -> Callable[..., torch.Tensor]:
            def record(*args: Any, **kwargs: Any) -> torch.Tensor:
                if busy[0]:
                    return fn(*args, **kwargs)
                busy[0] = True
                try:
                    out = fn(*args, **kwargs)
                finally:
                    busy[0] = False
                gemm = Gemm(op, fn, args, kwargs, out.clone())  # callers may add a bias in place
                if len(args) > 1 and isinstance(args[1], torch.Tensor):
                    kind = "grouped" if op == "grouped_mm" else "gemm"
                    gemm.role, gemm.expert = self.roles.get((kind, args[1].data_ptr()), (None, None))
                    if gemm.role is None:
                        gemm.role, gemm.expert = self.fallback(gemm)
                self.calls.append(gemm)
                return out

            return record

        for (owner, name, fn), (_, _, op) in zip(originals, targets):
            setattr(owner, name, make(fn, op))
        try:
            yield self
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)

    def of(self, role: str) -> list[Gemm]:
        return [g for g in self.calls if g.role == role]


def _roles_of_matrix(param: torch.Tensor, role: str, roles: dict[tuple[str, int], tuple[str, int | None]],
                     expert: int | None = None) -> None:  # fmt: skip
    """``param`` (or a transposed view of it: the same pointer) is the weight of ``role``'s GEMMs."""
    roles[("gemm", param.data_ptr())] = (role, expert)


# ---------------------------------------------------------------------------------------- one side
@dataclass
class SideRun:
    """What one side's block did on one input: the GEMM calls, the routing (batch-major ``[T, k]``),
    and the tensors captured by hooks (batch-major ``[T, ...]``)."""

    gemms: list[Gemm] = field(default_factory=list)
    topk_indices: list[torch.Tensor] = field(default_factory=list)
    topk_weights: list[torch.Tensor] = field(default_factory=list)
    combine: list[torch.Tensor] = field(default_factory=list)
    shared_gated: list[torch.Tensor] = field(default_factory=list)
    output: list[torch.Tensor] = field(default_factory=list)
    index_order: bool = True  # the top-k order is the router's own (False: derived from a routing map)
    #: the zoo's unpermute calls: (the dispatcher's class, whether the HF-order combine summed them)
    unpermutes: list[tuple[str, bool]] = field(default_factory=list)

    def of(self, role: str) -> list[Gemm]:
        return [g for g in self.gemms if g.role == role]

    def extend(self, other: SideRun) -> None:
        for name in ("gemms", "topk_indices", "topk_weights", "combine", "shared_gated", "output", "unpermutes"):
            getattr(self, name).extend(getattr(other, name))
        self.index_order = self.index_order and other.index_order


def batch_major(t: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """One of the zoo's tensors over the tokens of ``seq x batch`` -> ``[b * s, ...]`` rows in
    transformers' (batch-major) order: ``[s, b, ...]`` or ``[s * b, ...]`` (Megatron-Core's order),
    or ``[b, s, ...]`` (the zoo's calls that run in transformers' order). ``batch != seq``."""
    if batch == 1:
        return t.reshape(seq, *t.shape[(2 if t.dim() > 2 else 1):]) if t.dim() > 2 else t
    if t.dim() > 2 and tuple(t.shape[:2]) == (batch, seq):
        return t.reshape(batch * seq, *t.shape[2:])
    rest = t.shape[2:] if t.dim() > 2 else t.shape[1:]
    return t.reshape(seq, batch, *rest).transpose(0, 1).reshape(batch * seq, *rest)


def hf_block_parts(block: torch.nn.Module) -> dict[str, Any]:
    """transformers' MoE block's router, experts and shared expert (whichever the family has)."""
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    return {"router": getattr(block, "gate", None) or getattr(block, "router", None), "experts": block.experts,
            "shared": shared, "shared_gate": getattr(block, "shared_expert_gate", None)}  # fmt: skip


def run_hf_block(block: torch.nn.Module, x: torch.Tensor, num_experts: int) -> SideRun:
    """transformers' block on ``x [B, S, H]``, every site recorded."""
    parts = hf_block_parts(block)
    experts, shared = parts["experts"], parts["shared"]
    roles: dict[tuple[str, int], tuple[str, int | None]] = {}
    if getattr(parts["router"], "weight", None) is not None:
        _roles_of_matrix(parts["router"].weight, "router", roles)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            _roles_of_matrix(getattr(shared, name).weight, f"shared.{name}", roles)
    if parts["shared_gate"] is not None:
        _roles_of_matrix(parts["shared_gate"].weight, "shared.gate_logits", roles)
    gate_up = getattr(experts, "gate_up_proj", None)
    down = experts.down_proj
    for e in range(num_experts):  # the eager loop: one expert's slice of the stack per call
        if gate_up is not None:
            _roles_of_matrix(gate_up[e], "expert.fc1", roles, e)
        _roles_of_matrix(down[e], "expert.fc2", roles, e)
    if gate_up is not None:  # grouped calls take the whole stack (a transposed view: same pointer)
        roles[("grouped", gate_up.data_ptr())] = ("experts.fc1", None)
    roles[("grouped", down.data_ptr())] = ("experts.fc2", None)

    def fallback(g: Gemm) -> tuple[str | None, int | None]:  # a weight cast on the fly (fp32 routers)
        width = g.output.shape[-1] if g.output.dim() else 0
        if g.op != "grouped_mm" and width == num_experts and g.input.shape[-1] == x.shape[-1]:
            return "router", None
        return None, None

    run = SideRun()
    recorder = GemmRecorder(roles, fallback)

    def on_router(module: Any, inputs: Any, output: Any) -> None:  # (logits, weights [T, k], indices [T, k])
        run.topk_weights.append(output[1])
        run.topk_indices.append(output[2])

    def on_experts(module: Any, inputs: Any, output: Any) -> None:  # the weighted sum over a token's experts
        run.combine.append(output.reshape(-1, output.shape[-1]))

    hooks = [parts["router"].register_forward_hook(on_router), experts.register_forward_hook(on_experts)]
    try:
        with torch.no_grad(), recorder.active():
            out = block(x)
    finally:
        for h in hooks:
            h.remove()
    out = out[0] if isinstance(out, tuple) else out
    run.output.append(out.reshape(-1, out.shape[-1]))
    run.gemms = recorder.calls
    if parts["shared_gate"] is not None and run.of("shared.gate_logits") and run.of("shared.down_proj"):
        # transformers computes sigmoid(gate) * shared inline: the same two ops on its recorded operands
        gate = run.of("shared.gate_logits")[0].output
        shared_out = run.of("shared.down_proj")[0].output
        run.shared_gated.append(torch.nn.functional.sigmoid(gate) * shared_out)
    elif shared is not None and run.of("shared.down_proj"):
        run.shared_gated.append(run.of("shared.down_proj")[0].output.reshape(-1, x.shape[-1]))
    return run


def run_zoo_block(layer: torch.nn.Module, x: torch.Tensor, packed_seq_params: Any = None) -> SideRun:
    """The zoo's MoE block on ``x [S, B, H]`` (a THD pack: ``B == 1`` with ``packed_seq_params``),
    every site recorded; routing and captured tensors converted to transformers' batch-major order."""
    from megatron.core.transformer.moe import token_dispatcher

    from mcore_zoo.families.moe import spec
    from mcore_zoo.specs.pack_rows import inside_pack

    seq, batch, hidden = x.shape
    mlp = layer.mlp
    router, experts, shared = mlp.router, mlp.experts, getattr(mlp, "shared_experts", None)
    num_experts = int(mlp.config.num_moe_experts)
    roles: dict[tuple[str, int], tuple[str, int | None]] = {}
    _roles_of_matrix(router.weight, "router", roles)
    if shared is not None:
        fc1_weight = shared.linear_fc1.weight  # [gate rows; up rows]: one GEMM, or its halves apart
        _roles_of_matrix(fc1_weight, "shared.fc1", roles)
        _roles_of_matrix(fc1_weight[fc1_weight.shape[0] // 2:], "shared.up_proj", roles)
        _roles_of_matrix(shared.linear_fc2.weight, "shared.down_proj", roles)
        if getattr(shared, "gate_weight", None) is not None:
            _roles_of_matrix(shared.gate_weight, "shared.gate_logits", roles)
    local = list(getattr(experts, "local_experts", []))
    for e, expert in enumerate(local):
        _roles_of_matrix(expert.linear_fc1.weight, "expert.fc1", roles, e)
        _roles_of_matrix(expert.linear_fc2.weight, "expert.fc2", roles, e)
    grouped_calls, expert_calls = [0], [0]
    on_the_fly = bool(local) and getattr(local[0].linear_fc1, "bias", None) is not None

    def fallback(g: Gemm) -> tuple[str | None, int | None]:
        if g.op == "grouped_mm":  # the stacked weights of grouped_experts_apply: fc1, then fc2
            grouped_calls[0] += 1
            return ("experts.fc1" if grouped_calls[0] % 2 else "experts.fc2"), None
        width = g.output.shape[-1] if g.output.dim() else 0
        if width == num_experts and g.input.shape[-1] == hidden:
            return "router", None
        if not on_the_fly:
            return None, None
        # weights laid out on the fly (gpt-oss's clamped-SwiGLU experts): every expert in turn, fc1 then fc2
        expert_calls[0] += 1
        return ("expert.fc1" if expert_calls[0] % 2 else "expert.fc2"), ((expert_calls[0] - 1) // 2) % num_experts

    run = SideRun()
    recorder = GemmRecorder(roles, fallback)

    def on_router(module: Any, inputs: Any, output: Any) -> None:
        probs, routing_map = output[0], output[1]
        probs = probs.reshape(-1, num_experts)
        indices = getattr(spec._LOCAL, "topk_indices", None)
        if indices is None or indices.shape[0] != probs.shape[0]:  # stock router: the map's experts, ascending
            run.index_order = False
            k = int(routing_map.reshape(-1, num_experts)[0].sum())
            indices = torch.sort(routing_map.reshape(-1, num_experts).int(), dim=1, descending=True, stable=True)[1][:, :k]
            indices = indices.sort(dim=1).values
        rows = indices.shape[0] // batch
        run.topk_indices.append(batch_major(indices, rows, batch))
        run.topk_weights.append(batch_major(probs.gather(1, indices.to(probs.device)), rows, batch))

    hooks = [router.register_forward_hook(on_router)]
    if shared is not None:

        def on_shared(module: Any, inputs: Any, output: Any) -> None:  # the gated shared expert output
            out = output[0] if isinstance(output, tuple) else output
            run.shared_gated.append(batch_major(out, inputs[0].shape[0], batch))

        hooks.append(shared.register_forward_hook(on_shared))
    spec._install_hf_order_combine()  # the zoo's combine first: the recorder wraps it, not the reverse
    original_unpermute, original_hf_order = token_dispatcher.unpermute, spec.hf_order_unpermute
    summed_in_hf_order = []

    def hf_order_unpermute(*args: Any, **kwargs: Any) -> torch.Tensor:
        summed_in_hf_order.append(True)
        return original_hf_order(*args, **kwargs)

    def unpermute(*args: Any, **kwargs: Any) -> torch.Tensor:
        summed_in_hf_order.clear()
        out = original_unpermute(*args, **kwargs)
        run.combine.append(batch_major(out, out.shape[0] // batch, batch))
        run.unpermutes.append((type(mlp.token_dispatcher).__name__, bool(summed_in_hf_order)))
        return out

    token_dispatcher.unpermute, spec.hf_order_unpermute = unpermute, hf_order_unpermute
    pack = inside_pack(packed_seq_params, seq) if packed_seq_params is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), recorder.active(), pack:
            out, _ = mlp(x)
    finally:
        token_dispatcher.unpermute, spec.hf_order_unpermute = original_unpermute, original_hf_order
        for h in hooks:
            h.remove()
    run.output.append(batch_major(out, seq, batch))
    for g in recorder.calls:  # the gate half of linear_fc1's weight starts where the whole does
        if g.role == "shared.fc1" and shared is not None and g.output.shape[-1] == fc1_weight.shape[0] // 2:
            g.role = "shared.gate_proj"
    run.gemms = recorder.calls
    return run


# ---------------------------------------------------------------------------------------- comparison
def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _gemm_rows(run: SideRun, token_role: str, seq_batch: list[tuple[int, int]] | None,
               which: str = "output") -> torch.Tensor | None:  # fmt: skip
    """The outputs (or inputs) of a token-site GEMM (one call per block call), batch-major,
    concatenated; ``seq_batch``: the zoo's ``(s, b)`` per call, ``None`` for transformers' calls
    (already batch-major)."""
    calls = run.of(token_role)
    if not calls or (seq_batch is not None and len(calls) != len(seq_batch)):
        return None
    tensors = [getattr(g, which) for g in calls]
    if seq_batch is None or token_role in ZOO_IN_HF_ORDER:
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors])
    return torch.cat([batch_major(t, s, b).reshape(s * b, -1) for t, (s, b) in zip(tensors, seq_batch)])


def expert_rows(run: SideRun, num_experts: int) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Expert -> one entry per block call with rows: its fc1 input / output, fc2 input / output, in
    the order the side ran them (grouped calls split at their offsets)."""
    rows: dict[int, list[dict[str, torch.Tensor]]] = {e: [] for e in range(num_experts)}
    fc1_grouped, fc2_grouped = run.of("experts.fc1"), run.of("experts.fc2")
    for fc1, fc2 in zip(fc1_grouped, fc2_grouped):
        start = 0
        for e, end in enumerate(fc1.offsets or []):
            if end > start and e < num_experts:
                rows[e].append({"fc1_input": fc1.input[start:end], "fc1": fc1.output[start:end],
                                "fc2_input": fc2.input[start:end], "fc2": fc2.output[start:end], "call": (fc1, fc2)})  # fmt: skip
            start = end
    for fc1, fc2 in zip(run.of("expert.fc1"), run.of("expert.fc2")):
        if not fc1.input.numel():  # an expert without rows (the zoo calls every expert)
            continue
        rows[fc1.expert].append({"fc1_input": fc1.input.reshape(-1, fc1.input.shape[-1]), "fc1": fc1.output.reshape(-1, fc1.output.shape[-1]),
                                 "fc2_input": fc2.input.reshape(-1, fc2.input.shape[-1]), "fc2": fc2.output.reshape(-1, fc2.output.shape[-1]),
                                 "call": (fc1, fc2)})  # fmt: skip
    return rows


def signatures(calls: list[Gemm], limit: int = 4) -> list[dict[str, Any]]:
    """The distinct call signatures (op, shapes, strides, dtypes) of ``calls``, with their counts."""
    seen: dict[str, dict[str, Any]] = {}
    for g in calls:
        sig = g.signature()
        key = json.dumps({k: v for k, v in sig.items() if k != "output"}, sort_keys=True)
        if key in seen:
            seen[key]["calls"] += 1
        else:
            seen[key] = {**sig, "calls": 1}
    out = list(seen.values())
    return out[:limit] + ([{"more": len(out) - limit}] if len(out) > limit else [])


def isolate(hf: Gemm, zoo: Gemm, hf_part: Callable[[torch.Tensor], torch.Tensor],
            zoo_part: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    """One differing GEMM re-run in isolation: each side's call again on its own tensors (equal to
    what it gave in the block?), and, where the two inputs have one shape, each side's call on the
    other side's input (``*_part`` take each output to the compared columns)."""
    hf_out, zoo_out = hf_part(hf.output), zoo_part(zoo.output)
    result: dict[str, Any] = {"hf_call": hf.signature(), "zoo_call": zoo.signature(),
                              "hf_rerun_equal": bool(torch.equal(hf_part(hf.rerun()), hf_out)),
                              "zoo_rerun_equal": bool(torch.equal(zoo_part(zoo.rerun()), zoo_out))}  # fmt: skip
    if hf_out.shape == zoo_out.shape:
        result["max_abs_outputs"] = max_abs(hf_out, zoo_out)
    same_shape = hf.input.shape == zoo.input.shape
    result["inputs_equal"] = bool(same_shape and torch.equal(hf.input, zoo.input))
    if same_shape:
        zoo_on_hf = zoo_part(zoo.rerun(hf.input))
        hf_on_zoo = hf_part(hf.rerun(zoo.input))
        result["zoo_call_on_hf_input_vs_hf"] = max_abs(zoo_on_hf, hf_out)
        result["hf_call_on_zoo_input_vs_zoo"] = max_abs(hf_on_zoo, zoo_out)
        if result["inputs_equal"] and result.get("max_abs_outputs", 0.0) > 0:
            result["verdict"] = "the GEMM: equal inputs, the two calls round differently"
        elif result["zoo_call_on_hf_input_vs_hf"] == 0.0:
            result["verdict"] = "the input: the zoo's call on transformers' input gives transformers' output"
        else:
            result["verdict"] = "the GEMM: on the same input the two calls differ"
    else:
        result["verdict"] = "inputs laid out differently (no cross run); see the input site"
    return result


def combine_kind(unpermutes: list[tuple[str, bool]]) -> str:
    """Which combine summed the zoo's rows: ``hf_order_unpermute`` (transformers' order and dtype)
    or Megatron-Core's own ``unpermute`` (``scatter_add_`` in the rows' dtype: on CUDA, atomics in
    no fixed order), in how many of the block's unpermute calls, under which token dispatcher."""
    if not unpermutes:
        return "no unpermute call"
    dispatchers = ", ".join(sorted({name for name, _ in unpermutes}))
    hf_order = sum(1 for _, summed in unpermutes if summed)
    which = "HF-order combine" if hf_order == len(unpermutes) else "Megatron-Core's unpermute" if not hf_order else "mixed"
    return f"{which} ({hf_order} of {len(unpermutes)} unpermutes in HF order; {dispatchers})"


def compare_runs(hf: SideRun, zoo: SideRun, zoo_shapes: list[tuple[int, int]], num_experts: int) -> dict[str, Any]:
    """Every site of one form: max |d| (``None`` where a side has no such site), the GEMM calls each
    side ran, and the first differing site."""
    sites: dict[str, dict[str, Any]] = {}

    def put(name: str, a: torch.Tensor | None, b: torch.Tensor | None, hf_calls: list[Gemm] = (),
            zoo_calls: list[Gemm] = (), **extra: Any) -> None:  # fmt: skip
        entry: dict[str, Any] = {"max_abs": None, **extra}
        if a is not None and b is not None:
            entry["hf"] = {"shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", "")}
            entry["zoo"] = {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", "")}
            entry["max_abs"] = max_abs(a, b) if a.shape == b.shape else float("inf")
        if hf_calls or zoo_calls:
            entry["hf_gemms"], entry["zoo_gemms"] = signatures(list(hf_calls)), signatures(list(zoo_calls))
        sites[name] = entry

    cat = lambda ts: torch.cat(ts) if ts else None
    put("router.logits", _gemm_rows(hf, "router", None), _gemm_rows(zoo, "router", zoo_shapes), hf.of("router"), zoo.of("router"))
    hi, zi = cat(hf.topk_indices), cat(zoo.topk_indices)
    route: dict[str, Any] = {"max_abs": None}
    if hi is not None and zi is not None and hi.shape == zi.shape:
        zi = zi.to(hi.device)
        same_set = (hi.sort(dim=1).values == zi.sort(dim=1).values).all(dim=1)
        same_order = (hi == zi).all(dim=1)
        route = {"max_abs": 0.0 if bool(same_set.all()) and (bool(same_order.all()) or not zoo.index_order) else 1.0,
                 "tokens": int(hi.shape[0]), "tokens_other_experts": int((~same_set).sum()),
                 "tokens_other_order": int((same_set & ~same_order).sum()) if zoo.index_order else None}  # fmt: skip
    sites["router.topk_indices"] = route
    hw, zw = cat(hf.topk_weights), cat(zoo.topk_weights)
    if route.get("tokens_other_experts") == 0 and hw is not None and zw is not None and not zoo.index_order:
        zw = zw.gather(1, torch.argsort(torch.argsort(hi, dim=1), dim=1))  # the map's order -> transformers'
    put("router.weights", hw, zw)
    # shared expert: transformers' gate_proj / up_proj against the halves of the zoo's fused linear_fc1
    # (the zoo's gate_proj / up_proj: the halves of linear_fc1 as two GEMMs, shared_expert_gemm="hf")
    zoo_fc1 = _gemm_rows(zoo, "shared.fc1", zoo_shapes)
    half = None if zoo_fc1 is None else zoo_fc1.shape[-1] // 2
    for name, part in (("gate_proj", slice(None, half)), ("up_proj", slice(half, None))):
        role = f"shared.{name}"
        if zoo.of(role):
            put(role, _gemm_rows(hf, role, None), _gemm_rows(zoo, role, zoo_shapes), hf.of(role), zoo.of(role))
        else:
            put(role, _gemm_rows(hf, role, None), None if half is None else zoo_fc1[:, part], hf.of(role), zoo.of("shared.fc1"))
    put("shared.act", _gemm_rows(hf, "shared.down_proj", None, "input"),
        _gemm_rows(zoo, "shared.down_proj", zoo_shapes, "input"))
    put("shared.down_proj", _gemm_rows(hf, "shared.down_proj", None), _gemm_rows(zoo, "shared.down_proj", zoo_shapes),
        hf.of("shared.down_proj"), zoo.of("shared.down_proj"))  # fmt: skip
    put("shared.gate_logits", _gemm_rows(hf, "shared.gate_logits", None), _gemm_rows(zoo, "shared.gate_logits", zoo_shapes),
        hf.of("shared.gate_logits"), zoo.of("shared.gate_logits"))  # fmt: skip
    put("shared.gated", cat(hf.shared_gated), cat(zoo.shared_gated))
    # routed experts, per expert, call by call (both sides put an expert's rows in transformers' order)
    hf_rows, zoo_rows = expert_rows(hf, num_experts), expert_rows(zoo, num_experts)
    per_expert = []
    for e in range(num_experts):
        a, b = hf_rows[e], zoo_rows[e]
        entry: dict[str, Any] = {"expert": e, "rows_hf": sum(r["fc1"].shape[0] for r in a),
                                 "rows_zoo": sum(r["fc1"].shape[0] for r in b)}  # fmt: skip
        comparable = len(a) == len(b) and all(x["fc1"].shape[0] == y["fc1"].shape[0] for x, y in zip(a, b))
        for key in ("fc1_input", "fc1", "fc2_input", "fc2"):
            entry[key] = max((max_abs(x[key], y[key]) for x, y in zip(a, b)), default=0.0) if comparable else float("inf")
        if entry["rows_hf"] or entry["rows_zoo"]:
            per_expert.append(entry)
    hf_expert_calls = hf.of("experts.fc1") + hf.of("expert.fc1")
    zoo_expert_calls = zoo.of("experts.fc1") + zoo.of("expert.fc1")
    for key in ("fc1_input", "fc1", "fc2_input", "fc2"):
        worst = max((p[key] for p in per_expert), default=None)
        first = next((p["expert"] for p in per_expert if p[key] > 0), None)
        calls = {"fc1": (hf_expert_calls, zoo_expert_calls),
                 "fc2": (hf.of("experts.fc2") + hf.of("expert.fc2"), zoo.of("experts.fc2") + zoo.of("expert.fc2"))}.get(key, ((), ()))  # fmt: skip
        entry = {"max_abs": worst, "first_expert": first, "experts_differing": sum(1 for p in per_expert if p[key] > 0)}
        if calls[0] or calls[1]:
            entry["hf_gemms"], entry["zoo_gemms"] = signatures(list(calls[0])), signatures(list(calls[1]))
        sites[f"experts.{key}"] = entry
    put("experts.combine", cat(hf.combine), cat(zoo.combine), combine_kind=combine_kind(zoo.unpermutes))
    put("block.output", cat(hf.output), cat(zoo.output))
    first = next((name for name in SITES if (sites.get(name) or {}).get("max_abs")), None)
    isolation = None
    if first in GEMM_SITES:
        isolation = _isolate_site(first, hf, zoo, hf_rows, zoo_rows, sites)
    return {"sites": sites, "per_expert": per_expert, "first_differing_site": first, "isolation": isolation,
            "bitwise": first is None}  # fmt: skip


def _isolate_site(site: str, hf: SideRun, zoo: SideRun, hf_rows: dict, zoo_rows: dict, sites: dict) -> dict[str, Any] | None:
    """The isolation re-run of the first differing GEMM site (the first call pair that differs)."""
    whole = lambda t: t
    if site.startswith("experts."):
        e = sites[site]["first_expert"]
        key = site.split(".", 1)[1]
        for a, b in zip(hf_rows[e], zoo_rows[e]):
            if max_abs(a[key], b[key]) > 0:
                idx = 0 if key == "fc1" else 1
                hg, zg = a["call"][idx], b["call"][idx]
                rows_a, rows_b = a[key].shape[0], b[key].shape[0]
                if hg.op == "grouped_mm" or zg.op == "grouped_mm":  # the expert's rows out of a grouped call
                    return {"expert": e, **isolate(hg, zg, _rows_of(hg, a[key]), _rows_of(zg, b[key]))}
                return {"expert": e, "rows": [rows_a, rows_b], **isolate(hg, zg, whole, whole)}
        return None
    hf_role = "router" if site == "router.logits" else site
    zoo_role = "shared.fc1" if site in ("shared.gate_proj", "shared.up_proj") and not zoo.of(site) else hf_role
    pairs = list(zip(hf.of(hf_role), zoo.of(zoo_role)))
    for hg, zg in pairs:
        zoo_part = whole
        if zoo_role == "shared.fc1":
            half = zg.output.shape[-1] // 2
            zoo_part = (lambda t, h=half: t[..., :h]) if site == "shared.gate_proj" else (lambda t, h=half: t[..., h:])
        if hg.output.numel() != zg.output.numel() // (2 if zoo_role == "shared.fc1" else 1):
            continue
        if max_abs(hg.output.reshape(-1), zoo_part(zg.output).reshape(-1)) > 0 or len(pairs) == 1:
            return isolate(hg, zg, _as_rows, lambda t, part=zoo_part: _as_rows(part(t)))
    return None


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _rows_of(call: Gemm, rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rows of ``call``'s output that ``rows`` (a slice of it) covers."""
    start = (rows.data_ptr() - call.output.data_ptr()) // (call.output.stride(0) * call.output.element_size())
    return lambda t: t[start:start + rows.shape[0]]


# ---------------------------------------------------------------------------------------- the run
def first_moe_layer(hf_model: torch.nn.Module) -> int:
    from mcore_zoo.numerics.capture import _hf_decoder_layers

    for i, layer in enumerate(_hf_decoder_layers(hf_model)):
        if hasattr(getattr(layer, "mlp", None), "experts"):
            return i
    raise SystemExit("no MoE layer in this model")


def block_inputs(hf_model: torch.nn.Module, layer: int, batches: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """The input of layer ``layer``'s MoE block in transformers' run of each token batch ``[B, S]``."""
    from mcore_zoo.numerics.capture import _hf_decoder_layers

    block = _hf_decoder_layers(hf_model)[layer].mlp
    seen: list[torch.Tensor] = []
    hook = block.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            for tokens in batches:
                hf_model(tokens.to(device), use_cache=False)
    finally:
        hook.remove()
    return seen


def packed_params(lengths: list[int], device: str) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip


def perturb_expert(zoo_model: torch.nn.Module, layer: int, expert: int, scale: float = 1e-2) -> None:
    """Add ``scale`` times the weight's own magnitude to one element per row of expert ``expert``'s
    ``linear_fc1`` in the zoo's block (a change transformers' model does not see)."""
    experts = zoo_model.decoder.layers[layer].mlp.experts
    with torch.no_grad():
        weight = experts.local_experts[expert].linear_fc1.weight
        weight[:, 0] += scale * weight.abs().max()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every form for each experts implementation (``--experts``; default the profile's
    ``moe_experts``): one checkpoint, transformers' model switched between implementations, the
    zoo's model built once per implementation (the knob picks its experts class)."""
    from mcore_zoo.numerics.capture import _hf_decoder_layers
    from mcore_zoo.numerics.profiles import get_profile
    from mcore_zoo.parallel import ensure_model_parallel
    from mcore_zoo.parity.environment import environment
    from mcore_zoo.parity.inputs import make_sequences, parse_set, prepare_model
    from mcore_zoo.parity.reference import load_reference

    ensure_model_parallel()
    dtype = getattr(torch, args.dtype)
    knobs = parse_set(args.knob)
    profile = get_profile(args.numerics)
    profile = profile.with_knobs(**knobs) if knobs else profile
    impls = args.experts or [profile.moe_experts]
    source = prepare_model(config=args.config, random_weights=True, scale=args.scale, settings=parse_set(args.set),
                           dtype=dtype, work_dir=args.out / "work" / args.name, seed=args.seed)  # fmt: skip
    vocab = int(source.config.get("vocab_size") or source.config.get("text_config", {}).get("vocab_size"))
    hf_model = load_reference(source.architecture, source.checkpoint, dtype=dtype, attn_implementation="eager",
                              device=args.device, experts_implementation=impls[0]).eval()  # fmt: skip
    layer = first_moe_layer(hf_model) if args.layer is None else args.layer
    sequences, _ = make_sequences(args.lengths, vocab, mode="random", seed=args.seed)
    count, length = args.batch
    batch_tokens, _ = make_sequences([length] * count, vocab, mode="random", seed=args.seed + 1)
    forms: dict[str, Any] = {}
    names = {}
    for impl in impls:
        hf_model.set_experts_implementation(impl)
        inputs = block_inputs(hf_model, layer, [s[None] for s in sequences] + [torch.stack(batch_tokens)], args.device)
        prefix = f"{impl} " if len(impls) > 1 else ""
        impl_profile = profile if impl == profile.moe_experts else profile.with_knobs(**knobs, moe_experts=impl)
        names[impl] = impl_profile.name
        forms.update(run_forms(args, _hf_decoder_layers(hf_model)[layer].mlp, source, impl_profile, layer, inputs, prefix))
        release()
    env = environment(args.device)
    return {"name": args.name, "architecture": source.architecture.name, "config": str(args.config),
            "settings": parse_set(args.set), "scale": args.scale, "layer": layer, "numerics": names,
            "moe_experts": impls, "dtype": args.dtype, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "versions": env["versions"], "perturbed_expert": args.perturb_expert, "lengths": args.lengths,
            "batch": [count, length], "forms": forms, "all_bitwise": all(f["bitwise"] for f in forms.values())}  # fmt: skip


def run_forms(args: argparse.Namespace, hf_block: torch.nn.Module, source: Any, profile: Any, layer: int,
              inputs: list[torch.Tensor], prefix: str) -> dict[str, Any]:  # fmt: skip
    """The zoo's model built with ``profile``; each form of ``args.forms`` through both blocks.
    ``inputs``: the block's input for each sequence alone, then for the BSHD batch."""
    import mcore_zoo

    zoo_model = mcore_zoo.build_model(str(source.checkpoint), backend="local", numerics=profile,
                                      params_dtype=getattr(torch, args.dtype), load=str(source.checkpoint),
                                      device=args.device).eval()  # fmt: skip
    if args.perturb_expert is not None:
        perturb_expert(zoo_model, layer, args.perturb_expert)
    zoo_layer = zoo_model.decoder.layers[layer]
    num_experts = int(zoo_layer.mlp.config.num_moe_experts)
    seq_inputs, batch_input = inputs[:-1], inputs[-1]
    count, length = args.batch
    forms: dict[str, Any] = {}

    def record(name: str, hf: SideRun, zoo: SideRun, zoo_shapes: list) -> None:
        forms[prefix + name] = form = compare_runs(hf, zoo, zoo_shapes, num_experts)
        print(f"{args.name} {prefix}{name}: {'bitwise' if form['bitwise'] else 'first differing site ' + form['first_differing_site']}",
              file=sys.stderr, flush=True)  # fmt: skip

    if "alone" in args.forms or "thd" in args.forms:
        hf_alone = [run_hf_block(hf_block, x, num_experts) for x in seq_inputs]
        for x, n, hf in zip(seq_inputs, args.lengths, hf_alone):
            if "alone" in args.forms:
                record(f"alone-{n}", hf, run_zoo_block(zoo_layer, x.transpose(0, 1).contiguous()), [(n, 1)])
                release()
        if "thd" in args.forms:
            hf_all = SideRun()
            for hf in hf_alone:
                hf_all.extend(hf)
            pack = torch.cat([x[0] for x in seq_inputs])[:, None]
            zoo = run_zoo_block(zoo_layer, pack, packed_params(args.lengths, args.device))
            calls = len(zoo.of("router")) or 1  # pack_gemms="each": one router call per sequence
            zoo_shapes = [(n, 1) for n in args.lengths] if calls == len(args.lengths) else [(sum(args.lengths), 1)]
            record("thd", hf_all, zoo, zoo_shapes)
            del zoo, hf_all
        del hf_alone
        release()
    if "bshd" in args.forms:
        hf = run_hf_block(hf_block, batch_input, num_experts)
        zoo = run_zoo_block(zoo_layer, batch_input.transpose(0, 1).contiguous())
        record(f"bshd-{count}x{length}", hf, zoo, [(length, count)])
        del hf, zoo
    del zoo_model, zoo_layer
    release()
    return forms


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _gemm_text(sigs: list[dict[str, Any]] | None) -> str:
    if not sigs:
        return "-"
    parts = []
    for s in sigs:
        if "more" in s:
            parts.append(f"+{s['more']} more")
            continue
        i, w = s["input"] or {}, s["weight"] or {}
        parts.append(f"{s['op']} {i.get('shape')}@{i.get('stride')} x {w.get('shape')}@{w.get('stride')} {i.get('dtype')}"
                     + (f" x{s['calls']}" if s["calls"] > 1 else ""))  # fmt: skip
    return "; ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# MoE block sites: {report['name']} ({report['architecture']}, layer {report['layer']})", "",
             f"{report['device_name']}, {report['dtype']}, numerics {', '.join(f'`{n}`' for n in report['numerics'].values())};"
             f" {', '.join(f'{k} {v}' for k, v in report['versions'].items())}."
             + (f" Expert {report['perturbed_expert']} perturbed in the zoo's block." if report["perturbed_expert"] is not None else ""),
             "", "| form | bitwise | first differing site | max abs d at block output |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, form in report["forms"].items():
        lines.append(f"| {name} | {'yes' if form['bitwise'] else 'no'} | {form['first_differing_site'] or '-'}"
                     f" | {_fmt(form['sites']['block.output']['max_abs'])} |")  # fmt: skip
    for name, form in report["forms"].items():
        lines += ["", f"## {name}", "", "| site | max abs d | transformers GEMM calls | zoo GEMM calls | note |", "| --- | --- | --- | --- | --- |"]
        for site in SITES:
            entry = form["sites"].get(site) or {}
            note = ""
            if site == "router.topk_indices" and "tokens" in entry:
                note = f"{entry['tokens_other_experts']} of {entry['tokens']} tokens other experts, {_fmt(entry['tokens_other_order'])} other order"
            elif "first_expert" in entry and entry["first_expert"] is not None:
                note = f"first expert {entry['first_expert']}, {entry['experts_differing']} experts differ"
            elif site == "experts.combine" and "combine_kind" in entry:
                dtypes = f"; dtype transformers {entry['hf']['dtype']}, zoo {entry['zoo']['dtype']}" if "hf" in entry else ""
                note = f"zoo: {entry['combine_kind']}{dtypes}"
            lines.append(f"| {site} | {_fmt(entry.get('max_abs'))} | {_gemm_text(entry.get('hf_gemms'))}"
                         f" | {_gemm_text(entry.get('zoo_gemms'))} | {note} |")  # fmt: skip
        iso = form.get("isolation")
        if iso:
            lines += ["", (f"Isolation of `{form['first_differing_site']}`: {iso['verdict']}."
                           f" Re-run equal: transformers {iso['hf_rerun_equal']}, zoo {iso['zoo_rerun_equal']};"
                           f" inputs equal {iso['inputs_equal']}; zoo call on transformers' input vs transformers:"
                           f" {_fmt(iso.get('zoo_call_on_hf_input_vs_hf'))}; transformers' call on the zoo's input"
                           f" vs the zoo: {_fmt(iso.get('hf_call_on_zoo_input_vs_zoo'))}.")]  # fmt: skip
        differing = [p for p in form["per_expert"] if p["fc1"] or p["fc2"] or p["fc1_input"] or p["rows_hf"] != p["rows_zoo"]]
        if differing:
            lines += ["", "| expert | rows (transformers / zoo) | fc1 input | fc1 | fc2 input | fc2 |", "| --- | --- | --- | --- | --- | --- |"]
            for p in differing[:16]:
                lines.append(f"| {p['expert']} | {p['rows_hf']} / {p['rows_zoo']} | {_fmt(p['fc1_input'])} | {_fmt(p['fc1'])}"
                             f" | {_fmt(p['fc2_input'])} | {_fmt(p['fc2'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_batch(text: str) -> tuple[int, int]:
    count, _, length = text.partition("x")
    return int(count), int(length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a published config.json (random weights)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config fields; repeatable")
    parser.add_argument("--scale", default=None, help="shrink the config first (tiny, small)")
    parser.add_argument("--numerics", default="hf-exact")
    parser.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE", help="profile knobs; repeatable")
    parser.add_argument("--layer", type=int, default=None, help="the decoder layer (default: the first MoE layer)")
    parser.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[512, 300, 100, 37])
    parser.add_argument("--batch", type=parse_batch, default=(4, 512), help="the BSHD batch, BxL")
    parser.add_argument("--forms", type=lambda s: s.split(","), default=["alone", "thd", "bshd"])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=lambda s: s.split(","), default=None,
                        help="transformers' experts implementations to run, e.g. grouped_mm,eager (default: the knob's)")
    parser.add_argument("--perturb-expert", type=int, default=None, help="perturb this expert's fc1 in the zoo's block")
    parser.add_argument("--keep-work", action="store_true", help="keep the random-weight checkpoint under OUT/work")
    parser.add_argument("--name", default=None, help="the report's file name (default: the config's)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    args.name = args.name or Path(args.config).stem
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        report = run(args)
    finally:  # the random-weight checkpoint (GBs at full width)
        if not args.keep_work:
            shutil.rmtree(args.out / "work" / args.name, ignore_errors=True)
            with contextlib.suppress(OSError):  # the folder, when no other report's checkpoint is in it
                (args.out / "work").rmdir()
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{args.name}.md").write_text(markdown(report))
    return 0 if report["all_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
