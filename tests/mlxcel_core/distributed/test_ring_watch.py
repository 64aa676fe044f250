"""ring_watch.py: a rank whose ring peer died exits 1 with the lost-peer line when MLX would leave it stuck, and a
rank that exits normally loses nothing it wrote to stderr (both in a child process: the watch takes over fd 2)."""

from __future__ import annotations

import subprocess
import sys
import time

SETUP = "import os, sys, time\nfrom mlxcel_core.distributed.ring_watch import RING_FAILURE, RingFailureWatch\n"


def _run(body: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", SETUP + body], capture_output=True, text=True, timeout=timeout)
    return run, time.monotonic() - start


def test_a_stuck_rank_exits_after_the_ring_failure():
    # the MLX backend's line on fd 2, then a wait that never ends on its own (GIL released, as in mx.async_eval)
    run, elapsed = _run(
        "RingFailureWatch(3, grace=0.5)\n"
        "os.write(2, b'[ring] Socket 3 was closed by the peer\\n' + RING_FAILURE + b'. Failing...\\n')\n"
        "time.sleep(50)\n"
    )
    assert run.returncode == 1 and elapsed < 30
    lines = run.stderr.splitlines()
    assert lines[:2] == ["[ring] Socket 3 was closed by the peer", "[ring] Too many send/recv errors. Failing..."]
    assert lines[-1] == (
        "mlxcel: error: rank 3: lost the connection to another rank ([ring] Too many send/recv "
        "errors); did it exit or crash?"
    )


def test_a_rank_that_exits_keeps_its_stderr():
    # Python's and the C library's writes, the failure line included, then a normal exit before the grace ends
    run, _ = _run(
        "RingFailureWatch(0, grace=30)\n"
        "for i in range(2000):\n"
        "    print(f'line {i}', file=sys.stderr)\n"
        "os.write(2, RING_FAILURE + b'\\n')\n"
        "print('mlxcel: error: rank 0: lost the connection to another rank', file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    lines = run.stderr.splitlines()
    assert run.returncode == 1
    assert lines[:2000] == [f"line {i}" for i in range(2000)]
    assert lines[2000:] == [
        "[ring] Too many send/recv errors",
        "mlxcel: error: rank 0: lost the connection to another rank",
    ]


def test_no_failure_no_exit():
    run, elapsed = _run(
        "RingFailureWatch(1, grace=0.2)\nos.write(2, b'[ring] all fine\\n')\ntime.sleep(1)\nprint('done')\n"
    )
    assert run.returncode == 0 and run.stdout == "done\n" and run.stderr == "[ring] all fine\n" and elapsed >= 1
