"""`-c/--ctx-size` on generate and run -p (as llama.cpp's -c): the context is capped, prompts beyond it are refused in
one line, bad values exit 2 naming the option; range errors name the option; `--json`'s `model` is the loaded path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel_cli.main import main

PROMPT = ("-p", "The capital of France is a city of", "--no-chat-template")


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _tokens(err: str, what: str) -> int:
    return int(err.split(f"{what}: ")[1].split(" tokens")[0])


def test_generate_ctx_size_caps_prompt_plus_completion(tiny_llama_dir, capsys):
    base = ("generate", "-m", str(tiny_llama_dir), *PROMPT, "-n", "60", "--temp", "0", "--json")
    code, out, _ = run_cli(capsys, *base)
    assert code == 0
    free = json.loads(out)
    assert free["usage"]["total_tokens"] > 24  # uncapped, the completion runs past the cap below
    code, out, err = run_cli(capsys, *base, "--ctx-size", "24")
    assert code == 0, err
    capped = json.loads(out)
    assert capped["usage"]["total_tokens"] == 24 and capped["finish_reason"] == "length"
    assert capped["token_ids"] == free["token_ids"][: len(capped["token_ids"])]


def test_run_ctx_size_caps_prompt_plus_completion(tiny_llama_dir, capsys):
    base = ("run", "-m", str(tiny_llama_dir), "-p", "Hello there", "-n", "60", "--temp", "0")
    code, _, err = run_cli(capsys, *base)
    assert code == 0, err
    prompt = _tokens(err, "prompt")
    assert _tokens(err, "generation") > 5  # uncapped, the completion runs past the cap below
    code, _, err = run_cli(capsys, *base, "-c", str(prompt + 5))
    assert code == 0, err
    assert _tokens(err, "prompt") == prompt and _tokens(err, "generation") == 5


@pytest.mark.parametrize("command", ["generate", "run"])
def test_a_prompt_beyond_the_cap_is_refused_in_one_line(tiny_llama_dir, capsys, command):
    code, out, err = run_cli(capsys, command, "-m", str(tiny_llama_dir), "-p", "Hello there, how are you?", "-c", "4")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert "context is capped at 4" in lines[-1] and lines[-1].startswith("mlxcel: error:")


@pytest.mark.parametrize("command", ["generate", "run"])
def test_a_negative_ctx_size_exits_2_naming_the_option(tiny_llama_dir, capsys, command):
    code, _, err = run_cli(capsys, command, "-m", str(tiny_llama_dir), "-p", "Hello", "--ctx-size", "-5")
    assert code == 2
    assert "--ctx-size" in err and "-5" in err


def test_json_model_is_the_loaded_path(tiny_llama_dir, capsys):
    code, out, _ = run_cli(capsys, "generate", "-m", str(tiny_llama_dir), *PROMPT, "-n", "2", "--json")
    assert code == 0
    assert Path(json.loads(out)["model"]) == Path(tiny_llama_dir)


@pytest.mark.parametrize(
    "args, option",
    [
        (["--temp", "-1"], "--temp must be"),
        (["-n", "0"], "-n/--max-tokens must be"),
        (["--max-tokens", "0"], "-n/--max-tokens must be"),
        (["--top-p", "2"], "--top-p must be"),
        (["--seed", "-3"], "--seed must be"),
        (["--repetition-penalty", "0"], "--repetition-penalty/--repeat-penalty must be"),
    ],
)
def test_range_errors_name_the_option(tiny_llama_dir, capsys, args, option):
    code, out, err = run_cli(capsys, "generate", "-m", str(tiny_llama_dir), "-p", "hi", *args)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"mlxcel: error: {option}"), err
