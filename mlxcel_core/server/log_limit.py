"""A log filter that lets one warning or error through a few times a minute, not a million times.

A flood of hostile connections makes the same warning over and over (refused connections, timeouts, malformed
requests, the event loop's "out of system resource"). `RepeatFilter` passes at most `burst` records of a kind (the
logger, the level and the message's first line, before its arguments are filled in) per `window` seconds; the first
record of that kind let through after some were dropped says how many. Records below WARNING (one INFO line per
request) always pass.
"""

from __future__ import annotations

import logging
import time


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = 5, window: float = 60.0, clock=time.monotonic, max_kinds: int = 1000):
        super().__init__()
        self.burst, self.window, self.clock, self.max_kinds = burst, window, clock, max_kinds
        self._seen: dict[tuple, list] = {}  # kind -> [window start, records in the window, dropped since the last]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        entry = self._seen.get(kind)
        if entry is None:
            if len(self._seen) >= self.max_kinds:
                self._forget(now)
            entry = self._seen[kind] = [now, 0, 0]
        if now - entry[0] >= self.window:
            entry[0], entry[1] = now, 0
        entry[1] += 1
        if entry[1] > self.burst:
            entry[2] += 1
            return False
        if entry[2]:
            record.msg = f"{record.msg} ({entry[2]} more like this were not logged)"
            entry[2] = 0
        return True

    def _forget(self, now: float) -> None:
        """Drop the kinds whose window has passed (all of them if none has)."""
        stale = [k for k, (start, _, _) in self._seen.items() if now - start >= self.window]
        for kind in stale or list(self._seen):
            del self._seen[kind]
