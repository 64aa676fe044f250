"""mlxcel command-line interface (thin: parse, call mlxcel_core, print)."""

from importlib import import_module

# mlxcel_core's __init__ is lazy: this reads the version without importing mlx.
__version__ = import_module("mlxcel_core").__version__

__all__ = ["__version__"]
