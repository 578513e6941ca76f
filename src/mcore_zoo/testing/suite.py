"""``ConformanceSuite``: the pytest test class a plugin's own tests subclass (one line)::

    # tests/test_conformance.py of the plugin's repository
    from mcore_zoo.testing import ConformanceSuite

    class TestConformance(ConformanceSuite):
        plugin = "phi3"  # the entry-point name under [project.entry-points.mcore_zoo]

The subclass collects, for every architecture the plugin registers (and every variant of its
example config the class lists), one test per contract: ``test_registration`` (per plugin),
``test_config``, ``test_build``, ``test_weight_map``, ``test_parity``, ``test_thd``,
``test_bad_input`` (per example config), and ``test_tensor_parallel``, ``test_expert_parallel``,
``test_gradients`` (multi-process launches shared by all of them). Everything
runs on the CPU in fp32 against the transformers model; a failure names the contract and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping, Optional, Sequence, Union

import pytest

from .contracts import ContractError, contract

#: test function -> contract name
TEST_CONTRACTS = {
    "test_registration": "registration",
    "test_config": "config",
    "test_build": "build",
    "test_weight_map": "weight-map",
    "test_parity": "parity",
    "test_thd": "thd",
    "test_bad_input": "bad-input",
    "test_tensor_parallel": "tensor-parallel",
    "test_expert_parallel": "expert-parallel",
    "test_gradients": "gradients",
}


@dataclass(frozen=True)
class Case:
    """One example config under test: an architecture's ``example_config``, or a named variant
    (the example config with ``overrides``)."""

    plugin: str
    architecture: str
    variant: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        return self.architecture if self.variant is None else f"{self.architecture}-{self.variant}"

    @property
    def subject(self) -> str:
        what = "example config" if self.variant is None else f"example config variant {self.variant!r}"
        return f"{self.architecture} ({what})"


@dataclass
class _Run:
    """One layout of a multi-process contract: the example configs it launches, as ``(case,
    architecture, checkpoint)``."""

    where: str  # "TP=2" or "EP=2"
    tp: int
    ep: int
    runnable: list = field(default_factory=list)


@dataclass
class _Plan:
    """A multi-process contract prepared for its launches: one :class:`_Run` per layout, the
    contract errors met while preparing the example configs, and the layouts refused by name
    (``"<subject>: <reason>"``, in case order)."""

    contract: str
    runs: list[_Run]
    errors: list[ContractError] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


#: the contracts whose checks run on launched ranks
MULTI_PROCESS_CONTRACTS = ("tensor-parallel", "expert-parallel", "gradients")


class _State:
    """What one suite class shares between its tests: the registry, reference checkpoints, the
    plans of the multi-process contracts and their launches (one per world size, for the
    contracts the session selected: ``contracts``)."""

    def __init__(self, suite: type, tmp_path_factory: pytest.TempPathFactory, contracts: Sequence[str] = ()) -> None:
        from ..registry import get_registry
        from .common import ReferenceCheckpoints

        self.suite = suite
        self.registry = get_registry()
        self.refs = ReferenceCheckpoints(lambda name: tmp_path_factory.mktemp(name))
        self.contracts = list(contracts)
        self._plans: dict[str, _Plan] = {}
        self._launched: dict[int, list | BaseException] = {}

    def plan(self, name: str) -> _Plan:
        """The plan of multi-process contract ``name`` (made once)."""
        if name not in self._plans:
            self._plans[name] = _PLANNERS[name](self)
        return self._plans[name]

    def ranks(self, name: str, run: _Run) -> list[dict[str, dict]]:
        """Every rank's results of ``run`` of contract ``name``: one launch per world size runs
        the runs of that size of every contract in ``contracts`` (and ``name``), the first time
        one of them is asked for; a failed launch raises for each of its runs."""
        from .checks import run_contracts

        world = run.tp * run.ep
        if world not in self._launched:
            names = [n for n in MULTI_PROCESS_CONTRACTS if n in self.contracts or n == name]
            jobs = [(n, r) for n in names for r in self.plan(n).runs if r.runnable and r.tp * r.ep == world]
            try:
                results = run_contracts([(n, [(c.subject, a.name, ckpt) for c, a, ckpt in r.runnable], r.tp, r.ep)
                                         for n, r in jobs], world)  # fmt: skip
                self._launched[world] = [(n, r, ranks) for (n, r), ranks in zip(jobs, results)]
            except Exception as exc:  # noqa: BLE001 - reported by each contract the launch ran
                self._launched[world] = exc
        launched = self._launched[world]
        if isinstance(launched, BaseException):
            raise launched
        for n, r, ranks in launched:
            if n == name and r is run:
                return ranks
        raise RuntimeError(f"{name} ({run.where}) was not part of the launch of {world} ranks")

    def architecture(self, case: Case) -> Any:
        with contract("registration", f"{case.architecture} (plugin {case.plugin!r})"):
            provider = self.registry.get(case.architecture)
        if provider.plugin != case.plugin:
            raise ContractError("registration", case.subject, f"the architecture is provided by {provider.origin},"
                                f" not by plugin {case.plugin!r}")  # fmt: skip
        return provider

    def config(self, case: Case) -> dict:
        config = self.architecture(case).example_config()
        config.update(case.overrides)
        return config

    def checkpoint(self, case: Case, contract_name: str) -> Any:
        architecture = self.architecture(case)
        with contract(contract_name, case.subject, fix="the transformers reference model could not be built and"
                      " saved at this example config: fix the config (or hf_model_class) so that"
                      " `<HF class>(config).save_pretrained(dir)` works."):  # fmt: skip
            return self.refs(architecture, self.config(case))


class ConformanceSuite:
    """Base class of a plugin's conformance tests (see module docstring).

    Class attributes:
        plugin: the entry-point name(s) of the plugin(s) under test.
        architectures: restrict to these architectures (default: all the plugins register).
        variants: ``{architecture: {variant id: overrides of the example config}}``: more example
            configs to run every per-config contract on (tied embeddings, biases, windows ...).
        rejected: ``{architecture: {probe id: overrides}}``: config values the plugin must refuse
            with a ``ConfigError`` (bad-input contract), in addition to dynamic-NTK RoPE scaling
            (turn that probe off with ``probe_dynamic_rope = False`` if the plugin implements it).
        tensor_parallel: the TP size of the multi-process contract (gloo ranks).
        expert_parallel: the EP size of the MoE multi-process contract (gloo ranks).
    """

    plugin: ClassVar[Union[str, Sequence[str]]] = ()
    architectures: ClassVar[Optional[Sequence[str]]] = None
    variants: ClassVar[Mapping[str, Mapping[str, Mapping[str, Any]]]] = {}
    rejected: ClassVar[Mapping[str, Mapping[str, Mapping[str, Any]]]] = {}
    probe_dynamic_rope: ClassVar[bool] = True
    tensor_parallel: ClassVar[int] = 2
    expert_parallel: ClassVar[int] = 2

    # ------------------------------------------------------------------ collection
    @classmethod
    def zoo_plugins(cls) -> list[str]:
        return [cls.plugin] if isinstance(cls.plugin, str) else list(cls.plugin)

    @classmethod
    def zoo_cases(cls) -> list[Case]:
        """Every example config under test (the registry is read at collection time)."""
        cached = cls.__dict__.get("_zoo_cases")
        if cached is not None:
            return cached
        from ..registry import get_registry

        registry = get_registry()
        cases = []
        for plugin in cls.zoo_plugins():
            for record in registry.plugins.values():
                if record.name != plugin or record.status != "loaded":
                    continue
                for arch in record.architectures:
                    if cls.architectures is not None and arch not in cls.architectures:
                        continue
                    cases.append(Case(plugin, arch))
                    for variant, overrides in cls.variants.get(arch, {}).items():
                        cases.append(Case(plugin, arch, variant, dict(overrides)))
        cls._zoo_cases = cases
        return cases

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "zoo_plugin" in metafunc.fixturenames:
            plugins = self.zoo_plugins()
            metafunc.parametrize("zoo_plugin", plugins, ids=plugins)
        if "zoo_case" in metafunc.fixturenames:
            cases = self.zoo_cases()
            if cases:
                metafunc.parametrize("zoo_case", cases, ids=[c.id for c in cases])
            else:
                reason = f"no architecture of plugin(s) {self.zoo_plugins()} loaded: see test_registration"
                metafunc.parametrize("zoo_case", [pytest.param(None, marks=pytest.mark.skip(reason=reason))], ids=["none"])

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def zoo_suite(cls, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[_State]:
        import torch

        if torch.cuda.is_available():
            pytest.fail("the conformance suite compares CPU fp32 results bit for bit and runs its ranks on gloo;"
                        " run it with CUDA hidden: CUDA_VISIBLE_DEVICES= pytest", pytrace=False)  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_HUB_OFFLINE", "1")
            patch.setenv("TOKENIZERS_PARALLELISM", "false")
            from ..parallel import ensure_model_parallel

            ensure_model_parallel()
            selected = {getattr(item, "originalname", item.name) for item in request.session.items
                        if getattr(item, "cls", None) is cls}  # fmt: skip
            yield _State(cls, tmp_path_factory, [TEST_CONTRACTS[t] for t in selected if t in TEST_CONTRACTS])

    @pytest.fixture(autouse=True)
    def _zoo_record_contract(self, request: pytest.FixtureRequest) -> None:
        """Tag the report with its contract and case (the pytest plugin's summary reads them)."""
        name = request.node.originalname if hasattr(request.node, "originalname") else request.node.name
        if name in TEST_CONTRACTS:
            request.node.user_properties.append(("mcore_zoo_contract", TEST_CONTRACTS[name]))
            callspec = getattr(request.node, "callspec", None)
            if callspec is not None and "zoo_case" in callspec.params and callspec.params["zoo_case"] is not None:
                request.node.user_properties.append(("mcore_zoo_subject", callspec.params["zoo_case"].id))
            elif callspec is not None and "zoo_plugin" in callspec.params:
                request.node.user_properties.append(("mcore_zoo_subject", f"plugin {callspec.params['zoo_plugin']}"))
            else:
                request.node.user_properties.append(("mcore_zoo_subject", type(self).__name__))

    # ------------------------------------------------------------------ contracts
    def test_registration(self, zoo_suite: _State, zoo_plugin: str) -> None:
        from .checks import check_registration

        archs = check_registration(zoo_suite.registry, zoo_plugin)
        for attr in ("variants", "rejected"):
            unknown = sorted(set(getattr(self, attr)) - {a for p in self.zoo_plugins() for a in _archs(zoo_suite, p)})
            if unknown:
                raise ContractError("registration", f"plugin {zoo_plugin!r}", f"{type(self).__name__}.{attr} names"
                                    f" architectures no plugin of the suite registers: {unknown}",
                                    f"use architecture names the plugin registers: {archs}")  # fmt: skip

    def test_config(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_config

        check_config(zoo_suite.architecture(zoo_case), zoo_suite.config(zoo_case), zoo_case.subject)

    def test_build(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_build

        check_build(zoo_suite.architecture(zoo_case), zoo_suite.config(zoo_case), zoo_case.subject)

    def test_weight_map(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_weight_map

        checkpoint = zoo_suite.checkpoint(zoo_case, "weight-map")
        check_weight_map(zoo_suite.architecture(zoo_case), checkpoint, zoo_case.subject)

    def test_parity(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_parity

        checkpoint = zoo_suite.checkpoint(zoo_case, "parity")
        check_parity(zoo_suite.architecture(zoo_case), checkpoint, zoo_case.subject)

    def test_thd(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_thd

        checkpoint = zoo_suite.checkpoint(zoo_case, "thd")
        check_thd(zoo_suite.architecture(zoo_case), checkpoint, zoo_case.subject)

    def test_bad_input(self, zoo_suite: _State, zoo_case: Case) -> None:
        from .checks import check_bad_input, default_rejected

        config = zoo_suite.config(zoo_case)
        probes = dict(default_rejected(config)) if self.probe_dynamic_rope else {}
        probes.update(self.rejected.get(zoo_case.architecture, {}))
        checkpoint = zoo_suite.checkpoint(zoo_case, "bad-input")
        check_bad_input(zoo_suite.architecture(zoo_case), config, checkpoint, zoo_case.subject, probes)

    def test_tensor_parallel(self, zoo_suite: _State, request: pytest.FixtureRequest) -> None:
        """``tensor_parallel`` gloo ranks check every example config (those whose model refuses the
        layout by name are left out, reported with the reason), in the launch the suite's
        multi-process contracts of that many ranks share."""
        from .checks import check_tensor_parallel

        if not self.zoo_cases():
            pytest.skip(f"no architecture of plugin(s) {self.zoo_plugins()} loaded: see test_registration")
        plan = _recorded(request, zoo_suite.plan("tensor-parallel"))
        (run,) = plan.runs
        errors = plan.errors + _check_run(zoo_suite, plan, run, f"{type(self).__name__} ({run.where} launch)",
                                          lambda arch, ckpt, subject, ranks: check_tensor_parallel(arch, ckpt, subject, ranks, run.tp))  # fmt: skip
        _raise_collected("tensor-parallel", errors)
        _skip_if_all_refused(request, run.runnable)

    def test_expert_parallel(self, zoo_suite: _State, request: pytest.FixtureRequest) -> None:
        """``expert_parallel`` gloo ranks check every MoE example config (in the shared launch of
        that many ranks)."""
        from .checks import check_tensor_parallel

        plan = _recorded(request, zoo_suite.plan("expert-parallel"))
        (run,) = plan.runs
        if not run.runnable and not plan.errors:
            _skip_if_all_refused(request, run.runnable)
            pytest.skip("no MoE architecture among the example configs")
        errors = plan.errors + _check_run(zoo_suite, plan, run, f"{type(self).__name__} ({run.where} launch)",
                                          lambda arch, ckpt, subject, ranks: check_tensor_parallel(
                                              arch, ckpt, subject, ranks, 1, name="expert-parallel"))  # fmt: skip
        _raise_collected("expert-parallel", errors)

    def test_gradients(self, zoo_suite: _State, request: pytest.FixtureRequest) -> None:
        """Every example config at TP ``tensor_parallel``, the MoE ones also at EP
        ``expert_parallel`` (in the shared launches of those many ranks): train_step gradients
        against one process's (contract ``gradients``)."""
        from .checks import check_gradients

        if not self.zoo_cases():
            pytest.skip(f"no architecture of plugin(s) {self.zoo_plugins()} loaded: see test_registration")
        plan = _recorded(request, zoo_suite.plan("gradients"))
        errors = list(plan.errors)
        for run in plan.runs:
            errors += _check_run(zoo_suite, plan, run, f"{type(self).__name__} ({run.where} launch)",
                                 lambda arch, ckpt, subject, ranks, w=run.where: check_gradients(arch, ckpt, subject, ranks, w))  # fmt: skip
        _raise_collected("gradients", errors)
        _skip_if_all_refused(request, [case for run in plan.runs for case in run.runnable])


def _plan_tensor_parallel(state: _State) -> _Plan:
    """Every example config at TP ``tensor_parallel`` but those whose model refuses it by name."""
    from ..placement import Parallelism

    tp = state.suite.tensor_parallel
    return _plan_one_layout(state, "tensor-parallel", _Run(f"TP={tp}", tp, 1), Parallelism(tp=tp))


def _plan_expert_parallel(state: _State) -> _Plan:
    """Every MoE example config at EP ``expert_parallel`` but those whose model refuses it by name."""
    from ..placement import Parallelism

    ep = state.suite.expert_parallel
    return _plan_one_layout(state, "expert-parallel", _Run(f"EP={ep}", 1, ep), Parallelism(ep=ep), moe_only=True)


def _plan_one_layout(state: _State, name: str, run: _Run, layout: Any, moe_only: bool = False) -> _Plan:
    """The plan of contract ``name``: one ``run`` at ``layout`` (a ``Parallelism``) of every example
    config (``moe_only``: the MoE ones), but those whose model refuses the layout by name."""
    plan = _Plan(name, [run])
    for case in state.suite.zoo_cases():
        try:
            architecture = state.architecture(case)
            with contract(name, f"{case.subject}, {run.where}"):
                arch = architecture.config_from_hf(state.config(case))
                skipped = moe_only and arch.moe is None
                reason = None if skipped else _refusal(arch, layout)
            if skipped:
                continue
            if reason:
                plan.refused.append(f"{case.subject}: {reason}")
                continue
            run.runnable.append((case, architecture, state.checkpoint(case, name)))
        except ContractError as exc:
            plan.errors.append(exc)
    return plan


def _plan_gradients(state: _State) -> _Plan:
    """Every example config at TP ``tensor_parallel`` (sequence parallelism for MoE models), the
    MoE ones also at EP ``expert_parallel``, but those whose model refuses a layout by name."""
    from ..placement import Parallelism

    tp, ep = state.suite.tensor_parallel, state.suite.expert_parallel
    with_tp_run, with_ep_run = _Run(f"TP={tp}", tp, 1), _Run(f"EP={ep}", 1, ep)
    plan = _Plan("gradients", [with_tp_run, with_ep_run])
    for case in state.suite.zoo_cases():
        try:
            architecture = state.architecture(case)
            with contract("gradients", case.subject):
                arch = architecture.config_from_hf(state.config(case))
                tp_reason = _refusal(arch, Parallelism(tp=tp, sequence_parallel=arch.moe is not None))
                ep_reason = None if arch.moe is None else _refusal(arch, Parallelism(ep=ep))
            plan.refused += [f"{case.subject}: {reason}" for reason in (tp_reason, ep_reason) if reason]
            with_tp, with_ep = tp_reason is None, arch.moe is not None and ep_reason is None
            if not (with_tp or with_ep):
                continue
            checkpoint = state.checkpoint(case, "gradients")
            if with_tp:
                with_tp_run.runnable.append((case, architecture, checkpoint))
            if with_ep:
                with_ep_run.runnable.append((case, architecture, checkpoint))
        except ContractError as exc:
            plan.errors.append(exc)
    return plan


_PLANNERS: dict[str, Callable[[_State], _Plan]] = {
    "tensor-parallel": _plan_tensor_parallel,
    "expert-parallel": _plan_expert_parallel,
    "gradients": _plan_gradients,
}


def _refusal(arch: Any, parallel: Any) -> str | None:
    """Why the model of ``arch`` refuses ``parallel`` by name (``UnsupportedLayoutError``: a layer
    not built for it yet), in one line; None when it takes it. Any other layout problem raises."""
    from ..config.transformer import default_expert_tp, validate_layout
    from ..errors import UnsupportedLayoutError

    try:
        validate_layout(arch, default_expert_tp(arch, parallel))
    except UnsupportedLayoutError as exc:
        return " ".join(str(exc).split())  # one line for the summary
    return None


def _recorded(request: pytest.FixtureRequest, plan: _Plan) -> _Plan:
    """``plan``, its refusals kept on the test's report (the conformance summary lists them): the
    example configs left out of the launch, each with the reason."""
    request.node.user_properties += [("mcore_zoo_refused", refused) for refused in plan.refused]
    return plan


def _skip_if_all_refused(request: pytest.FixtureRequest, runnable: list[Any]) -> None:
    """Skip a multi-process contract none of whose example configs ran because each model refused
    the layout by name, with the reasons."""
    refused = [v for k, v in request.node.user_properties if k == "mcore_zoo_refused"]
    if refused and not runnable:
        pytest.skip("every example config's model refuses this layout by name:\n" + "\n".join(refused))


def _check_run(state: _State, plan: _Plan, run: _Run, launch_subject: str, check: Callable[..., None]) -> list[ContractError]:
    """``check(architecture, checkpoint, subject, ranks)`` for each example config of ``run`` of
    ``plan``, on the ranks' results of its launch (a failed launch breaks contract
    ``plan.contract`` for all of them); returns the contract errors of the cases."""
    if not run.runnable:
        return []
    with contract(plan.contract, launch_subject):
        ranks = state.ranks(plan.contract, run)
    errors = []
    for case, architecture, checkpoint in run.runnable:
        try:
            check(architecture, checkpoint, case.subject, ranks)
        except ContractError as exc:
            errors.append(exc)
    return errors


def _raise_collected(name: str, errors: list[ContractError]) -> None:
    """Raise the broken contracts of one launch's example configs: the one error as it is, several
    as one ``name`` error listing each."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ContractError(name, f"{len(errors)} example configs",
                            "\n\n".join(f"[{e.contract}] {e.subject}:\n{e.problem}" for e in errors))  # fmt: skip


def _archs(state: _State, plugin: str) -> list[str]:
    return [a for r in state.registry.plugins.values() if r.name == plugin for a in r.architectures]
