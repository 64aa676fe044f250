"""Structured outputs with the real SmolLM2-135M-Instruct: 24 JSON schemas (nested objects, arrays with item bounds,
enums, bounded numbers and integers, required/optional properties, anyOf, patterns, lengths, formats) sent at once
to one server; every response finishes and validates with `jsonschema`. Schemas bound every string and number, so
outputs are short; the prompts share their first KV block (the prefix cache computes it once). The Q4_1 model runs
at a few tokens a second on a 2-core CPU: the batch takes a minute or two there."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from servers import start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model


def obj(required: list[str] | None = None, **properties) -> dict:
    """An object schema with these properties, all required unless `required` says which, nothing else allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def text(max_length: int = 16, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


def integer(low: int = 0, high: int = 100, **kw) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high, **kw}


PREAMBLE = "Reply with one short JSON value and nothing else. "  # with the template's system prompt: one shared block
SCHEMAS = {
    "person": (obj(name=text(20), age=integer(0, 120)), "Describe a person named Alice who is 30."),
    "nested": (
        obj(person=obj(name=text(), city=text()), active={"type": "boolean"}),
        "Bob lives in Paris and is active.",
    ),
    "int array": (
        {"type": "array", "items": integer(), "minItems": 2, "maxItems": 3},
        "Give two or three small numbers.",
    ),
    "enum array": (
        obj(colors={"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}),
        "List primary colors.",
    ),
    "top enum": ({"enum": ["red", "green", "blue"]}, "What color is the sky?"),
    "bounded number": (obj(celsius={"type": "number", "minimum": -50, "maximum": 50}), "Temperature in Paris?"),
    "exclusive bounds": (
        obj(rating={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
        "Rate pizza from 1 to 9.",
    ),
    "optional": (obj(["title"], title=text(12), year=integer(1900, 2030)), "A movie title."),
    "anyOf": (obj(value={"anyOf": [integer(0, 9), text(5)]}), "Give a value."),
    "pattern": (obj(code=text(7, pattern="^[A-Z]{3}-[0-9]{3}$")), "Make a product code."),
    "lengths": (obj(word=text(8, minLength=3)), "Say a word."),
    "boolean": ({"type": "boolean"}, "Is water wet?"),
    "const": (obj(version={"const": "1.0"}, ok={"type": "boolean"}), "Report status."),
    "objects array": (
        obj(points={"type": "array", "items": obj(x=integer(0, 9), y=integer(0, 9)), "minItems": 1, "maxItems": 2}),
        "Give a point.",
    ),
    "date": (obj(date={"type": "string", "format": "date"}), "When did the year 2000 start?"),
    "nullable": (obj(nickname={"type": ["string", "null"], "maxLength": 10}), "Nickname of Robert?"),
    "int enum": (obj(level={"enum": [1, 2, 3]}), "Pick a level."),
    "deep": (obj(a=obj(b=obj(c=integer(0, 9)))), "Nested value."),
    "tuple": (
        {"type": "array", "prefixItems": [text(5), integer(0, 9)], "items": False, "minItems": 2},
        "A name and a digit.",
    ),
    "five fields": (
        obj(
            id=integer(1, 999),
            name=text(12),
            tags={"type": "array", "items": text(8), "maxItems": 2},
            score={"type": "number", "minimum": 0, "maximum": 1},
            done={"type": "boolean"},
        ),
        "A task record.",
    ),
    "shapes anyOf": (
        {
            "anyOf": [
                obj(kind={"const": "circle"}, radius={"type": "number", "minimum": 0, "maximum": 10}),
                obj(kind={"const": "square"}, side=integer(0, 10)),
            ]
        },
        "Describe a circle.",
    ),
    "probability": (obj(p={"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}), "Chance of rain?"),
    "multipleOf": (obj(minutes=integer(0, 60, multipleOf=5)), "Minutes until lunch?"),
    "id list": (
        obj(ids={"type": "array", "items": integer(0, 99), "minItems": 1, "maxItems": 4}),
        "Some ids.",
    ),
}


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    running = start_server(smollm2_gguf, max_batch_size=8, max_queue_depth=32, warmup=False)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=900, max_retries=0)


def ask(client, server, name: str):
    schema, prompt = SCHEMAS[name]
    r = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": PREAMBLE + prompt}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        max_tokens=96,
        temperature=0,
    )
    return r.choices[0]


def test_every_schema_response_validates(client, server):
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = dict(zip(SCHEMAS, pool.map(lambda name: ask(client, server, name), SCHEMAS)))
    failures = []
    for name, choice in choices.items():
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][0])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {choice.message.content!r}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)
    capital: bool
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_openai_parse_with_the_real_model(client, server):
    completion = client.chat.completions.parse(
        model=server.model_id,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_completion_tokens=96,
        temperature=0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.continent == "Europe"
