"""A chat's second turn through `mlxcel serve` on a model with recurrent layers (engine/state_snapshots.py): the prefix
cache serves the first turn's prefix, the server computes only the rest (llamacpp:prompt_tokens), /metrics shows the
reuse and the snapshots held, and the reply is the one a server without a prefix cache gives."""

from __future__ import annotations

import pytest
from recurrent_tiny import save_tiny_recurrent
from servers import start_server

from mlxcel_core.engine import EngineConfig

SYSTEM = "You answer in one short sentence. The capital of France is Paris. The capital of Italy is Rome. " * 2


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return save_tiny_recurrent(tmp_path_factory.mktemp("qwen3_5-serve") / "model", "qwen3_5")


def chat(server, messages: list[dict]) -> dict:
    with server.client() as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": server.model_id, "messages": messages, "max_tokens": 12, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    return r.json()


def test_second_chat_turn_reuses_the_first(qwen3_5_dir):
    first_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world!"}]
    server = start_server(qwen3_5_dir, max_batch_size=2)
    try:
        first = chat(server, first_messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second_messages = first_messages + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And Italy?"},
        ]
        before = server.metrics()
        second = chat(server, second_messages)
        after = server.metrics()
    finally:
        server.stop()
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32 and cached % 32 == 0  # whole 32-token blocks, up to a kept state
    assert (
        after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
        == usage["prompt_tokens"] - cached
    )
    assert after["mlxcel_prefix_cache_hits_total"] - before["mlxcel_prefix_cache_hits_total"] == 1
    assert after["mlxcel_prefix_cache_tokens_total"] - before["mlxcel_prefix_cache_tokens_total"] == cached
    assert after["mlxcel_state_snapshots"] >= 1 and after["mlxcel_state_snapshot_bytes"] > 0

    cold = start_server(qwen3_5_dir, engine=EngineConfig(max_batch_size=2, prefix_cache=False))
    try:
        assert chat(cold, second_messages)["choices"][0]["message"] == second["choices"][0]["message"]
        assert "mlxcel_state_snapshots" not in cold.metrics() or cold.metrics()["mlxcel_state_snapshots"] == 0
    finally:
        cold.stop()


def test_a_request_without_max_tokens_fits_the_budget_with_its_state(qwen3_5_dir):
    """The served context leaves room for a sequence's recurrent state: a chat without max_tokens (which asks for the
    whole context) is admitted, not refused for needing the budget plus the state."""
    server = start_server(qwen3_5_dir, engine=EngineConfig(max_batch_size=1, kv_budget_tokens=160))
    try:
        with server.client() as client:
            r = client.post(
                "/v1/chat/completions",
                json={"model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0},
            )
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
