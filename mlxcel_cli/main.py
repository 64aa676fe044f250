"""The `mlxcel` command. A command's module is imported when the command line names it; subcommand modules import mlx
only inside their functions (fast --help)."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Annotated, Optional

import typer

from . import __version__
from .errors import EXIT_INTERRUPTED, EXIT_USAGE

# command -> the module (in mlxcel_cli) that defines it as a function of the same name; imported when needed
COMMANDS = {
    "generate": "generate",
    "serve": "serve",
    "bench": "bench",
    "run": "run",
    "tune": "tune",
    "pull": "models",
    "ls": "models",
    "rm": "models",
    "show": "models",
    "completion": "completion",
    "man": "man",
    "convert": "convert",
}


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            mlx_version = version("mlx")
        except PackageNotFoundError:
            mlx_version = "not installed"
        print(f"mlxcel {__version__} (mlx {mlx_version})")
        raise typer.Exit(0)


def root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """Run large language models on MLX: generate text from the terminal."""


def make_app(names) -> typer.Typer:
    """The `mlxcel` group with the commands `names` (COMMANDS' keys)."""
    group = typer.Typer(
        name="mlxcel",
        help="Run large language models on MLX.",
        no_args_is_help=True,
        add_completion=True,  # --install-completion / --show-completion (Typer's; `mlxcel completion SHELL` too)
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for name in names:
        group.command(name)(getattr(import_module(f"mlxcel_cli.{COMMANDS[name]}"), name))
    group.callback()(root)
    return group


def listing():
    """The whole CLI's group for its own --help: each command a stand-in holding the command's docstring, all the
    listing reads, so that no command's signature is read (a full build costs ~0.07 s more)."""
    import inspect

    from typer.core import TyperCommand

    group = typer.main.get_command(make_app([]))
    for name, module in COMMANDS.items():
        group.add_command(TyperCommand(name, help=inspect.getdoc(getattr(import_module(f"mlxcel_cli.{module}"), name))))
    return group


def _command_for(args: list[str]):
    """The click command a command line needs: the named command alone, the listing for `mlxcel --help`, else the
    whole CLI (a bare `mlxcel`, typos, shell completion)."""
    if args and args[0] in COMMANDS:
        return typer.main.get_command(make_app([args[0]]))
    if args and args[0] in ("-h", "--help"):
        return listing()
    return typer.main.get_command(make_app(COMMANDS))


def __getattr__(name: str):
    """`app`: the whole CLI (the man page, the settings doc, tests that list commands), built on first use."""
    if name == "app":
        globals()["app"] = make_app(COMMANDS)
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Typer vendors click in recent releases and re-exports only some of its exceptions.
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def nearest(typed: str, options) -> str:
    """The real option nearest to a mistyped one: the same name with '-' for '_' or in other case first (`--top_k` is
    `--top-k`), else the most similar (click lists its candidates alphabetically: `--stop` before `--top-k`)."""
    import difflib

    def key(option: str) -> tuple[bool, float]:
        same = option.lower() == typed.lower().replace("_", "-")
        return same, difflib.SequenceMatcher(None, typed.lower(), option.lower()).ratio()

    return max(options, key=key)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: click errors become one line on stderr with exit code 2. Typer reads every command's
    signature to build a group (about 0.1 s for all of them): a command line builds only what it needs
    (`_command_for`), and parses and reports the same as the whole CLI would."""
    args = sys.argv[1:] if argv is None else argv
    command = _command_for(args)
    try:
        result = command.main(args=args, prog_name="mlxcel", standalone_mode=False)
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `mlxcel`: show the help
            print(exc.ctx.get_help(), file=sys.stderr)
            return EXIT_USAGE
        where = exc.ctx.command_path if exc.ctx else "mlxcel"
        message = exc.format_message()
        if type(exc).__name__ == "NoSuchOption" and getattr(exc, "possibilities", None):
            message = f"No such option: {exc.option_name} (did you mean {nearest(exc.option_name, exc.possibilities)}?)"
        print(f"mlxcel: error: {message} (see '{where} --help')", file=sys.stderr)
        return EXIT_USAGE
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        return EXIT_INTERRUPTED
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
