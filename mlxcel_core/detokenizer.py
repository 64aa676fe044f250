"""Incremental detokenizer and stop-string matcher for streamed text.

Decoding token by token breaks multi-byte characters and (for SentencePiece vocabularies) drops
the leading space of a word. Instead we decode a short window of recent tokens twice, with and
without the new ones, and emit the difference once it no longer ends in a replacement character.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: list[int] | None = None):
        self._decode = decode
        # A little prompt context makes the first generated word decode with its leading space.
        self.tokens: list[int] = list(prompt_tail or [])
        self._prefix = 0
        self._read = len(self.tokens)

    def add(self, token: int) -> str:
        """Append a token; return the newly completed text (maybe empty)."""
        self.tokens.append(token)
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        full_text = self._decode(self.tokens[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            new = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.tokens)
            return new
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. a dangling partial character)."""
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        full_text = self._decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Holds back text that could still become a stop string; stop strings are never emitted."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        self._pending += text
        hits = [(self._pending.find(s), s) for s in self.stops if s in self._pending]
        if hits:
            pos = min(h[0] for h in hits)
            out, self._pending = self._pending[:pos], ""
            return out, True
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best
