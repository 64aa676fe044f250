"""Tool calling with the real SmolLM2-135M-Instruct, whose chat template does not render tools (an unknown family:
calls are read in the Hermes format): tool_choice "required" still gives a valid call of a known tool, streamed
and not, and the call and its result go back through the template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from servers import start_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}}
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    running = start_server(smollm2_gguf, max_batch_size=2, warmup=False)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_required_call_round_trip(client, server):
    kw = {"model": server.model_id, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    r = client.chat.completions.create(messages=MESSAGES, max_tokens=60, temperature=0, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    streamed = client.chat.completions.create(messages=MESSAGES, max_tokens=60, temperature=0, stream=True, **kw)
    arguments, finish = "", None
    for chunk in streamed:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and arguments == call.function.arguments

    messages = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    again = client.chat.completions.create(model=server.model_id, messages=messages, tools=TOOLS, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
