"""The package version, alone in a leaf module: every module that records it imports it from here,
so that the package's `__init__` (the public API, docs/api.md) can stand above all of them."""

__version__ = "0.1.0"
