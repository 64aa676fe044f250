"""How an engine hands a step's graph to MLX: inline (`mx.async_eval` on the engine's thread) or on a launcher
thread (MLXCEL_LAUNCH_THREAD=1, opt-in: on the H200 it won at 1B bf16 and lost at 1B 4-bit, by less than the
runs' spread; benchmarks/RESULTS.md, fourteenth session).

A batch-1 decode step on a fast GPU is bound by the host: most of a small model's step is `mx.async_eval` itself
(MLX encoding every kernel into CUDA graphs), the rest is Python building the next step's graph. async_eval releases
the GIL, so a launcher thread can encode step k while the engine's thread builds step k + 1.

MLX 0.32's streams belong to the thread that made them, so a threaded engine puts all its work on one
`mx.new_thread_unsafe_stream`, and keeps two threads off it at once: the engine's thread evaluates nothing (reads
no token, runs no prefill eval) until `wait()` says the launcher is idle. It therefore reads a step's tokens two
steps later (lookahead 2) where the inline engine reads them one step later. Nor can the launcher thread run an op
still lazy on another thread's stream (benchmarks/thread_streams.py): a threaded engine first evaluates every array
the model holds (`settle`).

The launcher needs the GIL for a few microseconds to start and to finish each launch, while the engine's thread
holds it building the next step. At CPython's default switch interval (5 ms) the launcher would only get it when
the engine's thread blocks, i.e. after the build, and nothing would overlap: a ThreadLauncher lowers the process's
switch interval to SWITCH_INTERVAL_S (benchmarks/gil_handoff.py: 0.4 ms of Python beside a 1 ms GIL-free call took
1.51 ms a step at 5 ms and 1.20 ms at 20 us, on the 2-core development VM).
"""

from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import mlx.core as mx
from mlx.utils import tree_flatten

ENV = "MLXCEL_LAUNCH_THREAD"
SWITCH_INTERVAL_S = 20e-6  # how long a thread waiting for the GIL lets the holder run before asking for it


def launch_thread_requested() -> bool:
    return os.environ.get(ENV, "").strip() == "1"


class Launcher(Protocol):
    def stream(self) -> contextlib.AbstractContextManager: ...
    def submit(self, arrays: list[mx.array]) -> None: ...
    def wait(self) -> None: ...


class InlineLauncher:
    """Steps are submitted on the engine's own thread; tokens are read one step later."""

    def stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def submit(self, arrays: list[mx.array]) -> None:
        mx.async_eval(arrays)

    def wait(self) -> None:
        """The engine's thread may evaluate (nothing runs elsewhere)."""


class ThreadLauncher:
    """Steps are submitted (mx.async_eval) on one worker thread, in order, on a stream any thread may use; tokens
    are read two steps later."""

    def __init__(self, device: mx.Device | None = None):
        self._stream, self._pool = _stream_and_thread(device or mx.default_device())
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._pending: Future | None = None

    def stream(self) -> contextlib.AbstractContextManager:
        """Where the engine builds its graphs (every op of a step on the launcher's stream)."""
        return mx.stream(self._stream)

    def submit(self, arrays: list[mx.array]) -> None:
        self.wait()
        if arrays:  # (an eval of nothing would still make the worker a stream of its own)
            self._pending = self._pool.submit(self._launch, arrays)

    def _launch(self, arrays: list[mx.array]) -> None:  # on the worker thread
        mx.async_eval(arrays)

    def wait(self) -> None:
        """Block until the last submitted step is encoded: the stream is then the engine thread's alone. A launch
        that failed raises here, on the engine's thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def settle(model) -> None:
    """Evaluate every array the model holds, its private ones too (a RoPE's scaled frequencies): one made lazily
    when the model was built is an op on that thread's default stream, which the launcher thread cannot run (MLX
    0.32: "There is no Stream(gpu, 0) in current thread", the Llama-3.2-1B shape on the H200)."""
    mx.eval([leaf for _, leaf in tree_flatten(model) if isinstance(leaf, mx.array)])


_STREAMS: dict[str, tuple[mx.Stream, ThreadPoolExecutor]] = {}


def _stream_and_thread(device: mx.Device) -> tuple[mx.Stream, ThreadPoolExecutor]:
    """One launcher stream and thread per device for the process: compiled decode traces are the model's, shared
    by its engines, and MLX traces again for a step built on another stream (inside a new engine's first request).
    Engines stepped from several threads at once would share them unsafely; mlxcel steps one engine per process."""
    key = str(device)
    if key not in _STREAMS:
        _STREAMS[key] = (mx.new_thread_unsafe_stream(device), ThreadPoolExecutor(1, thread_name_prefix="mlxcel-launch"))
    return _STREAMS[key]


def make_launcher(threaded: bool) -> Launcher:
    return ThreadLauncher() if threaded else InlineLauncher()
