"""ChatSession: a multi-turn chat over one Engine and one Conversation (what `mlxcel run` drives).

Every turn renders the whole message list through the model's chat template and opens one sequence
with the session's `Conversation`, so only the tokens that are not in the KV cache yet are prefilled
(the template glue, the new user message and the last token of the previous reply)::

    from mlxcel_core import load_model
    from mlxcel_core.chat import ChatSession

    chat = ChatSession(load_model(), system="Be brief.")
    print(chat.ask("What is the capital of France?"))
    for piece in chat.send("And of Italy?"):      # streamed; stop iterating (or cancel()) to interrupt
        print(piece, end="", flush=True)
    print(chat.last_turn.computed_tokens)          # prompt tokens actually computed this turn

When the prompt plus `max_tokens` would not fit the model's context, the oldest user/assistant turns
are dropped (the system prompt is kept) and `notify` is told. An interrupted reply stays in the
history with the text produced so far, flagged `"interrupted": True` in `messages` (the template only
ever sees role and content, so the model reads it as an ordinary, shorter reply).

A reasoning model's reply (mlxcel_core/reasoning.py) is kept in the history as its answer, the reasoning under
"reasoning_content" (what chat templates drop from earlier turns); gpt-oss's replies are generated with their
harmony markers kept in the streamed text, to be split. Output under a constraint is kept whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

from .engine import Conversation, Engine, EngineConfig, FinishReason
from .errors import InputError, RuntimeFailure
from .reasoning import detect, opens_inside, reply_stream
from .sampling import SamplingParams

# setting name (as typed after /set, or given to ChatSession.set) -> (SamplingParams field, value kind)
SETTINGS: dict[str, tuple[str, str]] = {
    "temp": ("temperature", "number"),
    "temperature": ("temperature", "number"),
    "top-k": ("top_k", "integer"),
    "top-p": ("top_p", "number"),
    "min-p": ("min_p", "number"),
    "max-tokens": ("max_tokens", "integer"),
    "seed": ("seed", "seed"),
    "repeat-penalty": ("repetition_penalty", "number"),
    "repetition-penalty": ("repetition_penalty", "number"),
    "repeat-last-n": ("repeat_last_n", "integer"),
    "presence-penalty": ("presence_penalty", "number"),
    "frequency-penalty": ("frequency_penalty", "number"),
    "dry-multiplier": ("dry_multiplier", "number"),
    "dry-base": ("dry_base", "number"),
    "dry-allowed-length": ("dry_allowed_length", "integer"),
    "dry-penalty-last-n": ("dry_penalty_last_n", "integer"),
    "xtc-threshold": ("xtc_threshold", "number"),
    "xtc-probability": ("xtc_probability", "number"),
}
SETTABLE = ", ".join(name for name in SETTINGS if name not in ("temperature", "repetition-penalty"))


def chat_engine_config(config: EngineConfig | None) -> EngineConfig:
    """A chat's engine: one sequence at a time on dense storage (the storage that carries a Conversation)."""
    return dataclasses.replace(config or EngineConfig(), max_batch_size=1, storage="dense")


