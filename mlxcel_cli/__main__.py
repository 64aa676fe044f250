"""`python -m mlxcel_cli ...` runs the `mlxcel` command (where the console script is not installed: a tree on
PYTHONPATH), with its exit status."""

from .main import main

raise SystemExit(main())
