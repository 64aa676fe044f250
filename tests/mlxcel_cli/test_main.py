"""The `mlxcel` entry point (mlxcel_cli/main.py): a command line that names a command builds that command alone, with
the same help, parsing and errors as in the whole CLI, and imports no other command's module; `mlxcel --help` lists
the commands as the whole CLI does without building them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from mlxcel_cli.main import COMMANDS, app, listing, main, make_app


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_commands_help_is_the_whole_clis(name):
    alone = CliRunner().invoke(make_app([name]), [name, "--help"], prog_name="mlxcel")
    whole = CliRunner().invoke(app, [name, "--help"], prog_name="mlxcel")
    assert alone.exit_code == whole.exit_code == 0, whole.output
    assert alone.output == whole.output


def test_the_listing_for_mlxcel_help_is_the_whole_clis_help(capsys):
    outputs = []
    for group in (listing(), typer.main.get_command(app)):
        assert group.main(args=["--help"], prog_name="mlxcel", standalone_mode=False) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and all(name in outputs[1] for name in COMMANDS), outputs


def test_the_entry_point_answers_a_commands_help(capsys):
    assert main(["ls", "--help"]) == 0
    assert capsys.readouterr().out.startswith("Usage: mlxcel ls [OPTIONS]")


def test_a_bad_option_is_reported_as_in_the_whole_cli(capsys):
    assert main(["generate", "--top_k", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "mlxcel: error: No such option: --top_k (did you mean --top-k?) (see 'mlxcel generate --help')\n"
    assert main(["gen"]) == 2  # not a command: the whole CLI answers
    assert "No such command 'gen'" in capsys.readouterr().err


def test_naming_a_command_imports_no_other_commands_module():
    probe = (
        "import sys; from mlxcel_cli.main import main; main(['ls', '--help']); "
        "print(sorted(m for m in sys.modules if m in ('mlxcel_cli.serve', 'mlxcel_cli.bench', 'mlxcel_cli.run')))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