@dataclass
class TurnStats:
    """What one turn cost: prompt size, how much of it the KV cache already held, and speeds."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the conversation's KV cache
    generated_tokens: int
    prefill_s: float
    decode_s: float
    finish_reason: FinishReason | None
    dropped_messages: int = 0  # oldest user/assistant messages dropped to fit the context
    prompt_ids: list[int] = dataclasses.field(default_factory=list, repr=False)  # the rendered prompt
    reply_ids: list[int] = dataclasses.field(default_factory=list, repr=False)  # every token sampled

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens actually prefilled this turn."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def interrupted(self) -> bool:
        return self.finish_reason == "cancelled"

    @property
    def prefill_tps(self) -> float:
        return self.computed_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes out of prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class ChatSession:
    def __init__(
        self,
        loaded,
        params: SamplingParams | None = None,
        *,
        system: str | None = None,
        engine_config: EngineConfig | None = None,
        notify: Callable[[str], None] | None = None,
        on_prefill: Callable[[int], None] | None = None,
    ):
        """`loaded`: a LoadedModel (anything with `.model` and `.tokenizer`). `notify` receives one-line notices;
        `on_prefill`, at each turn, how many prompt tokens the turn computes (those not in the conversation's KV
        cache), just before it computes them (a progress line while a long message is read)."""
        self.tokenizer = loaded.tokenizer
        if not self.tokenizer.chat_template:
            raise InputError(
                "this model has no chat template, which chat needs "
                "(for raw text use `mlxcel generate --no-chat-template`)"
            )
        self.engine = Engine(loaded.model, loaded.tokenizer, chat_engine_config(engine_config))
        self.params = params or SamplingParams()
        self.reasoning_kind = detect(self.tokenizer.chat_template)
        if self.reasoning_kind == "harmony":
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)
        self.prompt_ids: list[int] = []  # the turn's rendered prompt (set before its first piece)
        self.notify = notify or (lambda message: None)
        self.on_prefill = on_prefill or (lambda n_tokens: None)
        self.conversation = Conversation()
        self._system = system or None
        self._messages: list[dict] = self._initial_messages()
        self._cancel = False
        self.last_turn: TurnStats | None = None

    # -- state ------------------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        """A copy of the history: system (if any), then user and assistant messages in turn."""
        return [dict(m) for m in self._messages]

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def system(self) -> str | None:
        return self._system

    @system.setter
    def system(self, text: str | None) -> None:
        """Replace the system prompt (None or "" removes it); the rest of the history is kept."""
        if self._system is not None:
            self._messages.pop(0)
        self._system = text or None
        if self._system is not None:
            self._messages.insert(0, {"role": "system", "content": self._system})

    def clear(self) -> None:
        """Start a new conversation: history and KV state go, the system prompt stays."""
        self.conversation = Conversation()
        self._messages = self._initial_messages()
        self.last_turn = None

    def set(self, name: str, value) -> SamplingParams:
        """Change one sampling setting by name (see SETTINGS), e.g. set("temp", "0.7"). Raises InputError."""
        key = name.strip().lower().replace("_", "-")
        if key not in SETTINGS:
            raise InputError(f"unknown setting '{name}'; settable: {SETTABLE}")
        field, kind = SETTINGS[key]
        text = str(value).strip()
        try:
            if kind == "seed" and text.lower() in ("none", "off", "random"):
                parsed = None
            elif kind == "number":
                parsed = float(text)
            else:
                parsed = int(text)
        except ValueError:
            article = "a number" if kind == "number" else "an integer" + (" (or 'none')" if kind == "seed" else "")
            raise InputError(f"{key} must be {article}, got '{value}'") from None
        self.params = dataclasses.replace(self.params, **{field: parsed})  # validates: InputError if bad
        return self.params

    def cancel(self) -> None:
        """Stop the reply being generated (safe from a signal handler); its partial text is kept."""
        self._cancel = True

    # -- turns --------------------------------------------------------------------------------------
    def ask(self, text: str) -> str:
        """Send one user message and return the whole reply."""
        return "".join(self.send(text))

    def send(self, text: str) -> Iterator[str]:
        """Send one user message; yield the reply's text as it is generated (nothing happens until iterated).

        Closing the iterator early, or calling cancel(), interrupts the reply: the text so far stays in the
        history (marked interrupted) and in the KV cache. `last_turn` has the statistics afterwards.
        """
        self._cancel = False  # a cancel() from here on (even while the prompt is rendered) stops this reply
        if not text.strip():
            raise InputError("message is empty")
        messages, dropped = self._fit(self._messages + [{"role": "user", "content": text}])
        prompt_ids = self.prompt_ids = self._render(messages)
        if dropped:
            kept = "; the system prompt is kept" if self._system else ""
            turns = dropped // 2
            self.notify(
                f"context full ({self.max_context} tokens): dropped the oldest {turns} "
                f"turn{'s' if turns != 1 else ''}{kept}"
            )
        seq_id = self.engine.open(prompt_ids, self.params, self.conversation)
        self.on_prefill(len(prompt_ids) - self.conversation.reused(prompt_ids))
        reply = {"role": "assistant", "content": ""}
        self._messages = messages + [reply]
        pieces: list[str] = []
        error = None
        try:
            while self.engine.has_work():
                if self._cancel:
                    self.engine.close(seq_id)
                for out in self.engine.step():
                    if out.seq_id != seq_id:
                        continue
                    if out.finish_reason == "error":
                        error = out.error
                    if out.text:
                        pieces.append(out.text)
                        reply["content"] = "".join(pieces)
                        yield out.text
        finally:  # (reached early too, when the caller stops iterating)
            self._end_turn(seq_id, reply, "".join(pieces), prompt_ids, dropped)
        if error is not None:
            self._messages = messages[:-1]  # the failed turn never happened (its KV state is matched away)
            raise RuntimeFailure(f"generation failed: {error}")

    # -- internals ----------------------------------------------------------------------------------
    def _end_turn(self, seq_id: int, reply: dict, text: str, prompt_ids: list[int], dropped: int) -> None:
        """Cancel the reply if it still runs, step until the engine is idle so that the conversation keeps the KV
        state of everything computed so far, and record the turn: the reply's message and `last_turn`."""
        self.engine.close(seq_id)
        while self.engine.has_work():
            self.engine.step()
        seq = self.engine.sequence(seq_id)
        self.engine.release(seq_id)
        reply.update(self._split(text, prompt_ids))
        if seq.finish_reason == "cancelled":
            reply["interrupted"] = True
        self.last_turn = TurnStats(
            prompt_tokens=len(prompt_ids),
            cached_tokens=seq.cached_tokens,
            generated_tokens=len(seq.output_ids),
            prefill_s=seq.timings.prefill_s if seq.timings.first_token else 0.0,
            decode_s=seq.timings.decode_s if seq.timings.first_token else 0.0,
            finish_reason=seq.finish_reason,
            dropped_messages=dropped,
            prompt_ids=prompt_ids,
            reply_ids=list(seq.output_ids),
        )

    def _initial_messages(self) -> list[dict]:
        return [{"role": "system", "content": self._system}] if self._system else []

    def reply_split(self, prompt_ids: list[int]):
        """The streamed split of a reply to `prompt_ids` (reasoning.SplitStream), or None: no reasoning to split."""
        kind = self.reasoning_kind if self.params.constraint is None else None
        return reply_stream(kind, kind == "think" and opens_inside(self.tokenizer, prompt_ids))

    def _split(self, text: str, prompt_ids: list[int]) -> dict:
        """A reply's history fields: its answer as content, its reasoning apart."""
        split = self.reply_split(prompt_ids)
        if split is None:
            return {"content": text}
        (r1, a1), (r2, a2) = split.feed(text), split.finish()
        return {"content": a1 + a2} | ({"reasoning_content": r1 + r2} if r1 + r2 else {})

    def _render(self, messages: list[dict]) -> list[int]:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(plain, add_generation_prompt=True)

    def _fit(self, messages: list[dict]) -> tuple[list[dict], int]:
        """Drop the oldest user/assistant pairs until prompt + max_tokens fits; return (messages, dropped)."""
        first = 1 if self._system else 0
        messages = list(messages)
        dropped = 0
        while True:
            n = len(self._render(messages))
            if n + self.params.max_tokens <= self.max_context or len(messages) - first < 3:
                break
            del messages[first : first + 2]
            dropped += 2
        if n >= self.max_context:
            raise InputError(
                f"the message does not fit: the prompt has {n} tokens and the model's context is {self.max_context}"
            )
        return messages, dropped
