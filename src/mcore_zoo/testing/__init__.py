"""mcore-zoo's conformance suite and test helpers, for plugin authors and the zoo's own tests.

A plugin package enables the whole suite with one class in its tests::

    from mcore_zoo.testing import ConformanceSuite

    class TestConformance(ConformanceSuite):
        plugin = "phi3"   # the plugin's entry-point name

For each architecture the plugin registers it checks, on the CPU in fp32: config field coverage
of the example config(s), the weight map's bitwise round trip and coverage, bitwise parity with the
transformers model, THD packing, a tensor-parallel run on two gloo ranks, and fail-closed behaviour
on bad input (see :data:`CONTRACTS`). A failure names the broken contract and how to fix it.

mcore-zoo also registers :mod:`mcore_zoo.testing.plugin` as a pytest plugin (``pytest11`` entry
point): a report header with the versions under test, short contract-failure reports, a contract
summary, and fixtures for a plugin's own extra tests (``zoo_mpu``, ``zoo_reference_checkpoint``,
``zoo_hf_reference``). Importing this package is cheap; torch and Megatron-Core load when a check runs.
"""

from __future__ import annotations


from .._lazy import lazy_attributes

_LAZY = {
    "ConformanceSuite": "mcore_zoo.testing.suite:ConformanceSuite",
    "Case": "mcore_zoo.testing.suite:Case",
    "CONTRACTS": "mcore_zoo.testing.contracts:CONTRACTS",
    "Contract": "mcore_zoo.testing.contracts:Contract",
    "ContractError": "mcore_zoo.testing.contracts:ContractError",
    "REL_TOL": "mcore_zoo.testing.common:REL_TOL",
    "TP_REL_TOL": "mcore_zoo.testing.common:TP_REL_TOL",
    "LAYOUT_ULPS": "mcore_zoo.testing.common:LAYOUT_ULPS",
    "layout_bound": "mcore_zoo.testing.common:layout_bound",
    "layout_ulps": "mcore_zoo.testing.common:layout_ulps",
    "at_rank_threads": "mcore_zoo.testing.common:at_rank_threads",
    "LINEAR_ATTENTION_LAYOUT_ULPS": "mcore_zoo.testing.common:LINEAR_ATTENTION_LAYOUT_ULPS",
    "LINEAR_ATTENTION_MOE_LAYOUT_ULPS": "mcore_zoo.testing.common:LINEAR_ATTENTION_MOE_LAYOUT_ULPS",
    "PARITY_LENGTHS": "mcore_zoo.testing.common:PARITY_LENGTHS",
    "assert_same": "mcore_zoo.testing.common:assert_same",
    "random_sequences": "mcore_zoo.testing.common:random_sequences",
    "case_config": "mcore_zoo.testing.common:case_config",
    "ReferenceCheckpoints": "mcore_zoo.testing.common:ReferenceCheckpoints",
    "scale_is_power_of_two": "mcore_zoo.testing.common:scale_is_power_of_two",
    "load_safetensors_dir": "mcore_zoo.testing.common:load_safetensors_dir",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
