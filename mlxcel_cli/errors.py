"""One place that turns failures into a one-line message and the documented exit code.

0 ok, 1 runtime failure, 2 usage or input error, 130 interrupted.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager

import typer

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_USAGE) -> "typer.Exit":
    print(f"mlxcel: error: {message}", file=sys.stderr)
    return typer.Exit(code)


@contextmanager
def reported_errors(verbose: bool):
    """Run a command body; report mlxcel/unexpected errors in one line (traceback with --verbose)."""
    from mlxcel_core.errors import MlxcelError

    try:
        yield
    except typer.Exit:
        raise
    except MlxcelError as exc:
        if verbose:
            traceback.print_exc()
        raise fail(str(exc), exc.exit_code) from None
    except BrokenPipeError:  # `mlxcel generate ... | head`: the reader left; stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(EXIT_RUNTIME) from None
    except KeyboardInterrupt:
        print("\nmlxcel: interrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:  # a bug or a backend failure: still one line unless --verbose
        if verbose:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        raise fail(f"{type(exc).__name__}: {first} (rerun with --verbose for the traceback)", EXIT_RUNTIME) from None
