"""huggingface_hub's download bars while a command fetches a model from the Hub (a local stand-in Hub): shown on a
terminal, never with --json and never when stderr is a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from child_env import repo_pythonpath
from stand_in_hub import stand_in_hub
from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
BAR = "%|"  # tqdm's bar
GENERATE = ["generate", "-m", "org/tiny", "-p", "hi", "-n", "2", "--no-chat-template"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    source = save_tiny_llama(tmp_path_factory.mktemp("hub-src") / "tiny")
    with stand_in_hub({"org/tiny": {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}}) as hub:
        yield hub


def env(hub, cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "0",
        "PYTHONPATH": repo_pythonpath(),
        "TERM": "xterm-256color",
    }


def in_terminal(hub, cache: Path, *args) -> str:
    child = pexpect.spawn(
        sys.executable, ["-m", "mlxcel_cli.main", *args], env=env(hub, cache), encoding="utf-8", timeout=120
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


def test_bars_on_a_terminal_but_not_with_json(hub, tmp_path):
    assert BAR in in_terminal(hub, tmp_path / "a", *GENERATE)
    screen = in_terminal(hub, tmp_path / "b", *GENERATE, "--json")
    assert BAR not in screen and '"finish_reason"' in screen
    screen = in_terminal(hub, tmp_path / "c", "convert", "org/tiny", "-o", str(tmp_path / "out"), "--json")
    assert BAR not in screen and '"path"' in screen


def test_no_bars_in_a_pipe(hub, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *GENERATE],
        env=env(hub, tmp_path / "hf"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mlxcel: downloading org/tiny from the Hugging Face Hub" in proc.stderr and BAR not in proc.stderr
