"""server/tool_calls.py on strings: the template family, each family's parser, the call grammar, and the splitter
that holds back streamed text from where a call may begin. No model."""

from __future__ import annotations

import json

import pytest

from mlxcel_core.constraints import Constraint, check, grammar_of
from mlxcel_core.server.tool_calls import (
    StreamSplitter,
    ToolCall,
    call_grammar,
    call_id,
    detect_family,
    parse,
    parse_hermes,
    parse_llama3,
    parse_mistral,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "noop"}},
]


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{% for t in tools %}...<tool_call>\n{{ t | tojson }}</tool_call>{% endfor %}", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{ '<|python_tag|>' }}...<|eot_id|>", "llama3"),
        ('<|start_header_id|>... {"name": function name, "parameters": ...}<|eot_id|>', "llama3"),
        ("{{ '<|start|>assistant<|channel|>commentary to=functions.' + name }}", "harmony"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # unknown: hermes
        (None, "hermes"),
    ],
)
def test_detect_family(template, family):
    assert detect_family(template) == family


def test_hermes_one_and_several_calls_with_text_outside():
    calls, outside = parse_hermes(
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert calls == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]
    assert outside.strip() == "Let me check."


def test_hermes_unclosed_last_call_and_string_arguments():
    calls, _ = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}')
    assert calls == [ToolCall("f", '{"x": [1, 2]}')]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',  # all or nothing
    ],
)
def test_hermes_text_that_is_not_calls_is_content(text):
    assert parse_hermes(text) == ([], text)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "arguments": {"x": 1}}',
        '  {"name": "f", "arguments": {"x": 1}}\n',
        '```json\n{"name": "f", "arguments": {"x": 1}}\n```',
        '```\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n```',
    ],
)
def test_hermes_reads_a_reply_of_bare_call_objects(text):
    assert parse_hermes(text) == ([ToolCall("f", '{"x": 1}')], "")


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',  # an object that is not a call
        'Here: {"name": "f", "arguments": {}}',  # text around it
        '{"name": "f", "arguments": {}} and more',
        '```python\n{"name": "f", "arguments": {}}\n```',  # not a JSON fence
        '```json\n{"name": "f", "arguments": {}}',  # unclosed fence
    ],
)
def test_hermes_bare_objects_are_calls_only_when_they_are_the_whole_reply(text):
    assert parse_hermes(text) == ([], text)


def test_hermes_bare_calls_not_parallel_keeps_the_first():
    two = '{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {}}'
    assert parse("hermes", two) == ([ToolCall("f", "{}"), ToolCall("g", "{}")], "")
    assert parse("hermes", two, parallel=False) == ([ToolCall("f", "{}")], "")


def test_llama3_whole_reply_with_and_without_python_tag():
    assert parse_llama3('{"name": "f", "parameters": {"q": "x"}}') == ([ToolCall("f", '{"q": "x"}')], "")
    calls, _ = parse_llama3('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": true}}')
    assert calls == [ToolCall("f", "{}"), ToolCall("g", '{"b": true}')]
    text = 'Call {"name": "f", "parameters": {}}'  # not the whole reply: content
    assert parse_llama3(text) == ([], text)
    assert parse_llama3('{"answer": 42}') == ([], '{"answer": 42}')


