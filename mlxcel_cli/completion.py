"""`mlxcel completion bash|zsh|fish|powershell`: the shell completion script, and model-name completion.

The scripts are Typer's (the same `mlxcel --show-completion SHELL` prints; `--install-completion` installs it),
except bash's: bash splits words at ':' (COMP_WORDBREAKS), which would cut `qwen3:4b` in two, so ours sends the
command line as typed and trims what bash already holds before the last ':' from each reply (as bash-completion's
__ltrim_colon_completions does). The shell runs `mlxcel` with `_MLXCEL_COMPLETE` set to complete a command line;
click answers before any command runs, so completing imports no model code. Model arguments (`-m`, `run MODEL`,
`pull`, `rm`, `show`) complete from the catalogue and from the repos in the Hugging Face cache (directory names
only: nothing is scanned).
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated

import typer
from typer import _completion_shared

PROG, COMPLETE_VAR = "mlxcel", "_MLXCEL_COMPLETE"
BASH_SCRIPT = r"""
%(complete_func)s() {
    local IFS=$' \t\n' line="${COMP_LINE:0:COMP_POINT}" words cword cur prefix
    read -r -a words <<< "$line"
    cword=$(( ${#words[@]} - 1 ))
    [[ "$line" =~ [[:space:]]$ || ${#words[@]} -eq 0 ]] && cword=$(( cword + 1 ))
    cur="${words[cword]}"
    IFS=$'\n'
    COMPREPLY=( $( env COMP_WORDS="$line" COMP_CWORD=$cword %(autocomplete_var)s=complete_bash $1 ) )
    if [[ "$cur" == *:* && "$COMP_WORDBREAKS" == *:* ]]; then
        prefix="${cur%%"${cur##*:}"}"
        COMPREPLY=( "${COMPREPLY[@]#"$prefix"}" )
    fi
    return 0
}

complete -o default -F %(complete_func)s %(prog_name)s
"""
_completion_shared._completion_scripts["bash"] = BASH_SCRIPT  # --show/--install-completion print this one too


class Shell(str, Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"
    powershell = "powershell"


def complete_model(incomplete: str) -> list[str]:
    """Catalogue names and cached Hub repos starting with what is typed; paths are left to the shell."""
    if incomplete.startswith((".", "/", "~")):
        return []
    from mlxcel_core import catalog

    names = catalog.names() + _cached_repos()
    return sorted({n for n in names if n.startswith(incomplete)})


def _cached_repos() -> list[str]:
    from huggingface_hub import constants

    try:
        entries = os.listdir(constants.HF_HUB_CACHE)
    except OSError:
        return []
    return [e[len("models--") :].replace("--", "/", 1) for e in entries if e.startswith("models--") and "--" in e[8:]]


def completion(
    shell: Annotated[Shell, typer.Argument(help="The shell to print the completion script for.")],
) -> None:
    """Print the shell completion script (model names complete from the catalogue and the Hugging Face cache).

    bash: `source <(mlxcel completion bash)` (or save it to a file your ~/.bashrc sources);
    zsh: `mlxcel completion zsh > "${fpath[1]}/_mlxcel"`; fish: `mlxcel completion fish >
    ~/.config/fish/completions/mlxcel.fish`. `mlxcel --install-completion` installs it for the current shell."""
    from typer._completion_classes import completion_init
    from typer._completion_shared import get_completion_script

    completion_init()
    print(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell.value))
