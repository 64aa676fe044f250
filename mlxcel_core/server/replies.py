"""OpenAI response shapes: whole completions, server-sent event chunks, usage and logprobs.

A Reply turns one request's engine events (engine_loop.Event, one job per choice) into JSON:
- completions: choices[].text, choices[].logprobs {tokens, token_logprobs, top_logprobs, text_offset};
- chat: choices[].message / delta, choices[].logprobs.content[{token, logprob, bytes, top_logprobs}];
- usage {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens}; with
  stream_options.include_usage, every chunk carries "usage": null and a last chunk has it with no choices.
A choice that ends in error fails the whole reply: an APIError, or mid-stream an error event then [DONE]. Except a
constrained choice whose grammar reached a dead end (StepOutput.dead_end): the output failed, not the server, so the
reply goes on and that choice ends with finish_reason "error" and an "error" {"message"} beside it.
A chat choice's text goes through its TextPlan (server/reply_text.py): a reasoning model's reasoning becomes
message.reasoning_content (streamed: delta.reasoning_content); with tools, its calls become message.tool_calls
(content: the text outside them, or null) and finish_reason "tool_calls"; streamed, text from where a call may begin
is held back and the calls go out at the end as delta.tool_calls (per call: id, type and name, then the arguments).
"""

from __future__ import annotations

import codecs
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import APIError
from .reply_text import TextPlan, TextStream, whole

DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # JSON has no -inf


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenFormatter:
    """A token id as the bytes it stands for, and as text (OpenAI's "bytes:\\xNN" form when not UTF-8)."""

    def __init__(self, tokenizer):
        self.backend = tokenizer.backend
        decoder = self.backend.decoder
        self.byte_level = decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()
        self._cache: dict[int, tuple[bytes, str]] = {}

    def _bytes(self, token: int) -> bytes:
        piece = self.backend.id_to_token(token)
        if piece is None:
            return b""
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # SentencePiece byte fallback
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def get(self, token: int) -> tuple[bytes, str]:
        if token not in self._cache:
            raw = self._bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token] = (raw, text)
        return self._cache[token]


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    entries: list[tuple] = field(default_factory=list)  # (token, logprob, top alternatives)
    finish_reason: str | None = None
    usage: object = None
    error: str | None = None  # a dead end's message


def _dead_end(message: str | None) -> dict:
    """A choice's "error" field: present only on a choice whose constraint reached a dead end."""
    return {} if message is None else {"error": {"message": message, "type": "constraint_dead_end"}}


