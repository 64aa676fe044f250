"""mlxcel_core/harmony.py on strings: gpt-oss replies (decoded with their special tokens) read as messages, split
into reasoning, answer and calls (recipient after the channel or after the role), the raw form, bad arguments, and
the streamed split adding up to the whole one. No model."""

from __future__ import annotations

import pytest

from mlxcel_core import harmony
from mlxcel_core.reasoning import SplitStream

THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>User greets. Reply.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)
THINK_THEN_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
)


def test_reasoning_and_answer():
    reply = harmony.split(THINK_THEN_ANSWER + "<|return|>")
    assert (reply.reasoning, reply.content, reply.calls) == ("User greets. Reply.", "Hello! How can I help?", [])


def test_a_call_after_the_analysis():
    reply = harmony.split(THINK_THEN_CALL)
    assert (reply.reasoning, reply.content) == ("Need the weather.", "")
    assert reply.calls == [("get_weather", '{"city": "Paris"}')]


def test_the_recipient_after_the_role_and_a_preamble():
    text = (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>"
    )
    reply = harmony.split(text)
    assert (reply.reasoning, reply.content, reply.calls) == (None, "Checking.", [("lookup", "{}")])


def test_calls_off_bad_arguments_and_other_recipients_are_answer():
    assert harmony.split(THINK_THEN_CALL, calls=False).content == '{"city":"Paris"}'
    bad = THINK_THEN_CALL.replace('{"city":"Paris"}', '{"city":')
    reply = harmony.split(bad)
    assert (reply.calls, reply.content) == ([], '{"city":')
    browser = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=browser.search"
    assert harmony.split(browser + '<|message|>{"q": 1}').calls == []


def test_raw_keeps_every_message_but_the_calls_as_generated():
    reply = harmony.split(THINK_THEN_CALL, raw=True)
    assert reply.reasoning is None
    assert reply.content == "<|channel|>analysis<|message|>Need the weather.<|end|>"
    assert reply.calls == [("get_weather", '{"city": "Paris"}')]
    assert harmony.split(THINK_THEN_ANSWER, raw=True).content == THINK_THEN_ANSWER


def test_text_with_no_harmony_is_answer():
    assert harmony.split('{"a": 1}') == harmony.Reply(None, '{"a": 1}', [])


@pytest.mark.parametrize("text", [THINK_THEN_ANSWER, THINK_THEN_CALL, THINK_THEN_ANSWER + "<|end|>"])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("step", [1, 4, 11])
def test_streamed_split_adds_up_to_the_whole(text, raw, step):
    def parts(t, partial):
        reply = harmony.split(t, partial, raw=raw)
        return reply.reasoning, reply.content

    stream = SplitStream(parts, harmony.MARKERS)
    reasoning, content = "", ""
    for i in range(0, len(text), step):
        r, c = stream.feed(text[i : i + step])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    whole = harmony.split(text, raw=raw)
    assert (reasoning + r, content + c) == (whole.reasoning or "", whole.content)
