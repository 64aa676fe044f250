"""Work a request does before the engine (parsing its JSON, rendering the chat template, tokenizing, tokenizing
DRY breakers) runs on a few worker threads, never on the event loop.

A prompt of many megabytes takes seconds to tokenize; on the event loop that froze /health and every stream
for as long. The tokenizer releases the GIL while it works and a template yields it every few milliseconds, so
the event loop and the engine thread keep going. A small pool (`WORKERS` threads) bounds how many such jobs run
at once; more wait their turn.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

WORKERS = 4


class Offload:
    def __init__(self, workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mlxcel-prepare")

    async def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on a worker thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
