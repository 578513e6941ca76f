"""mcore-zoo plugin for Phi-3 (``Phi3ForCausalLM``): an out-of-tree architecture, installed with pip
and discovered through the ``mcore_zoo`` entry-point group."""

__version__ = "0.1.0"
