"""Progress on stderr, only when it is a terminal (a pipe or a file gets none, so its reader sees exactly the output):
one line rewritten in place and erased before results print (`mlxcel bench`'s per-test progress), and
huggingface_hub's download bars while a command fetches a model (off with --json too)."""

from __future__ import annotations

import shutil
import sys

ERASE = "\r\x1b[K"  # back to the line's start, clear to its end


class ProgressLine:
    """`show(text)` rewrites the line as `mlxcel: [i/total] text`; `advance()` erases it and counts one item done."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.done = total, 0
        self.active = self.stream.isatty()
        self.shown = False

    def show(self, text: str) -> None:
        if not self.active:
            return
        width = shutil.get_terminal_size(fallback=(80, 24)).columns - 1  # one line: a wrapped one would not erase
        line = f"mlxcel: [{min(self.done + 1, self.total)}/{self.total}] {text}"
        self.stream.write(ERASE + line[:width])
        self.stream.flush()
        self.shown = True

    def advance(self) -> None:
        self.clear()
        self.done += 1

    def clear(self) -> None:
        if self.shown:
            self.stream.write(ERASE)
            self.stream.flush()
            self.shown = False


def hub_download_bars(json_mode: bool = False) -> None:
    """huggingface_hub's download bars (a model fetched from the Hub by generate, run, serve, bench or convert): kept
    on a terminal, turned off when stderr is a pipe or a file (tqdm would write its every update there) or the command
    prints --json."""
    if json_mode or not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
