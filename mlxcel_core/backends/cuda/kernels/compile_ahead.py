"""The kernels a run will launch, compiled all at once on many threads before it: what a fresh machine's serve warm-up
waits for when it compiles them one launch at a time.

    with collecting() as ahead:     # a dry run: every cached kernel's launch gives zeros of its output shapes, and
        ...                         # each variant missing from the kernel cache is compiled on a worker thread
    # on exit every compile has ended: its cubin is in the cache directory, where the real run reads it

The dry run finds the variants the way the real run will (the same launches with the same shapes, dtypes and template
values), so it compiles only what the model needs. NVRTC compiles one program per thread with Python's lock released
(ctypes), so the compiles run side by side while the dry run goes on. Its results are zeros: it must leave nothing
behind that a later run reads, which is why the warm-up runs it on a throwaway engine with neither compiled steps
(an mx.compile trace would keep the zeros as constants) nor a recorded graph (server/warmup.py), and why autotuning
does not measure inside it (`active`). A compile that fails here is left to the real run, which compiles it again
(and falls back to MLX's kernel as it does for any failure: cubin_cache.py).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from . import cubin_cache

log = logging.getLogger("mlxcel")
MAX_THREADS = 16  # NVRTC takes one core and a few hundred MB a compile


def active() -> bool:
    """Whether a dry run is collecting: launches give zeros (nothing measured now means anything)."""
    return cubin_cache._ahead is not None


class Ahead:
    """The compiles a dry run submitted, each on a worker thread, keyed by the variant's function name."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mlxcel-nvrtc")
        self._jobs: dict[str, Future] = {}
        self._began: float | None = None

    def submit(self, func: str, text: str, arch: str, path: Path, compile) -> None:
        if func not in self._jobs:
            if self._began is None:
                self._began = time.perf_counter()
            self._jobs[func] = self._pool.submit(_compile_into, path, compile, text, func, arch)

    def finish(self) -> tuple[int, float]:
        """Waits for every compile; (variants compiled, seconds from the first submission to the last end)."""
        self._pool.shutdown(wait=True)
        done = 0
        for func, job in self._jobs.items():
            exc = job.exception()
            if exc is None:
                done += 1
            else:  # (the real run compiles it again, and reports it there)
                log.debug("compiling %s ahead failed: %s: %s", func, type(exc).__name__, exc)
        return done, 0.0 if self._began is None else time.perf_counter() - self._began

    @property
    def submitted(self) -> list[str]:
        return list(self._jobs)


def _compile_into(path: Path, compile, text: str, func: str, arch: str) -> None:
    cubin = compile(text, func, arch)
    if not cubin.startswith(cubin_cache.ELF_MAGIC):
        raise RuntimeError(f"the compile of {func} gave no cubin")
    tmp = path.with_suffix(f".tmp{os.getpid()}_{func[-8:]}")
    tmp.write_bytes(cubin)
    os.replace(tmp, path)


def threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


@contextmanager
def collecting(workers: int | None = None):
    """Within it, cached kernels' launches give zeros and their missing variants compile on `workers` threads (the
    cores this process may use, up to MAX_THREADS); on exit all have ended and count in cubin_cache.COMPILES."""
    if cubin_cache._ahead is not None:
        raise RuntimeError("a dry run is collecting already")
    ahead = Ahead(workers or threads())
    cubin_cache._ahead = ahead
    try:
        yield ahead
    finally:
        cubin_cache._ahead = None
        variants, seconds = ahead.finish()
        cubin_cache.COMPILES.variants += variants
        cubin_cache.COMPILES.seconds += seconds
