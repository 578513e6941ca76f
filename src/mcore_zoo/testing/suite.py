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


class _State:
    """What one suite class shares between its tests: the registry, reference checkpoints, the TP
    launch."""

    def __init__(self, suite: type, tmp_path_factory: pytest.TempPathFactory) -> None:
        from ..registry import get_registry
        from .common import ReferenceCheckpoints

        self.suite = suite
        self.registry = get_registry()
        self.refs = ReferenceCheckpoints(lambda name: tmp_path_factory.mktemp(name))

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
    def zoo_suite(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_State]:
        import torch

        if torch.cuda.is_available():
            pytest.fail("the conformance suite compares CPU fp32 results bit for bit and runs its ranks on gloo;"
                        " run it with CUDA hidden: CUDA_VISIBLE_DEVICES= pytest", pytrace=False)  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HF_HUB_OFFLINE", "1")
            patch.setenv("TOKENIZERS_PARALLELISM", "false")
            from ..parallel import ensure_model_parallel

            ensure_model_parallel()
            yield _State(cls, tmp_path_factory)

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
        """One launch of ``tensor_parallel`` gloo ranks checks every example config (those whose
        model refuses the layout by name are left out, reported with the reason)."""
        from ..placement import Parallelism
        from .checks import check_tensor_parallel, run_tensor_parallel

        cases = self.zoo_cases()
        if not cases:
            pytest.skip(f"no architecture of plugin(s) {self.zoo_plugins()} loaded: see test_registration")
        tp = self.tensor_parallel
        errors: list[ContractError] = []
        runnable = []
        for case in cases:
            try:
                architecture = zoo_suite.architecture(case)
                with contract("tensor-parallel", f"{case.subject}, TP={tp}"):
                    if _refused(request, case, architecture.config_from_hf(zoo_suite.config(case)), Parallelism(tp=tp)):
                        continue
                runnable.append((case, architecture, zoo_suite.checkpoint(case, "tensor-parallel")))
            except ContractError as exc:
                errors.append(exc)
        errors += _launch_and_check("tensor-parallel", f"{type(self).__name__} (TP={tp} launch)", runnable,
                                    lambda cases: run_tensor_parallel(cases, tp),
                                    lambda arch, ckpt, subject, ranks: check_tensor_parallel(arch, ckpt, subject, ranks, tp))  # fmt: skip
        _raise_collected("tensor-parallel", errors)
        _skip_if_all_refused(request, runnable)


    def test_expert_parallel(self, zoo_suite: _State, request: pytest.FixtureRequest) -> None:
        """One launch of ``expert_parallel`` gloo ranks checks every MoE example config."""
        from ..placement import Parallelism
        from .checks import check_tensor_parallel, run_tensor_parallel

        ep = self.expert_parallel
        errors: list[ContractError] = []
        runnable = []
        for case in self.zoo_cases():
            try:
                architecture = zoo_suite.architecture(case)
                with contract("expert-parallel", f"{case.subject}, EP={ep}"):
                    arch = architecture.config_from_hf(zoo_suite.config(case))
                    if arch.moe is None or _refused(request, case, arch, Parallelism(ep=ep)):
                        continue
                runnable.append((case, architecture, zoo_suite.checkpoint(case, "expert-parallel")))
            except ContractError as exc:
                errors.append(exc)
        if not runnable and not errors:
            _skip_if_all_refused(request, runnable)
            pytest.skip("no MoE architecture among the example configs")
        errors += _launch_and_check("expert-parallel", f"{type(self).__name__} (EP={ep} launch)", runnable,
                                    lambda cases: run_tensor_parallel(cases, 1, ep),
                                    lambda arch, ckpt, subject, ranks: check_tensor_parallel(
                                        arch, ckpt, subject, ranks, 1, name="expert-parallel"))  # fmt: skip
        _raise_collected("expert-parallel", errors)


    def test_gradients(self, zoo_suite: _State, request: pytest.FixtureRequest) -> None:
        """One TP launch for every example config, one EP launch for the MoE ones: train_step
        gradients against one process's (contract ``gradients``)."""
        from ..placement import Parallelism
        from .checks import check_gradients, run_gradients

        cases = self.zoo_cases()
        if not cases:
            pytest.skip(f"no architecture of plugin(s) {self.zoo_plugins()} loaded: see test_registration")
        tp, ep = self.tensor_parallel, self.expert_parallel
        errors: list[ContractError] = []
        runs: dict[tuple[int, int], list[Any]] = {(tp, 1): [], (1, ep): []}
        for case in cases:
            try:
                architecture = zoo_suite.architecture(case)
                with contract("gradients", case.subject):
                    arch = architecture.config_from_hf(zoo_suite.config(case))
                    with_tp = not _refused(request, case, arch, Parallelism(tp=tp, sequence_parallel=arch.moe is not None))
                    with_ep = arch.moe is not None and not _refused(request, case, arch, Parallelism(ep=ep))
                if not (with_tp or with_ep):
                    continue
                checkpoint = zoo_suite.checkpoint(case, "gradients")
                if with_tp:
                    runs[(tp, 1)].append((case, architecture, checkpoint))
                if with_ep:
                    runs[(1, ep)].append((case, architecture, checkpoint))
            except ContractError as exc:
                errors.append(exc)
        for (run_tp, run_ep), runnable in runs.items():
            where = f"TP={run_tp}" if run_ep == 1 else f"EP={run_ep}"
            errors += _launch_and_check("gradients", f"{type(self).__name__} ({where} launch)", runnable,
                                        lambda cases, t=run_tp, e=run_ep: run_gradients(cases, t, e),
                                        lambda arch, ckpt, subject, ranks, w=where: check_gradients(arch, ckpt, subject, ranks, w))  # fmt: skip
        _raise_collected("gradients", errors)
        _skip_if_all_refused(request, [run for runnable in runs.values() for run in runnable])


