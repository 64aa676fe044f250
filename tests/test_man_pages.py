"""The committed man pages (man/) cover every command and option and match scripts/gen_man.py's output."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import typer

from mlxcel_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
MAN_DIR = ROOT / "man"
FIX = "run `python scripts/gen_man.py` and commit man/"


def _load_gen_man():
    spec = importlib.util.spec_from_file_location("gen_man", ROOT / "scripts" / "gen_man.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands() -> list[tuple[str, object]]:
    """(page file name, click command) for the root command and every (nested) visible subcommand."""
    found = []

    def walk(path: list[str], cmd) -> None:
        found.append(("-".join(path) + ".1", cmd))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            if not sub.hidden:
                walk([*path, name], sub)

    walk(["mlxcel"], typer.main.get_command(app))
    return found


COMMANDS = _commands()


def _options_section(page: str) -> str:
    """The OPTIONS section of a groff page, un-escaped to plain text (\\- -> -, font changes dropped)."""
    match = re.search(r"^\.SH OPTIONS\n(.*?)(?=^\.SH |\Z)", page, re.S | re.M)
    text = match.group(1) if match else ""
    text = re.sub(r"\\f[BIRP]", "", text)
    return text.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")


def test_every_subcommand_has_a_page():
    missing = [name for name, _ in COMMANDS if not (MAN_DIR / name).is_file()]
    assert not missing, f"no man page for: {', '.join('man/' + m for m in missing)}; {FIX}"


@pytest.mark.parametrize("page_name,cmd", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_option_is_documented(page_name, cmd):
    page = MAN_DIR / page_name
    assert page.is_file(), f"man/{page_name} is missing; {FIX}"
    options = _options_section(page.read_text())
    for param in cmd.params:
        if param.param_type_name != "option" or getattr(param, "hidden", False):
            continue
        for spelling in [*param.opts, *param.secondary_opts]:
            # whole-word match so that e.g. -n is not found inside --no-chat-template
            assert re.search(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])", options), (
                f"option {spelling} is not documented in man/{page_name}; {FIX}"
            )


def test_pages_are_up_to_date():
    expected = _load_gen_man().render_pages()
    on_disk = {p.name: p.read_text() for p in MAN_DIR.glob("mlxcel*.1")}
    stale = sorted(n for n in expected if on_disk.get(n) != expected[n])
    obsolete = sorted(set(on_disk) - set(expected))
    assert not stale and not obsolete, f"stale or missing: {stale}, obsolete: {obsolete}; {FIX}"
