"""Concurrent requests through `mlxcel serve` on a model with recurrent layers and its prefix cache: prompts that
arrive together are prefilled together up to their state-snapshot stops and their rests together where they line up
(engine/scheduler.py), and every reply is the one a server without a prefix cache gives, one prompt at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from recurrent_tiny import save_tiny_recurrent
from servers import start_server

from mlxcel_core.engine import EngineConfig

COMPLETIONS = "/v1/completions"
NO_EOS = {"2": -100}
BASE = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid. "
PROMPTS = [BASE * 2 + "And Germany?", BASE * 3 + "Name three rivers.", BASE + "Hello world! " * 6]


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return save_tiny_recurrent(tmp_path_factory.mktemp("qwen3_5-together") / "model", "qwen3_5")


def complete(server, prompt: str, n: int = 1) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logit_bias": NO_EOS, "n": n}
    # without the warm-up, a first request on CUDA also compiles the kernels (a minute, beside other test workers)
    with server.client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
        r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return [choice["text"] for choice in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_concurrent_requests_prefill_together_and_answer_as_alone(qwen3_5_dir):
    config = EngineConfig(max_batch_size=8, prefill_batch_size=8, prefill_chunk_size=512)
    server = start_server(qwen3_5_dir, engine=config, warmup=False)
    try:
        engine = server.state.engine.engine
        runner, rows = engine.runner, []
        together = runner.prefill_together
        runner.prefill_together = lambda *args: rows.append((len(args[0]), args[3])) or together(*args)
        # n = 3: three sequences of one prompt, submitted at once: their chunks to the stop go in one forward, and
        # their rests (the same positions) in another, whatever the other requests' timing.
        repeated = complete(server, PROMPTS[0], n=3)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            concurrent = list(pool.map(lambda p: complete(server, p)[0], PROMPTS))
        stats = engine.stats().storage
    finally:
        server.stop()
    assert rows[0] == (3, 0) and rows[1][0] == 3 and rows[1][1] > 0  # (rows, start)
    assert stats["state_slots_used"] == 0 and stats["state_snapshots"] >= 1

    cold = start_server(qwen3_5_dir, engine=EngineConfig(max_batch_size=1, prefix_cache=False), warmup=False)
    try:
        alone = [complete(cold, p)[0] for p in PROMPTS]
    finally:
        cold.stop()
    assert repeated == [alone[0]] * 3
    assert concurrent == alone
