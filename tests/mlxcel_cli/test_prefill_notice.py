"""The line on stderr while a long prompt prefills: shown on a terminal (the real command in a pseudo-terminal) and
erased before the answer; never with --json, never when the output is piped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from mlxcel_cli.prefill_notice import ERASE, MIN_TOKENS

ROOT = Path(__file__).resolve().parents[2]
LONG = "hello world " * 30  # over MIN_TOKENS tokens with the tiny tokenizer
NOTICE = "mlxcel: reading the prompt ("


def in_terminal(*args) -> str:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlxcel_cli.main", *args],
        cwd=str(ROOT),
        env={**os.environ, "TERM": "xterm-256color"},
        encoding="utf-8",
        codec_errors="replace",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


@pytest.mark.parametrize("command", ["generate", "run"])
def test_a_long_prompt_shows_the_line_on_a_terminal_and_erases_it(tiny_llama_dir, command):
    extra = ("--no-chat-template",) if command == "generate" else ()
    screen = in_terminal(command, "-m", str(tiny_llama_dir), "-p", LONG, "-n", "3", "-v", *extra)
    assert NOTICE in screen
    tokens = int(screen.split(NOTICE)[1].split(" tokens")[0])
    assert tokens >= MIN_TOKENS and f"prompt tokens: {tokens}" in screen  # the prompt's own count
    assert screen.index(ERASE) > screen.index(NOTICE)  # erased before the answer and the statistics
    assert screen.index("tok/s") > screen.index(ERASE)


def test_no_line_for_a_short_prompt_or_with_json(tiny_llama_dir):
    assert NOTICE not in in_terminal("generate", "-m", str(tiny_llama_dir), "-p", "hi", "-n", "2")
    screen = in_terminal("generate", "-m", str(tiny_llama_dir), "-p", LONG, "-n", "2", "--json", "--no-chat-template")
    assert NOTICE not in screen and ERASE not in screen


def test_no_line_when_piped(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "generate", "-m", str(tiny_llama_dir), "-p", LONG, "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    assert NOTICE not in proc.stderr and ERASE not in proc.stderr


TURN = re.compile(r"mlxcel: prompt (\d+) tokens: (\d+) computed \((\d+) cached\)")


def test_a_chat_turn_shows_the_line_for_its_new_tokens_only(tiny_llama_dir):
    """In the interactive chat, a long message shows the line with the tokens the turn computes; a short next message,
    whose history comes from the KV cache, shows none."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlxcel_cli.main", "run", str(tiny_llama_dir), "-n", "3", "-v"],
        cwd=str(ROOT),
        env={**os.environ, "TERM": "xterm-256color"},
        encoding="utf-8",
        codec_errors="replace",
        timeout=120,
        dimensions=(40, 200),
    )
    child.expect_exact(">>> ")
    child.sendline(LONG)
    child.expect(TURN)
    computed = int(child.match.group(2))
    screen = child.before
    assert NOTICE in screen and computed >= MIN_TOKENS
    assert int(screen.split(NOTICE)[1].split(" tokens")[0]) == computed
    assert screen.index(ERASE, screen.index(NOTICE)) > screen.index(NOTICE)  # erased before the reply
    child.expect_exact(">>> ")
    child.sendline("hi")
    child.expect(TURN)
    assert int(child.match.group(3)) > computed and NOTICE not in child.before  # a few new tokens: no line
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_no_line_in_a_piped_chat(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "run", str(tiny_llama_dir), "-n", "2"],
        input=LONG + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    assert NOTICE not in proc.stderr and ERASE not in proc.stderr
