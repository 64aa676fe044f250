"""The layering contracts (pyproject.toml's [tool.importlinter]) and ruff's lint and format checks hold."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return path


def _check(*command: str) -> None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"


def test_import_contracts_hold():
    _check(_tool("lint-imports"))


def test_ruff_lint():
    _check(_tool("ruff"), "check", ".")


def test_ruff_format():
    _check(_tool("ruff"), "format", "--check", ".")
