"""mlxcel command-line interface (thin: parse, call mlxcel_core, print)."""

from mlxcel_core import __version__

__all__ = ["__version__"]
