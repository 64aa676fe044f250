"""The README's quick start stays what CI and pyproject.toml do: .ci/run runs exactly the README's test command, the
quick start clones into a virtual environment, and its CPU torch command installs the version the test extras pin
(so the extras find it installed instead of pulling PyPI's CUDA build on Linux)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI runs 3.11)

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def quick_start() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def commands(section: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command():
    ci = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ['pip install -e ".[test]" && python -m pytest -n 2']
    assert ci[0] in commands(quick_start())


def test_quick_start_clones_into_a_venv_and_installs_cpu_torch_first():
    steps = commands(quick_start())
    clone = next(i for i, c in enumerate(steps) if c.startswith("git clone "))
    venv = next(i for i, c in enumerate(steps) if "-m venv .venv" in c and ". .venv/bin/activate" in c)
    torch = next(i for i, c in enumerate(steps) if c.startswith("pip install torch") and CPU_INDEX in c)
    tests = steps.index('pip install -e ".[test]" && python -m pytest -n 2')
    assert clone < venv < steps.index('pip install -e . && mlxcel generate -p "What is the capital of France?"')
    assert venv < torch < tests


def test_the_cpu_torch_command_installs_the_pinned_version():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [req.split(";")[0].strip() for req in extras if re.match(r"torch\b", req)]
    (command,) = [c for c in commands(quick_start()) if c.startswith("pip install torch")]
    assert command.split()[2] == pin
