"""The sampler's knobs on the command line: `generate` and `run -p` take the same options (options.py),
reject out-of-range values with one line and exit 2, and pass the values through to the sampler."""

from __future__ import annotations

import json

import pytest

from mlxcel_cli.main import main
from mlxcel_core.chat import ChatSession
from mlxcel_core.errors import InputError

BAD = [
    (["--repeat-penalty", "0"], "repeat-penalty must be"),
    (["--repetition-penalty", "-2"], "repeat-penalty must be"),
    (["--repeat-last-n", "-2"], "repeat-last-n must be"),
    (["--presence-penalty", "2.5"], "presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-3"], "frequency-penalty must be in [-2, 2]"),
    (["--dry-multiplier", "-1"], "dry-multiplier must be"),
    (["--dry-base", "0.5"], "dry-base must be"),
    (["--dry-allowed-length", "0"], "dry-allowed-length must be"),
    (["--dry-penalty-last-n", "-5"], "dry-penalty-last-n must be"),
    (["--xtc-threshold", "1.5"], "xtc-threshold must be in [0, 1]"),
    (["--xtc-probability", "2"], "xtc-probability must be in [0, 1]"),
    (["--top-k", "-1"], "top-k must be"),
    (["--min-p", "1.5"], "min-p must be"),
    (["--logit-bias", "abc"], "--logit-bias must look like"),
    (["--logit-bias", "5+200"], "logit_bias value for token 5 must be"),
    (["--logit-bias", "99999=1"], "outside the vocabulary"),
    (["--suppress-token", "99999"], "outside the vocabulary"),
]


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["generate", "run"])
@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_out_of_range_is_one_line_and_exit_2(tiny_llama_dir, capsys, command, args, message):
    code, out, err = run_cli(capsys, command, "-m", str(tiny_llama_dir), "-p", "hello", *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines[-1].startswith("mlxcel: error: ") and message in lines[-1], err


def generated(capsys, model_dir, *args) -> list[int]:
    code, out, err = run_cli(
        capsys, "generate", "-m", str(model_dir), "-p", "The capital", "-n", "8", "--no-chat-template", "--json", *args
    )
    assert code == 0, err
    return json.loads(out)["token_ids"]


def test_knobs_reach_the_sampler(tiny_llama_dir, capsys):
    plain = generated(capsys, tiny_llama_dir)
    first = plain[0]
    assert generated(capsys, tiny_llama_dir, "--suppress-token", str(first))[0] != first
    assert set(generated(capsys, tiny_llama_dir, "--logit-bias", "42+100")) == {42}
    assert set(generated(capsys, tiny_llama_dir, "-l", "42=100", "--suppress-token", "42")) != {42}
    penalized = generated(
        capsys,
        tiny_llama_dir,
        "--repeat-penalty",
        "3",
        "--repeat-last-n",
        "-1",
        "--dry-multiplier",
        "3",
        "--dry-allowed-length",
        "1",
        "--dry-sequence-breaker",
        "none",
    )
    assert penalized != plain
    # XTC at temperature 0 is skipped: greedy stays greedy
    assert generated(capsys, tiny_llama_dir, "--xtc-probability", "1", "--xtc-threshold", "0") == plain


def test_dry_sequence_breaker_escapes():
    from mlxcel_cli.options import sampling_params

    p = sampling_params(5, 0.0, 0, 1.0, 0.0, None, None, dry_sequence_breaker=["\\n", "é:", "\\t"])
    assert p.dry_sequence_breakers == ("\n", "é:", "\t")
    assert sampling_params(5, 0.0, 0, 1.0, 0.0, None, None).dry_sequence_breakers == ("\n", ":", '"', "*")
    assert sampling_params(5, 0.0, 0, 1.0, 0.0, None, None, dry_sequence_breaker=["none"]).dry_sequence_breakers == ()


def test_run_set_names_every_knob(tiny_llama_dir):
    from mlxcel_core.loading import load_model

    chat = ChatSession(load_model(str(tiny_llama_dir), log=lambda m: None))
    values = {
        "repeat-penalty": ("1.3", "repetition_penalty", 1.3),
        "repeat-last-n": ("-1", "repeat_last_n", -1),
        "presence-penalty": ("0.5", "presence_penalty", 0.5),
        "frequency-penalty": ("1", "frequency_penalty", 1.0),
        "dry-multiplier": ("0.8", "dry_multiplier", 0.8),
        "dry-base": ("2", "dry_base", 2.0),
        "dry-allowed-length": ("3", "dry_allowed_length", 3),
        "dry-penalty-last-n": ("128", "dry_penalty_last_n", 128),
        "xtc-threshold": ("0.2", "xtc_threshold", 0.2),
        "xtc-probability": ("0.5", "xtc_probability", 0.5),
    }
    for name, (text, field, value) in values.items():
        assert getattr(chat.set(name, text), field) == value
    with pytest.raises(InputError, match="xtc-probability must be in"):
        chat.set("xtc-probability", "3")
    with pytest.raises(InputError, match="settable: .*dry-multiplier"):
        chat.set("dry", "1")
    assert chat.ask("Hello")  # the penalties and DRY run in a chat turn
