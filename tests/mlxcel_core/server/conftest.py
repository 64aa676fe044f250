"""Fixtures for the server tests: the shared tiny-Llama server and a factory for servers with other settings
(tests/servers.py starts them)."""

from __future__ import annotations

import pytest
from servers import RunningServer, start_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """The shared server: tiny Llama, batch 8, context capped at 128 tokens, n up to 4."""
    running = start_server(tiny_llama_dir, max_batch_size=8, ctx_size=128, max_n=4)
    yield running
    running.stop()


@pytest.fixture
def make_server(tiny_llama_dir):
    """Start extra servers with other settings (stopped at the end of the test)."""
    started: list[RunningServer] = []

    def make(**kw) -> RunningServer:
        running = start_server(kw.pop("model_dir", tiny_llama_dir), **kw)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