def test_mistral_with_marker_and_bare_list():
    calls, before = parse_mistral(
        'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    )
    assert calls == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")] and before == "Sure "
    assert parse_mistral('[{"name": "f", "arguments": {}}]')[0] == [ToolCall("f", "{}")]
    assert parse_mistral("[1, 2]") == ([], "[1, 2]")
    assert parse_mistral("plain") == ([], "plain")


def test_call_ids():
    assert call_id("hermes").startswith("call_") and len(call_id("hermes")) == 29
    mistral = call_id("mistral")
    assert len(mistral) == 9 and mistral.isalnum()
    shaped = ToolCall("f", "{}").to_openai("hermes")
    assert shaped["type"] == "function" and shaped["function"] == {"name": "f", "arguments": "{}"}


def test_not_parallel_keeps_the_first_call_and_cuts_the_reply_after_it():
    f, g = '{"name": "f", "arguments": {}}', '{"name": "g", "arguments": {}}'
    hermes = f"Sure.<tool_call>{f}</tool_call> then <tool_call>{g}</tool_call> done"
    assert parse("hermes", hermes, parallel=False) == ([ToolCall("f", "{}")], "Sure.")
    assert len(parse("hermes", hermes)[0]) == 2
    assert parse("mistral", f"[TOOL_CALLS][{f}, {g}]", parallel=False) == ([ToolCall("f", "{}")], "")
    assert parse("llama3", f"{f}; {g}", parallel=False) == ([ToolCall("f", "{}")], "")
    bad = f"<tool_call>oops</tool_call> and <tool_call>{g}</tool_call>"
    assert parse("hermes", bad, parallel=False) == ([], bad)  # no calls: the whole text is content


def test_harmony_calls_parse_from_the_reply_with_its_special_tokens():
    text = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary to=functions.f json"
    assert parse("harmony", text + '<|message|>{"a":1}') == ([ToolCall("f", '{"a": 1}')], "")


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3", "harmony"])
@pytest.mark.parametrize("parallel", [False, True])
def test_call_grammar_compiles(family, parallel):
    check(Constraint.grammar(call_grammar(family, TOOLS, parallel)))


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3"])
def test_the_grammar_takes_a_call_its_parser_reads(family, tiny_llama_dir):
    """A call in the family's format is a whole sentence of its grammar (llguidance on the tiny tokenizer), and the
    family's parser reads it back; a call of another function or with wrong arguments is not."""
    import llguidance

    from mlxcel_core.engine import constrained
    from mlxcel_core.loading.hf import read_config
    from mlxcel_core.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(tiny_llama_dir, read_config(tiny_llama_dir))
    ll_tokenizer = constrained.prepare(tokenizer, tokenizer.vocab_size).result()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    grammar = grammar_of(Constraint.grammar(call_grammar(family, tools, True)))

    def sentence(name: str, args: dict) -> str:
        key = "parameters" if family == "llama3" else "arguments"
        body = json.dumps({"name": name, key: args})
        return {"hermes": f"<tool_call>\n{body}\n</tool_call>", "mistral": f"[{body}]", "llama3": body}[family]

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    good = sentence("get_weather", {"city": "Paris"})
    assert accepts(good)
    assert parse(family, good)[0] == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert not accepts(sentence("get_time", {"city": "Paris"}))
    assert not accepts(sentence("get_weather", {"city": "Oslo"}))


def feed_all(family: str, pieces: list[str]) -> tuple[str, list[ToolCall], str]:
    splitter = StreamSplitter(family)
    sent = "".join(splitter.feed(p) for p in pieces)
    calls, rest = splitter.finish()
    return sent, calls, rest


def test_splitter_holds_back_from_the_marker_even_split_across_pieces():
    pieces = ["Let me", " look.<tool", '_call>{"name": "f", ', '"arguments": {}}</tool_call>']
    sent, calls, rest = feed_all("hermes", pieces)
    assert sent == "Let me look." and calls == [ToolCall("f", "{}")] and rest == ""


def test_splitter_releases_a_partial_marker_and_failed_calls_as_content():
    assert feed_all("hermes", ["a <tool", "box> b"]) == ("a <toolbox> b", [], "")
    sent, calls, rest = feed_all("hermes", ["x <tool_call>", "oops"])
    assert (sent, calls, rest) == ("x ", [], "<tool_call>oops")


def test_splitter_llama3_holds_a_json_reply_and_streams_text():
    assert feed_all("llama3", ["Hello", " there"]) == ("Hello there", [], "")
    sent, calls, _ = feed_all("llama3", [" {", '"name": "f", "parameters": {}}'])
    assert sent == "" and calls == [ToolCall("f", "{}")]
    assert feed_all("llama3", ['{"a"', ": 1}"]) == ("", [], '{"a": 1}')


@pytest.mark.parametrize(
    "pieces",
    [
        ['{"name"', ': "f", "arguments": {}}'],
        ["``", "`json\n", '{"name": "f", ', '"arguments": {}}\n```'],
    ],
)
def test_splitter_hermes_holds_a_reply_that_may_be_bare_calls(pieces):
    assert feed_all("hermes", pieces) == ("", [ToolCall("f", "{}")], "")


def test_splitter_hermes_releases_what_cannot_be_bare_calls():
    assert feed_all("hermes", ["```", "python\nx = 1", "\n```"]) == ("```python\nx = 1\n```", [], "")
    assert feed_all("hermes", ["{", '"a": 1}']) == ("", [], '{"a": 1}')


def test_a_token_the_tokenizer_holds_as_text_is_text_to_the_grammar(tiny_llama_dir):
    """Qwen's `<tool_call>` is an added token that is not special: the call grammar's text "<tool_call>" takes that
    token (llguidance alone would count it special and refuse it), while special tokens stay special."""
    import llguidance
    from tokenizers import AddedToken

    from mlxcel_core.engine import constrained
    from mlxcel_core.loading.hf import read_config
    from mlxcel_core.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(tiny_llama_dir, read_config(tiny_llama_dir))
    tokenizer.backend.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tokenizer.backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    start, end = (tokenizer.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    ll_tokenizer = constrained.prepare(tokenizer, tokenizer.vocab_size).result()
    assert not ll_tokenizer.is_special_token(start) and ll_tokenizer.is_special_token(tokenizer.vocab_size - 1)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(Constraint.grammar(call_grammar("hermes", tools, True))))
    ids = tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False)
    assert ids[0] == start and ids[-1] == end
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting(), matcher.get_error()
    special = llguidance.LLMatcher(ll_tokenizer, 'start: "x" <|end|>')
    assert special.try_consume_tokens([*tokenizer.encode("x", False), tokenizer.vocab_size - 1]) == 2
