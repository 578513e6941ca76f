"""The package version (a module of its own, so that modules inside the package can read it
without importing the package's public namespace)."""

__version__ = "0.1.0"
