"""Shell completion: `mlxcel completion bash` sourced into a real bash completes commands and model names (from
the catalogue and the Hugging Face cache, `qwen3:4b` whole despite bash splitting words at ':')."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DRIVER = """
source <(mlxcel completion bash)
complete_line() {
    COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}
    read -r -a COMP_WORDS <<< "$COMP_LINE"; COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
    _mlxcel_completion mlxcel
    echo "${COMPREPLY[*]}"
}
complete_line "mlxcel pu"
complete_line "mlxcel generate -m qwen3:4"
complete_line "mlxcel run someo"
complete_line "mlxcel show ./"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_commands_and_model_names(tmp_path):
    bin_dir, cache = tmp_path / "bin", tmp_path / "hf"
    bin_dir.mkdir()
    (cache / "models--someorg--some-model").mkdir(parents=True)
    shim = bin_dir / "mlxcel"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mlxcel_cli.main "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "HF_HUB_CACHE": str(cache),
    }
    proc = subprocess.run(["bash", "-c", DRIVER], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pull, qwen, cached, path = proc.stdout.splitlines()
    assert pull == "pull"
    assert qwen.split() == ["4b", "4b-4bit", "4b-q4_k_m"]  # bash holds "4" as the word after ':'; the rest is ours
    assert cached == "someorg/some-model"
    assert path == ""  # paths are left to bash's own file completion (-o default)


def test_every_shell_script_names_the_completion_variable(capsys):
    for shell in ("bash", "zsh", "fish", "powershell"):
        assert main(["completion", shell]) == 0
        out = capsys.readouterr().out
        assert "_MLXCEL_COMPLETE" in out and "mlxcel" in out
    assert main(["completion", "tcsh"]) == 2
    assert "'tcsh' is not one of" in capsys.readouterr().err
