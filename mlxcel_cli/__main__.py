"""`python -m mlxcel_cli ...` runs the `mlxcel` command (where the console script is not installed: a tree on
PYTHONPATH)."""

from .main import main

main()
