"""Tool calling with a real model trained for it: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, tests/real_gguf.py), whose
chat template renders tools and teaches Hermes `<tool_call>` blocks, `<tool_call>` being a token the tokenizer holds
as text. Through the openai client: "auto" reads the call the model writes (this model leaves the tags out), "required"
and a named function force a call through the grammar (its `<tool_call>` is that one token), streamed and not, and the
call and its result go back through the template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from real_gguf import QWEN2, fetch_chunked
from servers import start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Get the current time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server():
    running = start_server(fetch_chunked(QWEN2), max_batch_size=2, warmup=False)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


def create(client, server, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=server.model_id, temperature=0, tools=TOOLS, **kw)


def streamed_call(client, server, **kw) -> tuple[str | None, str, str | None]:
    """(the streamed call's name, its arguments, the finish reason)"""
    name, arguments, finish = None, "", None
    for chunk in create(client, server, stream=True, **kw):
        for choice in chunk.choices:
            assert not choice.delta.content, choice.delta
            for delta in choice.delta.tool_calls or []:
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return name, arguments, finish


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("auto", "get_weather"),
        ("required", "get_weather"),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ],
    ids=["auto", "required", "named"],
)
def test_the_models_call_comes_back_as_a_tool_call(client, server, tool_choice, expected):
    choice = create(client, server, messages=MESSAGES, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == expected and not choice.message.content
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[expected])
    assert streamed_call(client, server, messages=MESSAGES, tool_choice=tool_choice) == (
        expected,
        call.function.arguments,
        "tool_calls",
    )


def test_the_call_and_its_result_go_back_through_the_template(client, server):
    first = create(client, server, messages=MESSAGES, tool_choice="required")
    call = first.choices[0].message
    forecast = "light rain in the morning, sunny spells from noon, a fresh breeze from the west in the evening"
    result = json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy", "forecast": forecast})
    messages = [
        *MESSAGES,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": result},
    ]
    second = create(client, server, messages=messages, max_tokens=1)
    added = second.usage.prompt_tokens - first.usage.prompt_tokens
    # the call (~30 tokens) and the result (~50) were rendered: more than the call alone could add
    assert added > 30 + len(result) // 4, added
