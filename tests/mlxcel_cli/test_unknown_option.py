"""A mistyped option is one line naming the nearest real option (not click's alphabetical list), exit 2."""

from __future__ import annotations

import pytest

from mlxcel_cli.main import main


@pytest.mark.parametrize(
    "args, nearest",
    [
        (["generate", "--top_k", "3"], "--top-k"),  # click's list began with --stop
        (["generate", "--sytem", "x"], "--system"),
        (["generate", "--temperature", "1"], "--temp"),
        (["run", "--max_tokens", "3"], "--max-tokens"),
        (["serve", "--prot", "1"], "--port"),
        (["bench", "--n_prompt", "8"], "--n-prompt"),
    ],
)
def test_the_suggestion_is_the_nearest_option(capsys, args, nearest):
    assert main(args) == 2
    out, err = capsys.readouterr()
    command = args[0]
    assert out == ""
    assert err == (
        f"mlxcel: error: No such option: {args[1]} (did you mean {nearest}?) (see 'mlxcel {command} --help')\n"
    )


def test_no_suggestion_when_nothing_is_near(capsys):
    assert main(["generate", "--zzzzzz"]) == 2
    assert capsys.readouterr().err == "mlxcel: error: No such option: --zzzzzz (see 'mlxcel generate --help')\n"