class Reply:
    def __init__(
        self,
        server,
        chat: bool,
        model: str,
        logprobs: bool,
        include_usage: bool,
        n: int,
        text_plan: TextPlan | None = None,
    ):
        self.chat, self.model, self.logprobs, self.include_usage, self.n = chat, model, logprobs, include_usage, n
        self.text_plan = text_plan if chat else None
        self.tool_family = text_plan.tool_family if self.text_plan else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.fmt = server.formatter
        self.eos = server.engine.loaded.tokenizer.eos_token_ids
        # completions' text_offset: characters of the choice's text before each token (bytes decoded as a stream)
        self._offsets = [0] * n
        self._decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def _entries(out) -> list[tuple]:
        if out.token is None or out.logprob is None:
            return []
        return [(out.token, out.logprob, out.top_logprobs or [])]

    def _logprobs(self, index: int, entries: list[tuple]) -> dict | None:
        if not self.logprobs:
            return None
        entries = [e for e in entries if e[0] not in self.eos]  # the end-of-sequence token is not text
        if self.chat:

            def item(token, logprob):
                raw, text = self.fmt.get(token)
                return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}

            return {
                "content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries]
            }
        tokens, offsets = [], []
        for token, _, _ in entries:
            raw, text = self.fmt.get(token)
            tokens.append(text)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(self._decoders[index].decode(raw))
        return {
            "tokens": tokens,
            "token_logprobs": [_lp(lp) for _, lp, _ in entries],
            "top_logprobs": [{self.fmt.get(a)[1]: _lp(alp) for a, alp in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    @staticmethod
    def _error(out) -> APIError:
        if out.finish_reason == "cancelled":
            return APIError(503, "The request was cancelled by the server.")
        return APIError(500, f"Generation failed: {out.error or 'unknown error'}")

    @staticmethod
    def usage(usages) -> dict:
        prompt = usages[0].prompt_tokens  # the prompt is shared by every choice
        completion = sum(u.completion_tokens for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(u.cached_tokens for u in usages)},
        }

    def _body(self, choices: list[dict]) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = self._body(choices)
        if self.chat:
            body["object"] = "chat.completion.chunk"
        if self.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    # -- whole replies ------------------------------------------------------------------------------
    async def collect(self, events) -> dict:
        choices = [_Choice() for _ in range(self.n)]
        left = self.n
        while left:
            event = await events.get()
            out, choice = event.output, choices[event.index]
            if event.kind == "final" and out.finish_reason not in ("stop", "length") and not out.dead_end:
                raise self._error(out)
            choice.text.append(out.text)
            choice.entries += self._entries(out)
            if event.kind == "final":
                choice.finish_reason, choice.usage = out.finish_reason, event.usage
                choice.error = out.error if out.dead_end else None
                left -= 1
        shaped = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            finish = c.finish_reason
            reasoning, content, calls = whole(self.text_plan, text) if self.text_plan else (None, text, [])
            if self.chat:
                body["message"]["content"] = content
            if calls:
                calls = [call.to_openai(self.tool_family) for call in calls]
                body["message"] = {"role": "assistant", "content": content.strip() or None, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
            if reasoning:
                body["message"]["reasoning_content"] = reasoning
            shaped.append(
                {"index": i, **body, "logprobs": self._logprobs(i, c.entries), "finish_reason": finish}
                | _dead_end(c.error)
            )
        return {**self._body(shaped), "usage": self.usage([c.usage for c in choices])}

    @staticmethod
    def _delta(reasoning: str, content: str) -> dict:
        """A chat chunk's delta: the reasoning when there is some, the content when there is some or no reasoning."""
        return ({"reasoning_content": reasoning} if reasoning else {}) | (
            {"content": content} if content or not reasoning else {}
        )

    def _tool_chunks(self, i: int, stream: TextStream, finish: str) -> tuple[list[bytes], str]:
        """At a streamed choice's end: chunks for its held-back text and its calls, and its finish_reason."""
        reasoning, rest, calls = stream.finish()
        delta = self._delta(reasoning, rest)
        chunks = [self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])]
        chunks = chunks if reasoning or rest else []
        for k, call in enumerate(calls):
            shaped = call.to_openai(self.tool_family)
            head = {**shaped, "function": {"name": call.name, "arguments": ""}}
            for piece in (head, {"function": {"arguments": call.arguments}}):
                delta = {"tool_calls": [{"index": k, **piece}]}
                chunks.append(self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
        return chunks, "tool_calls" if calls and finish == "stop" else finish

    async def stream(self, events):
        usages = [None] * self.n
        left = self.n
        splitters = [TextStream(self.text_plan) if self.text_plan else None for _ in range(self.n)]
        if self.chat:
            yield self._chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(self.n)
                ]
            )
        while left:
            event = await events.get()
            out, i = event.output, event.index
            final = event.kind == "final"
            if final and out.finish_reason not in ("stop", "length") and not out.dead_end:
                yield self._error(out).sse()
                yield DONE
                return
            logprobs = self._logprobs(i, self._entries(out))
            has_logprobs = bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))
            if self.chat:
                reasoning, text = splitters[i].feed(out.text) if splitters[i] else ("", out.text)
                if reasoning or text or has_logprobs:
                    delta = self._delta(reasoning, text)
                    yield self._chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
                finish = out.finish_reason
                if final and splitters[i]:
                    chunks, finish = self._tool_chunks(i, splitters[i], finish)
                    for chunk in chunks:
                        yield chunk
                if final:
                    end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}
                    yield self._chunk([end | _dead_end(out.error if out.dead_end else None)])
            elif out.text or has_logprobs or final:
                yield self._chunk(
                    [
                        {
                            "index": i,
                            "text": out.text,
                            "logprobs": logprobs,
                            "finish_reason": out.finish_reason if final else None,
                        }
                        | _dead_end(out.error if final and out.dead_end else None)
                    ]
                )
            if final:
                usages[i] = event.usage
                left -= 1
        if self.include_usage:
            yield self._chunk([], usage=self.usage(usages))
        yield DONE
