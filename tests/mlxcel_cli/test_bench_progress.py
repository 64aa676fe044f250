"""`mlxcel bench`'s per-test progress: one line on stderr, rewritten in place on a terminal (the real command in a
pseudo-terminal) and erased before each row; nothing of it when stderr is a pipe; a line per step with -v."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect

from mlxcel_cli.progress_line import ERASE

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["-m", "mlxcel_cli.main", "bench", "--model-shape", "tiny", "-p", "16", "-n", "4", "-r", "2"]


def test_a_terminal_shows_each_tests_progress_and_erases_it():
    child = pexpect.spawn(
        sys.executable,
        ARGS,
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
    screen = child.before
    for progress, row in (
        ("mlxcel: [1/2] pp16 (b=1): run 2/2", "pp16 |"),
        ("mlxcel: [2/2] tg4 (b=1): warm-up", "tg4 |"),
    ):
        assert progress in screen, screen
        erased = screen.index(ERASE, screen.index(progress))
        assert erased < screen.index(row)  # the line goes before the row prints


def test_no_progress_line_in_a_pipe_and_a_line_per_step_with_verbose():
    proc = subprocess.run([sys.executable, *ARGS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "[1/2]" not in proc.stderr and ERASE not in proc.stderr and "run 1/2" not in proc.stderr
    proc = subprocess.run([sys.executable, *ARGS, "-v"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "\nmlxcel: pp16 (b=1): run 2/2: " in proc.stderr and "\nmlxcel: tg4 (b=1): run 2/2: " in proc.stderr
    assert ERASE not in proc.stderr
