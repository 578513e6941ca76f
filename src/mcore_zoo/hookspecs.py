"""The hooks a mcore-zoo plugin implements.

A plugin is a Python module (or object) registered under the entry-point group ``mcore_zoo``::

    # pyproject.toml of the plugin's distribution
    [project.entry-points.mcore_zoo]
    phi3 = "mcore_zoo_phi3.plugin"

and implementing hooks marked with :data:`hookimpl`::

    from mcore_zoo import ModelEntry, hookimpl

    @hookimpl
    def mcore_zoo_architectures():
        return [ModelEntry(architecture="Phi3ForCausalLM", ...)]

Unknown hook names are rejected when the plugin is loaded (a misspelt hook is an error, not a
silent no-op). Implementations may accept a subset of a hook's arguments, as in pluggy.

Hook list (version = the mcore-zoo version that added it):

=========================  ==============  =============================================
hook                       calling         added
=========================  ==============  =============================================
mcore_zoo_architectures    collected       0.1 - the architectures the plugin owns
mcore_zoo_extensions       collected       0.2 - changes to architectures others own
=========================  ==============  =============================================

A plugin implements at least one of them. The registry calls each hook through the plugin manager,
plugin by plugin (``PluginManager.subset_hook_caller``), so a plugin whose hook raises is recorded
as failed without taking the others down, and every result is attributed to its plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from .entry import Extension, ModelEntry

PROJECT_NAME = "mcore_zoo"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def mcore_zoo_architectures() -> "list[ModelEntry]":
    """Return the :class:`~mcore_zoo.ModelEntry` objects this plugin provides.

    Called once per plugin when the registry loads (all plugins are called: a *collected* hook,
    not firstresult). Must be cheap and must not import Megatron-Core, Transformer Engine or
    torch-heavy modules: entries name their callables as ``"module:attr"`` strings that the zoo
    resolves only when an architecture is used.

    Two plugins returning the same ``architecture`` is an error at lookup, naming both plugins and
    their distributions, unless exactly one entry sets ``override=True``.

    Added in 0.1.
    """


@hookspec
def mcore_zoo_extensions() -> "list[Extension]":
    """Return :class:`~mcore_zoo.entry.Extension` objects: changes to architectures that another
    plugin provides - one contribution replaced (converter, weight rules, layer spec, forward) or
    the owner's config conversion / weight map amended.

    Collected like :func:`mcore_zoo_architectures` and under the same rules (cheap, lazy
    references). Two plugins replacing the same contribution of one architecture is an error at
    lookup naming both; amendments compose (applied in plugin-name order). An extension for an
    architecture nobody provides is reported by ``mcore-zoo plugins``.

    Added in 0.2.
    """
