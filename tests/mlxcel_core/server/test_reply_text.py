"""Reasoning content and tool calls after it, through the real server and the openai client (server/reply_text.py).

A tiny random Llama whose tokenizer has the reasoning markers: `<think>` / `</think>` as ordinary added tokens
(as Qwen3's), or gpt-oss's harmony markers as special tokens (and `<|return|>` / `<|call|>` as EOS). Its reply is
forced token by token (a logits processor that leaves one token, wrapped around the server's sampling_params), so
the engine, its detokenizer, the reply's split and the OpenAI shapes all run as for a real reasoning model.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import pytest
from tokenizers import AddedToken, Tokenizer

from mlxcel_core.server import app as app_module

openai = pytest.importorskip("openai")

THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}\nCall as <tool_call>{...}</tool_call><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif think_open is defined and think_open %}<think>\n{% endif %}{% endif %}"
)
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _model(path, template: str, tokens: list[AddedToken], eos: list[str]):
    from tiny_models import save_tiny_llama

    path = save_tiny_llama(path, vocab_size=336, max_position_embeddings=2048)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens(tokens)
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(t) for t in eos]}))
    return path, tok


class Forced:
    """The reply every request gets next: its token ids, then EOS (a logits processor leaves one token each step).
    One for the module: the servers' sampling_params is wrapped once."""

    ids: list[int] = []
    eos = 0

    @classmethod
    def set(cls, tok: Tokenizer, text: str, end: str) -> None:
        cls.ids = tok.encode(text, add_special_tokens=False).ids
        cls.eos = tok.token_to_id(end)

    @classmethod
    def wrap(cls, real):
        def make(body, **kw):
            params, ids, eos, prompt_len = real(body, **kw), list(cls.ids), cls.eos, kw["prompt_len"]

            def force(tokens, logits):
                k = len(tokens) - prompt_len
                allowed = mx.arange(logits.shape[-1]) == (ids[k] if k < len(ids) else eos)
                return mx.where(allowed, logits, -mx.inf)

            return dataclasses.replace(params, logits_processors=params.logits_processors + (force,))

        return make


@pytest.fixture(scope="module")
def forcing():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "sampling_params", Forced.wrap(app_module.sampling_params))
        yield


def _serve(path):
    from servers import start_server

    running = start_server(path, max_batch_size=2, ctx_size=2048, warmup=False)
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=60, max_retries=0)
    client.served = running.model_id
    return running, client


@pytest.fixture(scope="module")
def think_server(tmp_path_factory, forcing):
    """(force(text), client): a Qwen3-like model whose next reply is `text` then <|im_end|>."""
    tokens = [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    path, tok = _model(tmp_path_factory.mktemp("think"), THINK_TEMPLATE, tokens, ["<|im_end|>"])
    running, client = _serve(path)
    yield (lambda text: Forced.set(tok, text, "<|im_end|>")), client
    running.stop()


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory, forcing):
    """(force(text, end), client): a gpt-oss-like model whose next reply is `text` then `end` (an EOS)."""
    tokens = [AddedToken(t, special=True) for t in HARMONY_SPECIALS]
    path, tok = _model(tmp_path_factory.mktemp("harmony"), HARMONY_TEMPLATE, tokens, ["<|return|>", "<|call|>"])
    running, client = _serve(path)
    yield (lambda text, end="<|return|>": Forced.set(tok, text, end)), client
    running.stop()


def ask(client, stream=False, **kw):
    """(reasoning or None, content, [(name, arguments)], finish_reason) of one reply, whole or streamed."""
    kw = {"model": client.served, "messages": USER, "max_tokens": 800, "temperature": 0, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        m = choice.message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return getattr(m, "reasoning_content", None), m.content, calls, choice.finish_reason
    reasoning, content, calls, finish = None, None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            r = getattr(choice.delta, "reasoning_content", None)
            reasoning = reasoning + r if reasoning and r else reasoning or r
            content = (content or "") + choice.delta.content if choice.delta.content is not None else content
            for d in choice.delta.tool_calls or []:
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content if content or not calls else None, list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True])
def test_think_reasoning_is_apart_from_the_content(think_server, stream):
    force, client = think_server
    force("<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.")
    assert ask(client, stream) == ("The user asks about Paris.", "It is sunny.", [], "stop")
    # reasoning_format "none": the reply as generated is the content
    raw = ask(client, stream, extra_body={"reasoning_format": "none"})
    assert raw == (None, "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_opens_think_and_template_kwargs(think_server, stream):
    force, client = think_server
    force("Paris, so weather.</think>Sunny.")
    opened = {"chat_template_kwargs": {"think_open": True}}
    assert ask(client, stream, extra_body=opened) == ("Paris, so weather.", "Sunny.", [], "stop")
    force("Sunny.")
    assert ask(client, stream) == (None, "Sunny.", [], "stop")
    closed = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen3's switch: the prompt closes <think>
    assert ask(client, stream, extra_body=closed) == (None, "Sunny.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_after_reasoning_are_read_from_the_content(think_server, stream):
    force, client = think_server
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rome = call.replace("Paris", "Rome")
    force(f"<think>\nI could write {rome} but\n</think>\n\n{call}\n{rome}")
    reasoning, content, calls, finish = ask(client, stream, tools=TOOLS)
    assert reasoning == f"I could write {rome} but"
    assert (content, finish) == (None, "tool_calls")
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    # parallel_tool_calls false: the first call only, the reply cut after it
    assert ask(client, stream, tools=TOOLS, parallel_tool_calls=False)[2:] == (
        [("get_weather", '{"city": "Paris"}')],
        "tool_calls",
    )


ANALYSIS = "<|channel|>analysis<|message|>Paris weather: call the tool.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_analysis_final_and_raw(harmony_server, stream):
    force, client = harmony_server
    force(ANALYSIS + FINAL)
    assert ask(client, stream) == ("Paris weather: call the tool.", "It is sunny in Paris.", [], "stop")
    assert ask(client, stream, extra_body={"reasoning_format": "none"}) == (None, ANALYSIS + FINAL, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_tool_call(harmony_server, stream):
    force, client = harmony_server
    force(ANALYSIS + CALL, end="<|call|>")
    want = ("Paris weather: call the tool.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert ask(client, stream, tools=TOOLS) == want
    # tool_choice "required": the call grammar (analysis first, then a call) accepts gpt-oss's format
    assert ask(client, stream, tools=TOOLS, tool_choice="required") == want


def test_reasoning_content_goes_back_to_the_template():
    from mlxcel_core.server.schemas import ChatCompletionRequest

    assistant = {"role": "assistant", "content": None, "reasoning_content": "Think.", "tool_calls": None}
    body = ChatCompletionRequest.model_validate({"messages": [*USER, assistant]})
    assert body.template_messages()[1]["reasoning_content"] == "Think."


def test_a_bad_reasoning_format_is_a_400(think_server):
    _, client = think_server
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, extra_body={"reasoning_format": "deepseek-legacy"})
    assert err.value.body["param"] == "reasoning_format"
