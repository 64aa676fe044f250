"""A constrained step's host work beside the submission of its forward.

A constrained row's mask needs the row's previous token, which lookahead leaves unread until the step's forward is
on its way. Submitting that forward is itself host work (MLX encodes the step's graph; it releases the GIL while it
does), so the engine's thread hands the rest to one worker thread first: read the earlier steps, advance the rows'
grammars, compute the packed masks. The two overlap; the engine's thread then waits for the masks and submits the
masked sampling. Where a batch's step is host-bound (a small model's batch on a GPU), the mask's host time is then
hidden instead of added.

The worker builds no MLX graph: it only waits for arrays already submitted (the earlier steps' readouts) and does
host work. What ending a row would submit (freeing its storage: prefix-cache snapshots, state copies) is deferred to
the engine's thread (`Engine._end`), so that one thread submits to MLX at a time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, TypeVar

T = TypeVar("T")


class MaskWorker:
    """One thread that runs a step's host work while the engine's thread submits the step's forward."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-masks")

    def beside(self, work: Callable[[], T], submit: Callable[[], None]) -> T:
        """work()'s result, work having run on the worker while submit() ran here. work's error is raised here, after
        submit has returned (submit's own error first, once work has finished: nothing it touches is left in use)."""
        pending = self._pool.submit(work)
        try:
            submit()
        except BaseException:
            wait([pending])
            raise
        return pending.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
