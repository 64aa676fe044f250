"""`mlxcel run` driven as a user would: the real command in a pseudo-terminal (pexpect), or with a pipe.

Every wait is bounded (TIMEOUT, or a shorter one where a step is quick). With -v each turn ends with one
line "mlxcel: prompt N tokens: C computed (K cached), ..." that the tests read the KV reuse from.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ">>> "
TIMEOUT = 60  # seconds for any one wait; SmolLM2 on 2 CPU cores answers a short question in ~10 s
TURN = re.compile(r"mlxcel: prompt (\d+) tokens: (\d+) computed \((\d+) cached\)[^;]*; reply (\d+) tokens")


def spawn(*args, env=None):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlxcel_cli.main", "run", *args],
        cwd=str(ROOT),
        env={**os.environ, "TERM": "xterm-256color", **(env or {})},
        encoding="utf-8",
        codec_errors="replace",
        timeout=TIMEOUT,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def say(child, text):
    """Send one line and wait for the reply's statistics line (needs -v) and the next prompt."""
    child.sendline(text)
    child.expect(TURN)
    prompt, computed, cached, generated = map(int, child.match.groups())
    reply = child.before.split("\n", 1)[-1]  # after the echoed line
    child.expect_exact(PROMPT)
    return {"prompt": prompt, "computed": computed, "cached": cached, "generated": generated, "text": reply}


def command(child, line):
    """Send a /command; return what it printed before the next prompt."""
    child.sendline(line)
    child.expect_exact(PROMPT, timeout=10)
    return child.before


def finish(child):
    child.expect(pexpect.EOF, timeout=10)
    child.close()
    return child.exitstatus


def run_piped(*args, stdin, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "run", *args],
        input=stdin,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def endless_llama_dir(tmp_path_factory):
    """The tiny model with no end-of-sequence token and a long context: a reply goes on until stopped."""
    path = save_tiny_llama(tmp_path_factory.mktemp("endless-llama"), eos_token_id=None, max_position_embeddings=65536)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    return path


def test_turns_reuse_the_cache_and_clear_starts_over(tiny_llama_dir):
    child = spawn(str(tiny_llama_dir), "-n", "8", "-v", "--system", "Be brief.")
    first = say(child, "Hello world")
    assert first["cached"] == 0 and first["computed"] == first["prompt"]
    second = say(child, "The capital of France")
    assert second["prompt"] > first["prompt"] + first["generated"]
    assert second["cached"] > first["prompt"]  # the first turn is not computed again
    assert second["computed"] == second["prompt"] - second["cached"]

    stats = command(child, "/stats")
    assert f"prompt tokens: {second['prompt']}" in stats
    assert f"prefill computed tokens: {second['computed']} ({second['cached']} reused" in stats
    assert f"generated tokens: {second['generated']}" in stats and "tok/s" in stats

    assert "new conversation (system prompt kept)" in command(child, "/clear")
    again = say(child, "Hello world")
    assert again["cached"] == 0 and again["prompt"] == first["prompt"]  # same system prompt, nothing else
    assert "system prompt: Be brief." in command(child, "/system")
    child.sendline("/bye")
    assert finish(child) == 0


def test_multi_line_input_is_one_message(tiny_llama_dir):
    from mlxcel_core.loading import load_model

    tokenizer = load_model(str(tiny_llama_dir), log=lambda m: None).tokenizer
    expected = len(tokenizer.apply_chat_template([{"role": "user", "content": "line one\nline two\nline three"}]))
    child = spawn(str(tiny_llama_dir), "-n", "4", "-v")
    child.sendline('"""line one')
    child.expect_exact("... ", timeout=10)
    child.sendline("line two")
    child.expect_exact("... ", timeout=10)
    child.sendline('line three"""')
    child.expect(TURN)
    assert int(child.match.group(1)) == expected
    child.expect_exact(PROMPT)
    assert say(child, '"""/not a command"""')["prompt"] > expected  # fenced text is a message, not a command
    child.sendeof()
    assert finish(child) == 0


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(endless_llama_dir):
    child = spawn(str(endless_llama_dir), "-n", "60000", "-v")
    child.sendline("Hello world")
    child.expect_exact("Hello world")  # the echo
    child.expect(r"[\s\S]{100}")  # reply text is streaming
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect(TURN)
    prompt, _, _, generated = map(int, child.match.groups())
    assert 0 < generated < 60000
    child.expect_exact(PROMPT)
    assert "max-tokens = 5" in command(child, "/set max-tokens 5")
    turn = say(child, "The capital")
    assert turn["generated"] == 5
    assert turn["cached"] > prompt  # the partial reply stayed in the conversation (and in the KV cache)
    child.sendintr()  # at an empty prompt: leave
    assert finish(child) == 0


