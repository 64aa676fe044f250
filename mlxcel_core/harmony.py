"""gpt-oss's harmony format in a reply: its messages, their channels, and calls by recipient.

The reply, decoded with its special tokens, is a run of messages (the first one's `<|start|>assistant` is the end of
the prompt):
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
The recipient may also stand after the role (`assistant to=functions.NAME<|channel|>commentary json<|message|>`).
`analysis` is the reasoning; `final`, and `commentary` with no recipient (a preamble shown to the user), the answer;
a message to `functions.NAME` a call of tool NAME with the message as its JSON arguments. `<|return|>` and `<|call|>`
end the turn (gpt-oss's EOS tokens: not in the decoded text, but read as ends here too). Text before the first
header (no harmony at all: e.g. output constrained to JSON) is answer. No MLX here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
FUNCTIONS = "functions."


@dataclass
class Message:
    channel: str | None  # None: text outside any header
    recipient: str | None  # e.g. "functions.get_weather"
    body: str
    raw: str  # the message's text as generated, header and end marker included
    ended: bool  # its end marker was read

    @property
    def call_name(self) -> str | None:
        """The tool this message calls, or None."""
        if self.recipient and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS) :] or None
        return None


def _header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header such as `assistant to=functions.f<|channel|>commentary <|constrain|>json`."""
    header = header.removeprefix(START)
    role, _, channel_part = header.partition(CHANNEL)
    words = (role + " " + channel_part.replace(CONSTRAIN, " ")).split()
    recipient = next((w[3:] for w in words if w.startswith("to=")), None)
    channel = channel_part.replace(CONSTRAIN, " ").split()
    return (channel[0] if channel else None), recipient


def messages(text: str) -> list[Message]:
    """The reply's messages; a last message whose header is not complete yet is left out."""
    out: list[Message] = []
    first = min((at for at in (text.find(START), text.find(CHANNEL)) if at >= 0), default=len(text))
    if first > 0:
        out.append(Message(None, None, text[:first], text[:first], False))
    i = first
    while i < len(text):
        header_end = text.find(MESSAGE, i)
        if header_end < 0:
            break
        channel, recipient = _header(text[i:header_end])
        body_at = header_end + len(MESSAGE)
        ends = [(at, marker) for marker in ENDS if (at := text.find(marker, body_at)) >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        out.append(Message(channel, recipient, text[body_at:end], text[i : end + len(marker)], bool(marker)))
        i = end + len(marker)
    return out


@dataclass
class Reply:
    reasoning: str | None
    content: str
    calls: list[tuple[str, str]]  # (tool name, arguments as a JSON text)


def _arguments(body: str) -> str | None:
    """A call's arguments as compact JSON text, or None when they are not a JSON object."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def split(text: str, partial: bool = False, raw: bool = False, calls: bool = True) -> Reply:
    """The reply's reasoning (analysis messages, joined by newlines), answer and calls. `partial`: the text so far of a
    streamed reply (a call is read once it ended). `raw`: no split, the answer is every message but the calls as
    generated, special tokens included. `calls`: False reads messages to tools as answer."""
    reasoning, content, found = [], [], []
    for m in messages(text):
        name = m.call_name if calls else None
        if name is not None:
            if not partial or m.ended:
                found.append((name, m))
        elif raw:
            content.append(m.raw)
        elif m.channel == "analysis":
            reasoning.append(m.body)
        elif m.channel in (None, "final", "commentary"):
            content.append(m.body)
    parsed = [(name, _arguments(m.body)) for name, m in found]
    if any(args is None for _, args in parsed):  # all or nothing, as server/tool_calls.py parses calls
        parsed = []
        content += [m.raw if raw else m.body for _, m in found]
    joiner = "" if raw else "\n"
    return Reply(None if raw or not reasoning else "\n".join(reasoning), joiner.join(content), parsed)
