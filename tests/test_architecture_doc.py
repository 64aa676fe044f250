"""docs/architecture.md names every product module by its repository path, and every .py path it names exists.

Product modules are the .py files of the shipped packages (mlxcel_core, mlxcel_cli, autotune); an `__init__.py` that
holds no code (a docstring at most) may go unnamed. Reads files only: no MLX, no imports of the packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("mlxcel_core", "mlxcel_cli", "autotune")

# A .py path as the doc writes it: slash-separated names, not part of a longer path or word.
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w/])")


def named_paths() -> set[str]:
    return set(PY_PATH.findall(DOC.read_text()))


def holds_code(path: Path) -> bool:
    """Whether a module has any statement besides its docstring and `from __future__` imports."""
    body = ast.parse(path.read_text(), str(path)).body
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        return True
    return False


def product_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" and not holds_code(path):
                continue
            modules.append(path.relative_to(ROOT).as_posix())
    return modules


def test_every_product_module_is_named():
    named = named_paths()
    missing = [module for module in product_modules() if module not in named]
    assert not missing, (
        "docs/architecture.md does not name these modules (add each, by its repository path, "
        f"with one line on what it does): {', '.join(missing)}"
    )


def test_every_named_py_path_exists():
    gone = sorted(path for path in named_paths() if not (ROOT / path).is_file())
    assert not gone, (
        "docs/architecture.md names .py paths that do not exist (write repository paths, and drop "
        f"moved or deleted modules): {', '.join(gone)}"
    )


def test_the_path_pattern_reads_paths_whole():
    text = (
        "mlxcel_core/engine/engine.py's loop; `autotune/ops.py`, (tests/parity.py) and "
        "tests/mlxcel_core/engine/engine.py but not engine.pyc or mlxcel_core/engine/"
    )
    assert set(PY_PATH.findall(text)) == {
        "mlxcel_core/engine/engine.py",
        "autotune/ops.py",
        "tests/parity.py",
        "tests/mlxcel_core/engine/engine.py",
    }
