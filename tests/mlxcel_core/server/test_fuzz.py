"""Schemathesis fuzzes every route of /openapi.json against the real server (tiny Llama, context 128): bodies that
fit the documented schemas and bodies that break them. No reply is a 5xx, every 4xx is the OpenAI error envelope,
and no stream carries a server error event. A bounded number of examples per route keeps it CI-sized."""

from __future__ import annotations

import json

import pytest

schemathesis = pytest.importorskip("schemathesis")  # (the test extra has it; the H200 image does not)
from hypothesis import HealthCheck, settings  # noqa: E402
from servers import start_server  # noqa: E402

EXAMPLES_PER_ROUTE = 20


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """The fuzzed server: the shared one's settings with a 48-token context and n up to 2, so that the examples that
    ask for the most tokens stay cheap (what they probe is the request's handling, not long generations)."""
    running = start_server(tiny_llama_dir, max_batch_size=8, ctx_size=48, max_n=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure reproduces
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors_and_every_error_in_the_envelope(case):
    response = case.call(timeout=60)
    where = f"{case.method} {case.path} {case.body!r}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, where
        assert error["code"] == response.status_code and isinstance(error["message"], str), where
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, f"{where} -> {event}"
