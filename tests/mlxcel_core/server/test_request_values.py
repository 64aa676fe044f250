"""Request values at and past their edges, through the real app: `null` means the default (OpenAI), seed -1 is
random (llama.cpp), out-of-range seeds and malformed logit_bias keys are 400s naming the field (never 500s), DRY
sequence breakers are capped in number and length, and their tokenized forms are cached within a bound."""

from __future__ import annotations

import pytest

from mlxcel_core.engine.dry_cache import DEFAULT_MAXSIZE
from mlxcel_core.processors import DRY_MAX_BREAKER_CHARS, DRY_MAX_BREAKERS

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def error_of(response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    return error


NULLABLE = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "dry_multiplier",
    "dry_base",
    "dry_sequence_breakers",
    "xtc_probability",
    "suppress_tokens",
    "response_format",
    "user",
    "max_tokens",
]


def test_null_means_the_default(http):
    nulls = dict.fromkeys(NULLABLE)
    plain = http.post(COMPLETIONS, json={"prompt": "Hi", "temperature": 0, "max_tokens": 4})
    nulled = http.post(COMPLETIONS, json={**nulls, "prompt": "Hi", "temperature": 0, "max_tokens": 4, "logprobs": None})
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {**nulls, "messages": HI, "logprobs": None, "top_logprobs": None, "max_completion_tokens": 2}
    chat |= {"tools": None, "tool_choice": None, "parallel_tool_calls": None}
    response = http.post(CHAT, json=chat)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1  # n: null is 1
    error_of(http.post(COMPLETIONS, json={"prompt": None}), "prompt")  # a required field stays required


def test_seed_minus_one_is_random(http):
    for _ in range(2):
        response = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "seed": -1, "n": 2})
        assert response.status_code == 200, response.text
    top = 2**64 - 1  # the largest seed; its second choice wraps to 0
    assert http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "seed": top, "n": 2}).status_code == 200


@pytest.mark.parametrize("seed", ["-2", str(-(2**63)), str(2**64), "1e30", "1.5"])
def test_bad_seeds_are_400(http, seed):
    body = b'{"prompt": "Hi", "max_tokens": 1, "seed": %s}' % seed.encode()
    error_of(http.post(COMPLETIONS, content=body), "seed")


def test_a_number_too_long_for_the_json_parser_is_400(http):
    body = b'{"prompt": "Hi", "max_tokens": 1, "seed": %s}' % (b"9" * 5000)
    response = http.post(COMPLETIONS, content=body)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("key", ["\u00b2", "--5", "9" * 5000, " 5", "+5", "\u0663", "5.0", "", "-0"])
def test_logit_bias_keys_that_are_not_token_ids_are_400(http, key):
    error = error_of(
        http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, "logit_bias": {key: 1}}), "logit_bias"
    )
    assert len(error["message"]) < 200


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2**64),
        ("repeat_last_n", 10**30),
        ("dry_allowed_length", 2**63),
        ("dry_penalty_last_n", 2**64),
        ("temperature", 1e30),
        ("repeat_penalty", 1e30),
        ("dry_base", 1e30),
        ("dry_multiplier", 1e30),
        ("top_p", 5e-324),
    ],
)
def test_huge_and_tiny_numbers_are_answered(http, field, value):
    """Numbers in range but extreme: an answer (the sampler clamps what it must), never a 500."""
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    if field.startswith("dry_") and field != "dry_multiplier":
        body["dry_multiplier"] = 0.8
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 2**64), ("n", 2**64), ("logprobs", 10**30), ("suppress_tokens", [2**64])]
)
def test_out_of_range_integers_are_400(http, field, value):
    response = http.post(COMPLETIONS, json={"prompt": "Hi", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_dry_breakers_are_capped(http):
    body = {"prompt": "Hi", "max_tokens": 2, "dry_multiplier": 0.8}
    most = [f"{i:02d}" + "x" * (DRY_MAX_BREAKER_CHARS - 2) for i in range(DRY_MAX_BREAKERS)]
    assert http.post(COMPLETIONS, json={**body, "dry_sequence_breakers": most}).status_code == 200
    error = error_of(
        http.post(COMPLETIONS, json={**body, "dry_sequence_breakers": most + ["y"]}), "dry_sequence_breakers"
    )
    assert str(DRY_MAX_BREAKERS) in error["message"]
    too_long = ["z" * (DRY_MAX_BREAKER_CHARS + 1)]
    error = error_of(
        http.post(CHAT, json={**body, "messages": HI, "dry_sequence_breakers": too_long}), "dry_sequence_breakers"
    )
    assert str(DRY_MAX_BREAKER_CHARS) in error["message"]


def test_dry_breaker_sets_are_cached_within_a_bound(http, server):
    cache = server.state.engine.dry_cache
    for i in range(DEFAULT_MAXSIZE + 8):
        body = {"prompt": "Hi", "max_tokens": 1, "dry_multiplier": 0.8, "dry_sequence_breakers": [f"<{i}>"]}
        assert http.post(COMPLETIONS, json=body).status_code == 200
        assert len(cache) <= DEFAULT_MAXSIZE
    assert len(cache) == DEFAULT_MAXSIZE
