"""Every model option of every command (-m/--model, --draft-model, and the MODEL/SRC arguments) completes model
names from the catalogue and from the Hugging Face cache, through click's completion protocol as the shell runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer
from child_env import repo_pythonpath
from typer.core import TyperArgument, TyperOption

from mlxcel_cli.main import app

ROOT = Path(__file__).resolve().parents[2]
MODEL_OPTIONS = {"-m", "--model", "--draft-model"}


def model_params() -> list[tuple[str, object, object]]:
    group = typer.main.get_command(app)
    found = []
    for name, command in group.commands.items():
        for param in command.params:
            is_option = isinstance(param, TyperOption) and MODEL_OPTIONS & set(param.opts)
            is_argument = isinstance(param, TyperArgument) and param.name in ("model", "model_arg", "source", "name")
            if is_option or is_argument:
                found.append((f"{name} {param.opts[-1] if is_option else param.name}", command, param))
    return found


def test_every_model_option_completes_names(tmp_path, monkeypatch):
    from huggingface_hub import constants

    (tmp_path / "models--someorg--some-model").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    params = model_params()
    names = {label for label, _, _ in params}
    for expected in (
        "serve --model",
        "serve --draft-model",
        "tune --model",
        "bench --model",
        "generate --model",
        "generate --draft-model",
        "run --model",
        "run --draft-model",
        "convert source",
        "show model",
    ):
        assert expected in names, sorted(names)
    for label, command, param in params:
        ctx = command.make_context(label.split()[0], [], resilient_parsing=True)
        assert [c.value for c in param.shell_complete(ctx, "qwen3:4b-")] == ["qwen3:4b-4bit", "qwen3:4b-q4_k_m"], label
        assert [c.value for c in param.shell_complete(ctx, "someorg/")] == ["someorg/some-model"], label


def test_serve_model_completes_in_the_shell_protocol(tmp_path):
    """`mlxcel serve -m sm<TAB>`: the shell's call (the completion variable set, the words in the environment)."""
    env = {
        **os.environ,
        "_MLXCEL_COMPLETE": "complete_bash",
        "COMP_WORDS": "mlxcel serve -m smollm2:135m-",
        "COMP_CWORD": "3",
        "HF_HUB_CACHE": str(tmp_path),
        "PYTHONPATH": repo_pythonpath(),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["smollm2:135m-8bit", "smollm2:135m-q4_k_m", "smollm2:135m-q8_0"]
