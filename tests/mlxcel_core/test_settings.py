"""mlxcel_core/settings.py declares every environment variable the code reads; docs/settings.md is generated from it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mlxcel_core import settings

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("mlxcel_core", "mlxcel_cli", "autotune")
NAME = re.compile(r"(?<![A-Z0-9_])MLXCEL_[A-Z0-9_]+")  # (not _MLXCEL_COMPLETE: click's completion variable)


def _gen():
    spec = importlib.util.spec_from_file_location("gen_settings_doc", ROOT / "scripts" / "gen_settings_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mentions() -> dict[str, set[str]]:
    """Every MLXCEL_* name in the product's Python files -> the files that mention it."""
    found: dict[str, set[str]] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for name in NAME.findall(path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_name_in_the_code_is_declared():
    declared = {s.name for s in settings.SETTINGS} | {env for env, _, _ in _gen().option_mirrors()}
    undeclared = {name: sorted(files) for name, files in _mentions().items() if name not in declared}
    assert not undeclared, f"MLXCEL_* names not declared in mlxcel_core/settings.py nor a CLI option: {undeclared}"


def test_every_declared_setting_is_read_somewhere():
    mentions = _mentions()
    unread = [s.name for s in settings.SETTINGS if not mentions.get(s.name, set()) - {"mlxcel_core/settings.py"}]
    assert not unread, f"declared in mlxcel_core/settings.py but read nowhere: {unread}"


def test_no_code_reads_the_environment_for_a_setting_directly():
    """Reads go through settings.get / settings.raw (os.environ[...] = ... for a child process is a write)."""
    direct = re.compile(r"""(environ\.get|getenv|environ\[)\(?\s*["'](MLXCEL_[A-Z0-9_]+)""")
    offenders = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                match = direct.search(line)
                if match and not re.search(r"environ\[[^]]+\]\s*=[^=]", line):
                    offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders, offenders


def test_the_core_reads_at_most_ten():
    """The core, the backends and autotune read few settings; the CLI's option mirrors are the CLI's."""
    core = {name for name, files in _mentions().items() if any(not f.startswith("mlxcel_cli/") for f in files)}
    assert len(core - {env for env, _, _ in _gen().option_mirrors()}) <= 10, sorted(core)


def test_a_value_parses_or_warns_and_falls_back(monkeypatch, capsys):
    monkeypatch.setenv("MLXCEL_TP_JOIN_TIMEOUT", "2.5")
    assert settings.get("MLXCEL_TP_JOIN_TIMEOUT") == 2.5
    monkeypatch.setenv("MLXCEL_TP_JOIN_TIMEOUT", "soon")
    assert settings.get("MLXCEL_TP_JOIN_TIMEOUT") == 60.0
    assert "MLXCEL_TP_JOIN_TIMEOUT='soon' ignored" in capsys.readouterr().err
    monkeypatch.setenv("MLXCEL_CUDA", "0")
    assert settings.get("MLXCEL_CUDA") is False
    monkeypatch.delenv("MLXCEL_CUDA")
    assert settings.get("MLXCEL_CUDA") is True
    with pytest.raises(KeyError):
        settings.get("MLXCEL_NOT_A_SETTING")


def test_the_docs_page_is_current():
    assert (ROOT / "docs" / "settings.md").read_text() == _gen().render(), (
        "run `python scripts/gen_settings_doc.py` and commit docs/settings.md"
    )
