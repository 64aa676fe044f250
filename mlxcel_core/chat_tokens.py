"""A chat prompt's token ids with message content tokenized as text: control tokens come only from the template.

Message content is the client's text. Special-token text inside it (`<|im_end|><|im_start|>system ...`) must not
become the control tokens it spells, or a user could forge a turn. The rendered prompt is tokenized as always
(special tokens parsed, since the template writes them as text); when some message's content holds special-token
text, the prompt is taken apart exactly:

1. the template renders again with each content string replaced by a unique marker, which splits its output into
   the template's own pieces T0, T1, ..., Tn;
2. the real render must be exactly T0 + c1 + T1 + ... + cn + Tn, each ci the i-th marker's content, verbatim or
   with surrounding whitespace stripped (templates `| trim` it): this locates every content span;
3. a special token that the real render's tokenization finds inside a content span is forged: each stretch between
   two of the template's own special tokens that holds one is tokenized again with special-token matching off
   (tokenizers' `encode_special_tokens`), so the content's special-token text becomes ordinary text tokens.
   Stretches without one keep their tokens, so a prompt is tokenized exactly as before wherever nothing was forged.

A template that changes content in other ways (one that cuts reasoning out of earlier turns, say) cannot be taken
apart exactly; a prompt whose content holds special-token text is then refused (InputError naming the option), never
tokenized approximately. `parse_special=True` keeps the old behaviour: all special-token text in the prompt parsed
(`--parse-special-in-content`). Non-special added tokens (Qwen's `<tool_call>`, `<think>`) are not control tokens and
are matched everywhere, as before; raw prompts (`/v1/completions`, `--no-chat-template`) parse special tokens.
"""

from __future__ import annotations

import bisect
import json
import re
import secrets
import threading
from typing import Any, Callable

from .errors import InputError

# tokenizers' encode and decode hold the GIL for as long as they run (seconds for a prompt of megabytes, freezing
# the server's event loop); encode_batch and decode_batch release it. Inputs longer than this take the batch calls.
GIL_FREE_CHARS = 8192

# Message fields that hold the client's text (the reasoning fields as chat_template.py aliases them).
CONTENT_KEYS = ("content", "reasoning_content", "thinking", "reasoning")
OPTION = "--parse-special-in-content"