@pytest.mark.parametrize("how", ["ctrl-d", "ctrl-c", "/exit"])
def test_leaving_exits_0(tiny_llama_dir, how):
    child = spawn(str(tiny_llama_dir), "-n", "2")
    if how == "ctrl-d":
        child.sendeof()
    elif how == "ctrl-c":
        child.sendintr()
    else:
        child.sendline(how)
    assert finish(child) == 0


def test_bad_settings_are_one_line_and_the_chat_goes_on(tiny_llama_dir):
    child = spawn(str(tiny_llama_dir), "-n", "3", "-v")
    out = command(child, "/set temp -1")
    assert "mlxcel: error: temperature must be a finite number >= 0, got -1.0" in out
    assert "must be a number, got 'warm'" in command(child, "/set temp warm")
    assert "unknown setting 'colour'" in command(child, "/set colour red")
    assert "unknown command /frobnicate" in command(child, "/frobnicate")
    assert "temp 0.0," in command(child, "/set")  # nothing changed
    assert "temp = 0.5" in command(child, "/set temp 0.5")
    assert say(child, "Hello world")["generated"] >= 1
    child.sendline("/bye")
    assert finish(child) == 0


def test_piped_stdin_answers_each_line_in_one_conversation(tiny_llama_dir):
    proc = run_piped(str(tiny_llama_dir), "-n", "6", "-v", stdin="Hello world\n\nThe capital of France\n")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2 and proc.stdout.endswith("\n")  # blank lines are skipped
    turns = [tuple(map(int, m)) for m in TURN.findall(proc.stderr)]
    assert len(turns) == 2 and turns[1][2] > turns[0][0]  # turn 2 reused turn 1's cache
    assert PROMPT not in proc.stdout + proc.stderr and "\x1b" not in proc.stdout + proc.stderr


def test_prompt_option_prints_what_generate_prints(tiny_llama_dir):
    model = str(tiny_llama_dir)
    gen = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "generate", "-m", model, "-p", "Hello", "-n", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert gen.returncode == 0, gen.stderr
    for args in ((model,), ("-m", model)):
        proc = run_piped(*args, "-p", "Hello", "-n", "8", stdin="")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == gen.stdout and "tok/s" in proc.stderr
    clash = run_piped(model, "-m", model + "-other", "-p", "Hello", stdin="")
    assert clash.returncode == 2 and "not both" in clash.stderr


@pytest.mark.real_model
def test_smollm2_two_turn_chat(smollm2_gguf):
    child = spawn(str(smollm2_gguf), "-n", "12", "-v")
    first = say(child, "What is the capital of France?")
    assert "Paris" in first["text"]
    second = say(child, "What is its most famous tower?")
    assert "Paris" in second["text"]  # "its" was read from the first turn
    assert second["cached"] >= first["prompt"] + first["generated"] - 1  # only the new message was computed
    assert second["computed"] < 20
    child.sendeof()
    assert finish(child) == 0


@pytest.mark.real_model
def test_smollm2_ctrl_c_then_another_question(smollm2_gguf):
    child = spawn(str(smollm2_gguf), "-n", "200", "-v")
    child.sendline("Write a long story about a dragon.")
    child.expect_exact("dragon.")  # the echo
    child.expect(r"\w+\W+\w+\W+\w+")  # a few words of the reply
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect_exact(PROMPT)
    command(child, "/set max-tokens 12")
    assert "Paris" in say(child, "What is the capital of France?")["text"]
    child.sendline("/bye")
    assert finish(child) == 0


@pytest.mark.real_model
def test_smollm2_piped_default_model(smollm2_gguf, tmp_path):
    """No MODEL: the same default model as generate (here the GGUF cached from PyPI, offline)."""
    proc = run_piped(
        "-n",
        "12",
        stdin="What is the capital of France?\nAnd of Italy?\n",
        env={
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "empty-hf-cache"),
            "MLXCEL_CACHE_DIR": str(smollm2_gguf.parents[2]),
        },
    )
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.splitlines()
    assert len(answers) == 2 and "Paris" in answers[0] and "Rome" in answers[1], answers
    assert "cached GGUF from PyPI" in proc.stderr
