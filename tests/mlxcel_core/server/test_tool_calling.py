"""Tool calling on /v1/chat/completions through the openai client (tiny random Llama with a Qwen-style Hermes
template): tool_choice "required" and a named function force a call (the output is constrained to the call format,
so a random model makes a valid one), streamed as OpenAI streams tool calls, and a round trip sends the assistant's
calls and a tool message back through the template; bad tools requests are 400s naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")

from mlxcel_core.loading.hf import read_config  # noqa: E402
from mlxcel_core.server.schemas import ChatCompletionRequest  # noqa: E402
from mlxcel_core.tokenizer import load_hf_tokenizer  # noqa: E402

# Qwen 2.5's tool template, cut down: tools in a system block, calls as <tool_call> blocks, results as <tool_response>.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny Llama with a longer context (the byte-level tokenizer spends ~1 token a character on the tools)."""
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=2048)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model_dir):
    from servers import start_server

    running = start_server(tool_model_dir, max_batch_size=4, ctx_size=2048, max_n=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def create(client, server, **kw):
    kw = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **kw}
    return client.chat.completions.create(model=server.model_id, **kw)


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    return args


def test_required_gives_a_valid_call(client, tool_server):
    r = create(client, tool_server, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_a_named_function_is_the_one_called(client, tool_server):
    for seed in range(2):
        r = create(
            client,
            tool_server,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        for call in r.choices[0].message.tool_calls:
            check_weather_call(call)


def test_streamed_calls_match_the_whole_reply(client, tool_server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = create(client, tool_server, tool_choice=named).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in create(client, tool_server, tool_choice=named, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                assert delta.id is None or delta.type == "function"
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_round_trip_sends_the_calls_and_the_result_back(client, tool_server, tool_model_dir):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = create(client, tool_server, tool_choice=named, parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        first.model_dump(),  # with its nulls (refusal, audio, function_call ...), as clients send it
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = create(client, tool_server, messages=messages, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the template was given: the call's arguments as an object, the tool's result
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    tokenizer = load_hf_tokenizer(tool_model_dir, read_config(tool_model_dir))
    prompt = tokenizer.decode(tokenizer.apply_chat_template(body.template_messages(), tools=body.template_tools()))
    rendered = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    assert f"<tool_call>\n{rendered}\n</tool_call>" in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools


def test_auto_with_no_tools_is_a_plain_reply(client, tool_server):
    """An empty tools list with "auto", and an earlier assistant message with "tool_calls": null, as clients send."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Hi", "tool_calls": None}, *MESSAGES]
    r = create(client, tool_server, messages=messages, tools=[], tool_choice="auto", max_tokens=2)
    assert r.choices[0].message.tool_calls is None


def test_tool_choice_none_leaves_the_tools_out(client, tool_server):
    with_tools = create(client, tool_server, max_tokens=1).usage.prompt_tokens
    without = create(client, tool_server, max_tokens=1, tool_choice="none").usage.prompt_tokens
    assert without < with_tools
    r = create(client, tool_server, max_tokens=4, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_param(tool_server, change, param):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with tool_server.client() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ChatML with the tools printed, and the mark of a family's call format (how server/tool_calls.py tells them apart)
FAMILY_TEMPLATES = {
    "llama3": "{#- calls: <|python_tag|>{...} -#}",
    "mistral": "{#- calls: [TOOL_CALLS][...] -#}",
}
FORCED_REPLY = {
    "llama3": {"name": "get_time", "parameters": {}},
    "mistral": [{"name": "get_time", "arguments": {}}],
}


@pytest.mark.parametrize("family", ["llama3", "mistral"])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_family_format(make_server, tmp_path, family, stream):
    """tool_choice auto: a reply in the template family's call format (forced here with a response_format const,
    the model being random) comes back as tool_calls, whole or streamed, with no content."""
    from tiny_models import CHATML, save_tiny_llama

    path = save_tiny_llama(tmp_path / "model", max_position_embeddings=2048)
    config = json.loads((path / "tokenizer_config.json").read_text())
    template = FAMILY_TEMPLATES[family] + "{% if tools %}{{ tools | tojson }}{% endif %}" + CHATML
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    server = make_server(model_dir=path, max_batch_size=2, ctx_size=2048, warmup=False)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    forced = {"type": "json_schema", "json_schema": {"name": "call", "schema": {"const": FORCED_REPLY[family]}}}
    r = create(client, server, response_format=forced, stream=stream)
    if not stream:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == [("get_time", "{}")]
        return
    content, names, arguments, finish = "", "", "", None
    for chunk in r:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                names += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (content, names, arguments, finish) == ("", "get_time", "{}", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_parse_reads_the_arguments_into_the_pydantic_model(client, tool_server, stream):
    """openai's `chat.completions.parse` (and its streaming form) with a strict tool made from a pydantic model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: Literal["Paris", "Rome"]
        days: int = Field(ge=1, le=3)

    kw = dict(
        model=tool_server.model_id,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    if stream:
        with client.chat.completions.stream(**kw) as events:
            message = events.get_final_completion().choices[0].message
    else:
        message = client.chat.completions.parse(**kw).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_forced_calls_grammar_is_checked_off_the_event_loop(client, tool_server, monkeypatch):
    """The server checks a new call grammar (as long as the tools' schemas make it) on a worker thread; one it knows
    is answered at once, without a worker."""
    import threading
    from collections import OrderedDict

    from mlxcel_core import constraints
    from mlxcel_core.server import app

    threads = []

    def recording(*args):
        threads.append(threading.current_thread().name)
        return checked(*args)

    checked = app.checked
    monkeypatch.setattr(app, "checked", recording)
    monkeypatch.setattr(constraints, "_compiled_cache", OrderedDict())  # every grammar new again
    named = {"type": "function", "function": {"name": "get_weather"}}
    for _ in range(2):
        check_weather_call(create(client, tool_server, tool_choice=named).choices[0].message.tool_calls[0])
    assert len(threads) == 2 and threads[0].startswith("mlxcel-prepare"), threads
    assert not threads[1].startswith("mlxcel-prepare"), threads
