"""Client mistakes get the OpenAI error envelope with the right status, type and param (never a 500)."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def error_of(response: httpx.Response, status: int, param=None, type_=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    assert error["param"] == param
    if type_ is not None:
        assert error["type"] == type_
    return error


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize"])
@pytest.mark.parametrize("body", [b"{not json", b"", b'{"prompt": "x",}', "\ufeff{}".encode()])
def test_invalid_json_is_400(http, path, body):
    error = error_of(
        http.post(path, content=body, headers={"content-type": "application/json"}), 400, type_="invalid_request_error"
    )
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null"])
def test_body_must_be_an_object(http, body):
    error_of(http.post(COMPLETIONS, content=body), 400)


WRONG_TYPES = [
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": ""}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": "big"}}, "logit_bias.5"),
    (COMPLETIONS, {"prompt": "x", "repeat_penalty": -1}, "repeat_penalty"),
    (COMPLETIONS, {"prompt": "x", "repeat_last_n": -2}, "repeat_last_n"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "dry_multiplier": -0.5}, "dry_multiplier"),
    (COMPLETIONS, {"prompt": "x", "dry_base": 0.5}, "dry_base"),
    (COMPLETIONS, {"prompt": "x", "dry_allowed_length": 0}, "dry_allowed_length"),
    (COMPLETIONS, {"prompt": "x", "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    (COMPLETIONS, {"prompt": "x", "dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers"),
    (COMPLETIONS, {"prompt": "x", "dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    (COMPLETIONS, {"prompt": "x", "xtc_threshold": 1.5}, "xtc_threshold"),
    (CHAT, {"messages": HI, "xtc_probability": -0.1}, "xtc_probability"),
    (CHAT, {"messages": HI, "suppress_tokens": ["a"]}, "suppress_tokens[0]"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (CHAT, {"messages": HI, "logprobs": 2}, "logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": HI, "model": 3}, "model"),
]


@pytest.mark.parametrize("path,body,param", WRONG_TYPES, ids=[f"{p}-{b}" for p, b, _ in WRONG_TYPES])
def test_wrong_types_name_the_param(http, path, body, param):
    error = error_of(http.post(path, json=body), 400, param, "invalid_request_error")
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_non_finite_numbers_are_400(http):
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        error_of(http.post(COMPLETIONS, content=b'{"prompt": "x", "temperature": %s}' % value), 400, "temperature")


@pytest.mark.parametrize(
    "path,body,field",
    [
        (COMPLETIONS, {"prompt": "x"}, "max_tokens"),
        (CHAT, {"messages": HI}, "max_tokens"),
        (CHAT, {"messages": HI}, "max_completion_tokens"),
    ],
)
def test_max_tokens_below_one_is_400(http, path, body, field):
    for value in (0, -3):
        error_of(http.post(path, json={**body, field: value}), 400, field)


def test_max_tokens_beyond_the_context_is_400(http, server):
    ctx = server.state.engine.max_context
    error = error_of(
        http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": ctx}),
        400,
        "max_tokens",
        "exceed_context_size_error",
    )
    assert error["n_ctx"] == ctx and error["n_prompt_tokens"] > 0
    error_of(http.post(CHAT, json={"messages": HI, "max_completion_tokens": 10_000}), 400, "max_completion_tokens")
    # streamed requests fail the same way, before any event is sent
    error_of(http.post(CHAT, json={"messages": HI, "max_tokens": 10_000, "stream": True}), 400, "max_tokens")


def test_prompt_longer_than_the_context_is_400(http, server):
    ctx = server.state.engine.max_context
    error = error_of(
        http.post(COMPLETIONS, json={"prompt": [5] * (ctx + 10), "max_tokens": 1}),
        400,
        "prompt",
        "exceed_context_size_error",
    )
    assert error["n_prompt_tokens"] == ctx + 10 and error["n_ctx"] == ctx
    long_text = "The capital of France is Paris. " * 40
    error_of(
        http.post(CHAT, json={"messages": [{"role": "user", "content": long_text}], "stream": True}),
        400,
        "messages",
        "exceed_context_size_error",
    )


def test_empty_prompts_and_messages_are_400(http):
    error_of(http.post(CHAT, json={"messages": []}), 400, "messages")
    error_of(http.post(COMPLETIONS, json={"prompt": ""}), 400, "prompt")
    error_of(http.post(COMPLETIONS, json={"prompt": []}), 400, "prompt")
    error_of(http.post(COMPLETIONS, json={"prompt": ["a", "b"]}), 400, "prompt")  # batches are not supported


def test_unknown_model_is_404(http):
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": HI})):
        error = error_of(http.post(path, json={**body, "model": "gpt-17"}), 404, "model", "not_found_error")
        assert error["message"] == "The model `gpt-17` does not exist."


def test_n_above_max_n_is_400(http):
    error = error_of(http.post(COMPLETIONS, json={"prompt": "x", "n": 5, "max_tokens": 1}), 400, "n")
    assert "4" in error["message"]
    error_of(http.post(COMPLETIONS, json={"prompt": "x", "n": 0}), 400, "n")


def test_sampler_knobs_checked_against_the_model_are_400(http):
    error_of(http.post(COMPLETIONS, json={"prompt": "x", "suppress_tokens": [3, 99999]}), 400, "suppress_tokens")
    error = error_of(
        http.post(COMPLETIONS, json={"prompt": "x", "repeat_penalty": 1.1, "repetition_penalty": 1.2}),
        400,
        "repeat_penalty",
    )
    assert "same setting" in error["message"]


@pytest.mark.parametrize("bias", [{"abc": 1}, {"99999": 1}, {"-1": 5}, {"5": 101}])
def test_bad_logit_bias_is_400(http, bias):
    error_of(http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1, "logit_bias": bias}), 400, "logit_bias")


def test_out_of_vocabulary_token_ids_are_400(http):
    error_of(http.post(COMPLETIONS, json={"prompt": [1, 2, 99999], "max_tokens": 1}), 400, "prompt")
    error_of(http.post("/detokenize", json={"tokens": [1, -4]}), 400, "tokens")


def test_unsupported_features_are_400(http):
    error_of(http.post(COMPLETIONS, json={"prompt": "x", "echo": True}), 400, "echo")
    error_of(http.post(CHAT, json={"messages": HI, "tools": [{"type": "function"}]}), 400, "tools[0].function")
    unsupported_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    error_of(http.post(CHAT, json={"messages": HI, "response_format": unsupported_schema}), 400, "response_format")
    error_of(http.post(CHAT, json={"messages": HI, "top_logprobs": 2}), 400, "top_logprobs")
    error_of(
        http.post(CHAT, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        400,
        "messages[0].content[0]",
    )


def test_unknown_routes_and_methods_use_the_envelope(http):
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get(COMPLETIONS), 405)


def test_text_content_parts_and_unknown_fields_are_accepted(http):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 2,
        "user": "someone",
        "frequency_penalty": 0.5,
        "some_future_field": {"x": 1},
    }
    assert http.post(CHAT, json=body).status_code == 200


def test_api_key(make_server):
    server = make_server(api_key="sekrit", max_batch_size=2)
    with server.client() as http:
        assert http.get("/health").status_code == 200  # open: load balancers probe it
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "sekrit"},
            {"Authorization": "Basic sekrit"},
        ):
            for method, path in (
                ("POST", COMPLETIONS),
                ("POST", CHAT),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("POST", "/tokenize"),
            ):
                response = http.request(method, path, json={"prompt": "x", "content": "x"}, headers=headers)
                error_of(response, 401, type_="authentication_error")
        ok = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200, ok.text


def test_queue_full_is_503(make_server):
    server = make_server(max_batch_size=1, max_queue_depth=1)
    long = {"prompt": "x", "max_tokens": 120, "stream": True, "logit_bias": {"2": -100}}
    with server.client() as a, server.client() as b, server.client() as c:
        with a.stream("POST", COMPLETIONS, json=long) as running, b.stream("POST", COMPLETIONS, json=long) as waiting:
            assert running.status_code == waiting.status_code == 200
            error = error_of(c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}), 503, type_="unavailable_error")
            assert "busy" in error["message"]
            # n counts: two more sequences can never fit beside the running one
        assert server.metrics()["mlxcel_requests_rejected_total"] >= 1
        server.wait_for(
            lambda: c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}).status_code == 200,
            10,
            "the queue to drain",
        )
        error_of(c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1, "n": 3}), 503)


def test_stream_chunks_are_valid_json_then_done(http):
    with http.stream("POST", COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ") and "choices" in json.loads(event[len("data: ") :])
