"""Why engine/launcher.py's ThreadLauncher lowers the GIL switch interval: a stand-in for its loop, no MLX.

    python benchmarks/gil_handoff.py

The engine's thread runs Python for BUILD_US (building the next step, GIL held) while a worker runs a call of
LAUNCH_US that releases the GIL (as mx.async_eval does), then waits for it and hands it the next one. The worker needs
the GIL for a moment to start and to end its call. Serial, a step would take BUILD_US + LAUNCH_US; overlapped, about
the longer of the two. Printed: microseconds a step at each switch interval.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

BUILD_US, LAUNCH_US, STEPS = 400, 1000, 300


def busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def step_us(interval_s: float) -> float:
    sys.setswitchinterval(interval_s)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        pending = None
        start = time.perf_counter()
        for _ in range(STEPS):
            busy(BUILD_US)
            if pending is not None:
                pending.result()
            pending = pool.submit(time.sleep, LAUNCH_US / 1e6)
        pending.result()
        return (time.perf_counter() - start) / STEPS * 1e6


def main() -> int:
    kept = sys.getswitchinterval()
    print(f"build {BUILD_US} us (GIL held) beside a {LAUNCH_US} us GIL-free call; serial would be about "
          f"{BUILD_US + LAUNCH_US} us a step, overlapped about {max(BUILD_US, LAUNCH_US)}")
    for interval in (5e-3, 1e-3, 1e-4, 5e-5, 2e-5, 1e-5):
        print(f"switch interval {interval * 1e6:6.0f} us: {step_us(interval):6.0f} us a step")
    sys.setswitchinterval(kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
