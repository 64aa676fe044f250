"""A line on stderr while a long prompt prefills (`generate`, `run -p`, a `run` chat turn's new tokens), erased when
the first token arrives: so a prefill of seconds (a long prompt on CPU) is not silence. Only when stdout and stderr
are both a terminal; never with --json or a pipe, whose readers get exactly the output and statistics."""

from __future__ import annotations

import sys

MIN_TOKENS = 128  # shorter prompts prefill in well under a second on every backend: no line
ERASE = "\r\x1b[K"  # back to the line's start, clear to its end


class PrefillNotice:
    def __init__(self, n_tokens: int, *, as_json: bool):
        self.shown = not as_json and n_tokens >= MIN_TOKENS and sys.stdout.isatty() and sys.stderr.isatty()
        if self.shown:
            sys.stderr.write(f"mlxcel: reading the prompt ({n_tokens} tokens)...")
            sys.stderr.flush()

    def done(self) -> None:
        """Erase the line (the first token is here, or generation ended)."""
        if self.shown:
            sys.stderr.write(ERASE)
            sys.stderr.flush()
            self.shown = False