def _refused(request: pytest.FixtureRequest, case: Case, arch: Any, parallel: Any) -> bool:
    """Whether the model of ``case`` refuses ``parallel`` by name (``UnsupportedLayoutError``: a
    layer not built for it yet). The case is then left out of the launch, the reason kept on the
    test's report (the conformance summary lists it). Any other layout problem raises."""
    from ..config.transformer import default_expert_tp, validate_layout
    from ..errors import UnsupportedLayoutError

    try:
        validate_layout(arch, default_expert_tp(arch, parallel))
    except UnsupportedLayoutError as exc:
        reason = " ".join(str(exc).split())  # one line for the summary
        request.node.user_properties.append(("mcore_zoo_refused", f"{case.subject}: {reason}"))
        return True
    return False


def _skip_if_all_refused(request: pytest.FixtureRequest, runnable: list[Any]) -> None:
    """Skip a multi-process contract none of whose example configs ran because each model refused
    the layout by name, with the reasons."""
    refused = [v for k, v in request.node.user_properties if k == "mcore_zoo_refused"]
    if refused and not runnable:
        pytest.skip("every example config's model refuses this layout by name:\n" + "\n".join(refused))


def _launch_and_check(name: str, launch_subject: str, runnable: list[Any], launch: Callable[[list[Any]], Any],
                      check: Callable[..., None]) -> list[ContractError]:  # fmt: skip
    """One gloo launch for the ``(case, architecture, checkpoint)`` triples of ``runnable`` (a
    failed launch breaks contract ``name`` for all of them), then ``check(architecture,
    checkpoint, subject, ranks)`` per case; returns the contract errors of the cases."""
    if not runnable:
        return []
    with contract(name, launch_subject):
        ranks = launch([(c.subject, a.name, ckpt) for c, a, ckpt in runnable])
    errors = []
    for case, architecture, checkpoint in runnable:
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
