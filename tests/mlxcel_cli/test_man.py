"""Man pages: a built wheel installs them into share/man/man1 and `man` finds them there after `pip install`;
`mlxcel man [COMMAND]` prints them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlxcel_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "man", "mlxcel_cli", "mlxcel_core", "autotune"]


def test_mlxcel_man_prints_a_commands_page(capsys):
    assert main(["man", "serve"]) == 0
    out = capsys.readouterr().out
    assert "mlxcel-serve" in out.replace("\u2010", "-") and "OPTIONS" in out
    assert main(["man", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxcel: error: no command 'nosuch' (commands: ") and "serve" in err


MINIMIZED = """#!/bin/sh
echo "This system has been minimized by removing packages and content that are"
echo "not required on a system that users do not log into."
"""


def _real_man() -> bool:
    """man-db's man, not missing and not the notice-printing stub of a minimized Ubuntu image."""
    if shutil.which("man") is None:
        return False
    out = subprocess.run(["man", "--version"], capture_output=True, text=True, timeout=60)
    return out.returncode == 0 and "minimized" not in out.stdout


@pytest.mark.parametrize("viewer", ["missing", "minimized stub"])
def test_without_a_working_man_the_page_is_plain_text(viewer, tmp_path, monkeypatch, capsys):
    if viewer == "minimized stub":
        (tmp_path / "man").write_text(MINIMIZED)
        (tmp_path / "man").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["man", "serve"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MLXCEL-SERVE(1)\n") and "minimized" not in out and "\\f" not in out
    assert "\n       --port <int range>\n              Port to listen on" in out


@pytest.mark.skipif(not _real_man(), reason="needs man-db's man")
def test_pip_install_puts_the_pages_where_man_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    build = "from setuptools import build_meta as b; print(b.build_wheel(%r))" % str(tmp_path / "dist")
    proc = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    wheel = tmp_path / "dist" / proc.stdout.split()[-1]
    pages = sorted(p.name for p in (ROOT / "man").glob("*.1"))
    data = "mlxcel-0.1.0.data/data/share/man/man1/"
    assert sorted(n[len(data) :] for n in zipfile.ZipFile(wheel).namelist() if n.startswith(data)) == pages

    prefix = tmp_path / "prefix"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed"]
    pip += ["--prefix", str(prefix), str(wheel)]  # (--ignore-installed: pip would uninstall this environment's mlxcel)
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # man looks in ../share/man beside each bin directory on PATH, as for a virtual environment's bin
    env = {"PATH": f"{prefix / 'bin'}:/usr/bin:/bin", "MANPATH": ""}
    found = subprocess.run(["man", "-w", "mlxcel-serve"], capture_output=True, text=True, env=env, timeout=60)
    assert found.stdout.strip() == str(prefix / "share" / "man" / "man1" / "mlxcel-serve.1"), found.stderr
