"""A rank that would hang after its ring peer died: report it and exit 1.

When a peer of the ring backend (MLX 0.32) dies, the backend prints RING_FAILURE on stderr and fails its pending
tasks. The collective then normally raises, and `lost_peer_errors` reports it. One case never returns: the failure
lands while `mx.async_eval` is queueing the next decode step (test_rank_that_dies_makes_the_other_fail_quickly hangs
there now and then without this module). Python cannot interrupt that call.

So a ring rank's fd 2, unless it is a terminal, goes through a pipe, which a thread copies to the real stderr. Once
RING_FAILURE has passed through it, a process still alive GRACE_S seconds later writes the usual lost-peer line and
exits 1 (os._exit: the main thread is stuck in MLX). At a normal exit, fd 2 is restored and the pipe drained first,
so nothing written to stderr is lost.
"""

from __future__ import annotations

import atexit
import os
import threading

RING_FAILURE = b"[ring] Too many send/recv errors"
GRACE_S = 10.0


class RingFailureWatch:
    """Copies fd 2 through a pipe and exits the process `grace` seconds after RING_FAILURE unless it has exited."""

    def __init__(self, rank: int, grace: float = GRACE_S):
        self.rank, self.grace = rank, grace
        self._timer: threading.Timer | None = None  # (set before the pump starts: the pump reads it)
        self._stderr = os.dup(2)  # the real stderr
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._pump = threading.Thread(target=self._copy, args=(read_end,), name="mlxcel-ring-watch", daemon=True)
        self._pump.start()
        atexit.register(self.close)

    def _copy(self, read_end: int) -> None:
        tail = b""
        while chunk := os.read(read_end, 65536):
            view = memoryview(chunk)
            while view:
                view = view[os.write(self._stderr, view) :]
            if self._timer is None and RING_FAILURE in tail + chunk:
                self._timer = threading.Timer(self.grace, self._give_up)
                self._timer.daemon = True
                self._timer.start()
            tail = chunk[-len(RING_FAILURE) :]
        os.close(read_end)

    def _give_up(self) -> None:
        os.write(
            self._stderr,
            (
                f"mlxcel: error: rank {self.rank}: lost the connection to another rank "
                f"({RING_FAILURE.decode()}); did it exit or crash?\n"
            ).encode(),
        )
        os._exit(1)

    def close(self) -> None:
        """Put the real stderr back on fd 2 and copy what the pipe still holds (at exit)."""
        if self._pump is None:
            return
        os.dup2(self._stderr, 2)  # the pipe's last write end closes: the pump reads to its end
        self._pump.join(timeout=5)
        self._pump = None
        if self._timer is not None:
            self._timer.cancel()
