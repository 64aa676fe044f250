"""response_format on /v1/chat/completions and /v1/completions (tiny random Llama): JSON schemas and JSON objects
constrain the output (whole or streamed), the openai client's `chat.completions.parse` works with a pydantic model,
and a bad schema is a 400 naming response_format."""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from mlxcel_core.constraints import Constraint, grammar_of  # noqa: E402
from mlxcel_core.engine import constrained  # noqa: E402
from mlxcel_core.loading.hf import read_config  # noqa: E402
from mlxcel_core.tokenizer import load_hf_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Answer in JSON"}]


class Answer(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=9)
    color: Literal["red", "green"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_hf_tokenizer(tiny_llama_dir, read_config(tiny_llama_dir))


def grammar_takes(tokenizer, constraint: Constraint, text: str) -> bool:
    """The text is a prefix of some output the constraint allows (an output cut short by max_tokens)."""
    import llguidance

    ll_tokenizer = constrained.prepare(tokenizer, tokenizer.vocab_size).result()
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(constraint), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids)


def test_chat_json_schema_output_validates(client, server):
    r = client.chat.completions.create(
        model=server.model_id, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT, max_tokens=60, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_sampled_choices_all_validate(client, server):
    r = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        response_format=JSON_SCHEMA_FORMAT,
        max_tokens=60,
        temperature=1.0,
        seed=3,
        n=4,
    )
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_output_equals_whole_output(client, server):
    kw = dict(
        model=server.model_id, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT, max_tokens=60, temperature=0
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_completions_take_response_format(server, tokenizer):
    with server.client() as http:
        r = http.post(
            "/v1/completions",
            json={"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "response_format": {"type": "json_object"}},
        )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{") and grammar_takes(tokenizer, Constraint.json_object(), text)


def test_text_format_is_unconstrained(client, server):
    kw = dict(model=server.model_id, messages=MESSAGES, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    text = client.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content
    assert text == plain


def test_openai_parse_with_a_pydantic_model(client, server):
    completion = client.chat.completions.parse(
        model=server.model_id, messages=MESSAGES, response_format=Answer, max_completion_tokens=60, temperature=0
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Answer)
    assert message.parsed == Answer.model_validate_json(message.content)


@pytest.mark.parametrize(
    "response_format,needle",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}, '["not"]'),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "bogus", "type": "string"}}},
            "bogus",
        ),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "false"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_bad_schemas_are_400s_naming_response_format(server, route, response_format, needle):
    body = {"max_tokens": 4, "response_format": response_format}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "Hi"})
    with server.client() as http:
        r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and needle in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_schemas_rows_are_cancelled(server, stream):
    """The schema's grammar is checked while the request's rows open (beside their prefill): a refused request leaves
    no row running and no KV block held, and the next request is served."""
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "number", "minimum": 9, "maximum": 1}},
    }
    body = {"messages": MESSAGES, "max_tokens": 8, "n": 2, "stream": stream, "response_format": bad}
    with server.client() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "minimum" in r.json()["error"]["message"], r.text
        for _ in range(100):
            metrics = http.get("/metrics").text
            if "\nllamacpp:requests_processing 0.0" in metrics and "\nmlxcel_kv_blocks_used 0.0" in metrics:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(metrics)
        good = dict(body, response_format=JSON_SCHEMA_FORMAT, stream=False, n=1)
        assert http.post("/v1/chat/completions", json=good).status_code == 200


def test_an_unknown_type_is_a_400(server):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_end_finishes_its_choice_with_error(client, server, tokenizer, stream):
    """A grammar whose every token is suppressed: a 200 whose choice ends with finish_reason "error" and an error
    message beside it (streamed: the last chunk), and the server goes on."""
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    body = {
        "prompt": "Hi",
        "max_tokens": 4,
        "temperature": 0,
        "suppress_tokens": [x],
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "xxxx"}}},
        "stream": stream,
    }
    with server.client() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        choice = chunks[-1]["choices"][0]
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error"
    assert "does not match the JSON schema" in choice["error"]["message"]
    again = client.chat.completions.create(
        model=server.model_id, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT, max_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(again.choices[0].message.content), SCHEMA)


def test_a_batch_on_the_mask_worker(server, make_server, monkeypatch):
    """With a constrained step's host work on the mask worker (engine/mask_worker.py; the default on a GPU), concurrent
    constrained and free requests share batches: every constrained reply validates and every free reply is the one a
    server without the worker gives."""
    from concurrent.futures import ThreadPoolExecutor

    from mlxcel_core import backends
    from mlxcel_core.engine.mask_worker import MaskWorker

    free = [{"prompt": f"Tell me about {topic}", "max_tokens": 16, "temperature": 0} for topic in ("tea", "rain")]
    schema = {"max_tokens": 60, "temperature": 0, "response_format": JSON_SCHEMA_FORMAT, "messages": MESSAGES}

    def send(target, body):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        with target.client(timeout=60) as http:
            r = http.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    plain = [send(server, body)["text"] for body in free]
    steps = []
    beside = MaskWorker.beside
    monkeypatch.setattr(MaskWorker, "beside", lambda self, *a: steps.append(1) or beside(self, *a))
    monkeypatch.setattr(type(backends.current()), "masks_on_worker", lambda self: True)
    on_worker = make_server(max_batch_size=8, ctx_size=128)
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda body: send(on_worker, body), [schema] * 4 + free))
    for choice in replies[:4]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert [choice["text"] for choice in replies[4:]] == plain
    assert len(steps) >= 10  # the constrained steps ran there
