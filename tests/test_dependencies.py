"""Every third-party module the shipped packages import is a declared runtime dependency.

CI installs the test extra too (numpy, torch, ...), so an import of a test-only package from mlxcel_core would
pass every test and still break `pip install . && mlxcel generate` on a fresh machine."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI runs 3.11)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("mlxcel_cli", "mlxcel_core", "autotune")


def _imported_top_level_modules() -> dict[str, str]:
    found = {}
    for package in SHIPPED:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_third_party_imports_are_declared_dependencies():
    declared = {
        _normalize(re.split(r"[\[<>=!;~ ]", spec, maxsplit=1)[0])
        for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    distributions = packages_distributions()
    missing = []
    for module, where in sorted(_imported_top_level_modules().items()):
        if module in sys.stdlib_module_names or module in SHIPPED or module == "__future__":
            continue
        owners = {_normalize(d) for d in distributions.get(module, [module])}
        if not owners & declared:
            missing.append(f"{module} (imported by {where}; distribution {', '.join(sorted(owners))})")
    assert not missing, "not declared in [project].dependencies: " + "; ".join(missing)
