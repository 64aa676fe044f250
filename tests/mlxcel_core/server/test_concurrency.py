"""Many clients at once, disconnects, metrics, health, and failures that stay with their own request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import httpx
import pytest

from mlxcel_core.server import app as app_module

COMPLETIONS = "/v1/completions"
PROMPTS = [f"Request {i}: the capital of France is" if i % 2 else f"Hello world {i} times" for i in range(32)]
NO_EOS = {"2": -100}


async def _stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str | None, bool]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    text, finish, done = [], None, False
    async with client.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            choice = json.loads(data)["choices"][0]
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(text), finish, done


async def _run_concurrently(url: str, prompts: list[str], max_tokens: int):
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0), limits=limits) as client:
        jobs = [_stream_one(client, p, max_tokens) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=180)


def test_32_concurrent_streams_equal_one_at_a_time(server):
    started = time.perf_counter()
    together = asyncio.run(_run_concurrently(server.url, PROMPTS, 10))
    elapsed = time.perf_counter() - started
    assert all(done for _, _, done in together), "every stream ends with [DONE]"
    assert all(finish == "length" for _, finish, _ in together)
    with server.client() as http:
        for prompt, (text, _, _) in zip(PROMPTS, together):
            solo = http.post(
                COMPLETIONS, json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "logit_bias": NO_EOS}
            ).json()
            assert solo["choices"][0]["text"] == text, prompt
    metrics = server.metrics()
    assert metrics["mlxcel_request_ttft_seconds_count"] >= 64
    assert metrics["llamacpp:requests_processing"] == 0
    print(f"32 streams x 10 tokens in {elapsed:.2f}s")


def test_a_failed_engine_step_fails_its_requests_then_a_fresh_engine_serves(make_server):
    server = make_server(max_batch_size=2)
    loop = server.state.engine
    broken = loop.engine

    def broken_step():
        raise RuntimeError("transient")

    broken.step = broken_step
    with server.client() as http:
        response = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3, "stream": True})
        events = [line for line in response.iter_lines() if line]
        assert "transient" in json.loads(events[-2][len("data: ") :])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        server.wait_for(lambda: loop.engine is not broken, 10, "a fresh engine")
        ok = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        assert http.get("/health").status_code == 200


@pytest.fixture
def special_processors(monkeypatch):
    """presence_penalty 1.25: a logits processor that raises after 3 tokens; 1.5: one that takes 20 ms a token
    (a big model's pace, so a test can leave mid-stream for sure)."""
    real = app_module.sampling_params

    def make(body, **kw):
        params = real(body, **kw)
        if body.presence_penalty not in (1.25, 1.5):
            return params

        def special(tokens, logits):
            if body.presence_penalty == 1.5:
                time.sleep(0.02)
            elif len(tokens) > kw["prompt_len"] + 3:
                raise ValueError("processor exploded")
            return logits

        return dataclasses.replace(params, logits_processors=params.logits_processors + (special,))

    monkeypatch.setattr(app_module, "sampling_params", make)


def _kv_idle(server) -> bool:
    m = server.metrics()
    return m["llamacpp:requests_processing"] == 0 and m["mlxcel_kv_blocks_used"] == 0


def test_client_disconnect_mid_stream_frees_its_blocks(server, special_processors):
    server.wait_for(lambda: _kv_idle(server), 10, "an idle engine")
    cancelled = server.metrics().get('mlxcel_requests_total{finish_reason="cancelled"}', 0)
    body = {
        "prompt": "Tell me a long story",
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
        "logit_bias": NO_EOS,
        "presence_penalty": 1.5,
    }  # 2 s of generation
    with server.client() as http:
        with http.stream("POST", COMPLETIONS, json=body) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert server.metrics()["mlxcel_kv_blocks_used"] > 0  # the row holds blocks while it runs
        # leaving the block closes the connection mid-stream
    server.wait_for(lambda: _kv_idle(server), 10, "the cancelled row's blocks to be freed")
    assert server.metrics()['mlxcel_requests_total{finish_reason="cancelled"}'] == cancelled + 1


def test_client_timeout_on_a_whole_request_cancels_it(server, special_processors, caplog):
    caplog.set_level("ERROR", logger="mlxcel.server")
    server.wait_for(lambda: _kv_idle(server), 10, "an idle engine")
    before = server.metrics().get('mlxcel_requests_total{finish_reason="cancelled"}', 0)
    body = {
        "prompt": "Tell me a long story",
        "max_tokens": 100,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "presence_penalty": 1.5,
    }  # 2 s of generation
    with server.client(timeout=httpx.Timeout(0.3, connect=5.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(COMPLETIONS, json=body)
    server.wait_for(
        lambda: server.metrics().get('mlxcel_requests_total{finish_reason="cancelled"}', 0) == before + 1,
        10,
        "the abandoned request to be cancelled",
    )
    server.wait_for(lambda: _kv_idle(server), 10, "its blocks to be freed")
    assert not [r.getMessage() for r in caplog.records if r.name == "mlxcel.server"]  # a goodbye, not an error


def test_metrics_parse_and_have_the_documented_names(server):
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
        response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted", "mlxcel_prefix_cache_hits"):
        assert families[name].type == "counter"
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "mlxcel_queue_depth",
        "mlxcel_batch_size",
        "mlxcel_kv_blocks_used",
        "mlxcel_kv_blocks_free",
    ):
        assert families[name].type == "gauge"
    for name in ("mlxcel_request_ttft_seconds", "mlxcel_request_decode_tokens_per_second"):
        assert families[name].type == "histogram"
    samples = server.metrics()
    assert samples["llamacpp:prompt_tokens_total"] > 0 and samples["llamacpp:tokens_predicted_total"] > 0
    assert samples["mlxcel_kv_blocks_free"] > 0


def test_health_is_503_while_loading_then_ok(make_server, tiny_llama_dir):
    from mlxcel_core.loading import load_model

    release = threading.Event()

    def slow_load():
        assert release.wait(30)
        return load_model(str(tiny_llama_dir), log=lambda m: None)

    server = make_server(load=slow_load, wait_ready=False)
    with server.client() as http:
        response = http.get("/health")
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "Loading model"
        assert response.json()["error"]["type"] == "unavailable_error"
        assert http.post(COMPLETIONS, json={"prompt": "x"}).status_code == 503
        release.set()
        server.wait_for(lambda: http.get("/health").status_code == 200, 30, "the model to load")
        assert http.get("/health").json() == {"status": "ok"}


def test_health_follows_the_engine_thread(make_server):
    server = make_server(max_batch_size=2)
    loop = server.state.engine
    loop.max_failures = 1

    def broken_step():
        raise RuntimeError("device lost")

    loop.engine.step = broken_step
    with server.client() as http:
        response = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 500 and "device lost" in response.json()["error"]["message"]
        server.wait_for(lambda: http.get("/health").status_code == 503, 10, "health to report the dead engine")
        assert "device lost" in http.get("/health").json()["error"]["message"]
        assert http.post(COMPLETIONS, json={"prompt": "x"}).status_code == 503


def test_one_failing_request_does_not_affect_the_others(server, special_processors):
    good = {"prompt": "Hello", "max_tokens": 20, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    bad = {**good, "presence_penalty": 1.25}
    results = {}

    def run(name, body):
        with server.client() as http, http.stream("POST", COMPLETIONS, json=body) as response:
            results[name] = [line for line in response.iter_lines() if line]

    threads = [threading.Thread(target=run, args=(n, b)) for n, b in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["bad"][-1] == "data: [DONE]"
    error = json.loads(results["bad"][-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "processor exploded" in error["message"]
    assert results["good"][-1] == "data: [DONE]"
    assert json.loads(results["good"][-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    with server.client() as http:  # whole (non-streamed) requests get a 500 envelope
        response = http.post(COMPLETIONS, json={**bad, "stream": False})
        assert response.status_code == 500 and "processor exploded" in response.json()["error"]["message"]
        assert http.post(COMPLETIONS, json={**good, "stream": False}).status_code == 200