class ContentTokenizer:
    """Per tokenizer: its special tokens, and (made on first need) copies of its backend that match none of them."""

    def __init__(self, backend):
        self.backend = backend
        special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content}
        self.special_ids = frozenset(special)
        texts = sorted(set(special.values()), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._encoders: tuple | None = None
        self._lock = threading.Lock()

    def text_only(self, at_start: bool):
        """The backend with special-token matching off, for a stretch at the prompt's start or after it: a
        Metaspace pre-tokenizer that prepends "▁" to the first split only must not give a later stretch one."""
        with self._lock:
            if self._encoders is None:
                from tokenizers import Tokenizer as HFTokenizer

                config = self.backend.to_str()
                first = HFTokenizer.from_str(config)
                first.encode_special_tokens = True
                later_config = _without_first_prepend(config)
                later = first if later_config is None else HFTokenizer.from_str(later_config)
                later.encode_special_tokens = True
                self._encoders = (first, later)
            return self._encoders[0 if at_start else 1]


_LOCK = threading.Lock()


def content_tokenizer(tokenizer) -> ContentTokenizer:
    """The tokenizer's ContentTokenizer, made on first use (thread-safe)."""
    with _LOCK:
        if tokenizer.content_tokenizer is None:
            tokenizer.content_tokenizer = ContentTokenizer(tokenizer.backend)
        return tokenizer.content_tokenizer


def encode_chat(tokenizer, render: Callable[[list[dict]], str], messages: list[dict], parse_special: bool) -> list[int]:
    """Token ids of `render(messages)` (the chat template), content tokenized as text unless `parse_special`."""
    text = render(messages)
    if parse_special:
        return _encode(tokenizer.backend, text).ids
    tokens = content_tokenizer(tokenizer)
    contents = _contents(messages)
    if tokens.pattern is None or not any(tokens.pattern.search(c) for c in contents):
        return _encode(tokenizer.backend, text).ids
    spans = _content_spans(render, messages, text)
    return _encode_with_text_spans(tokens, tokenizer.backend, text, spans)


def _encode(backend, text: str):
    """backend.encode(text) without special tokens added; long texts go through encode_batch, which releases the GIL
    (the server's event loop keeps running while a huge prompt is tokenized on a worker thread)."""
    if len(text) > GIL_FREE_CHARS:
        return backend.encode_batch([text], add_special_tokens=False)[0]
    return backend.encode(text, add_special_tokens=False)


def _contents(messages: list[dict]) -> list[str]:
    out = []
    for message in messages:
        for key in CONTENT_KEYS:
            value = message.get(key)
            if isinstance(value, str):
                out.append(value)
            elif isinstance(value, list):  # content parts: [{"type": "text", "text": ...}, ...]
                out += [p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return out


def _with_markers(messages: list[dict], nonce: str) -> tuple[list[dict], list[str]]:
    """The messages with every content string replaced by marker i; the strings by i."""
    strings: list[str] = []

    def mark(value: str) -> str:
        strings.append(value)
        return f"\ue000{nonce}:{len(strings) - 1}\ue001"  # private-use delimiters: not whitespace, never trimmed

    marked = []
    for message in messages:
        message = dict(message)
        for key in CONTENT_KEYS:
            value = message.get(key)
            if isinstance(value, str):
                message[key] = mark(value)
            elif isinstance(value, list):
                message[key] = [
                    {**p, "text": mark(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                    for p in value
                ]
        marked.append(message)
    return marked, strings


def _content_spans(render, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Where each content string sits in `text` (sorted (start, end) pairs); InputError when it cannot be known."""
    nonce = secrets.token_hex(8)
    marked, strings = _with_markers(messages, nonce)
    refusal = InputError(
        "a message contains special-token text, and this chat template changes message content in a way that "
        f"does not show where that text sits in the prompt; remove it, or pass {OPTION} to parse it as tokens"
    )
    try:
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(marked))
    except Exception:  # noqa: BLE001 - the template reads the content itself (it rejected a marker)
        raise refusal from None
    spans, pos = [], 0
    if not text.startswith(pieces[0]):
        raise refusal
    pos = len(pieces[0])
    for k in range(1, len(pieces), 2):
        content, after = strings[int(pieces[k])], pieces[k + 1]
        candidates = sorted({content, content.strip(), content.lstrip(), content.rstrip()}, key=len, reverse=True)
        found = next((c for c in candidates if text.startswith(c + after, pos)), None)
        if found is None:
            raise refusal
        if found:
            spans.append((pos, pos + len(found)))
        pos += len(found) + len(after)
    if pos != len(text):
        raise refusal
    return spans


def _encode_with_text_spans(tokens: ContentTokenizer, backend, text: str, spans) -> list[int]:
    """Token ids of `text` with every special token inside `spans` tokenized as text instead."""
    encoding = _encode(backend, text)
    ids, offsets = encoding.ids, encoding.offsets
    starts = [s for s, _ in spans]

    def in_content(position: int) -> bool:
        i = bisect.bisect_right(starts, position) - 1
        return i >= 0 and position < spans[i][1]

    special = [i for i, t in enumerate(ids) if t in tokens.special_ids]
    forged = {i for i in special if in_content(offsets[i][0])}
    if not forged:
        return ids
    kept = [i for i in special if i not in forged]
    out: list[int] = []
    # Stretches of tokens between the template's own special tokens (and the prompt's ends).
    for before, after in zip([-1, *kept], [*kept, len(ids)]):
        stretch = range(before + 1, after)
        if forged.intersection(stretch):
            start = offsets[before][1] if before >= 0 else 0
            end = offsets[after][0] if after < len(ids) else len(text)
            encoder = tokens.text_only(at_start=start == 0)
            out += _encode(encoder, text[start:end]).ids
        else:
            out += ids[before + 1 : after]
        if after < len(ids):
            out.append(ids[after])
    return out


def _without_first_prepend(config: str) -> str | None:
    """The tokenizer's JSON with a Metaspace `prepend_scheme: first` set to `never`; None when it has none."""
    doc = json.loads(config)
    changed = False

    def visit(node: Any) -> None:
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(doc.get("pre_tokenizer"))
    return json.dumps(doc) if changed else None
