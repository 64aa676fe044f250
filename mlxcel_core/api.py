"""The public Python API the CLI itself uses: load a model, build a prompt, generate or stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from .engine import Engine, EngineConfig, FinishReason, SpecStats
from .errors import InputError, RuntimeFailure
from .loading import LoadedModel
from .sampling import SamplingParams
from .tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    peak_memory_gb: float
    speculative: SpecStats | None = None  # with a drafter: rounds, proposed, accepted

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; decode speed counts the ones after it.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class GenerationChunk:
    text: str
    token: int | None
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None  # on the last chunk only


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats


def prepare_prompt(
    tokenizer: Tokenizer, prompt: str, system: str | None = None, chat_template: bool = True
) -> list[int]:
    """Token ids for a user prompt: through the model's chat template when it has one and it is wanted."""
    if not prompt.strip():
        raise InputError("prompt is empty")
    if chat_template and tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if system:
        reason = "--no-chat-template was given" if tokenizer.chat_template else "this model has no chat template"
        raise InputError(f"a system prompt needs the chat template, but {reason}")
    return tokenizer.encode(prompt)


def stream_generate(
    loaded: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    engine_config: EngineConfig | None = None,
    draft: LoadedModel | None = None,
) -> Iterator[GenerationChunk]:
    """Yield text as it is generated; the last chunk has the finish reason and statistics.

    `draft`: the loaded draft model when `engine_config.speculative` names one (else the engine loads it)."""
    mx.reset_peak_memory()
    engine = Engine(loaded.model, loaded.tokenizer, engine_config or EngineConfig(max_batch_size=1), draft=draft)
    seq_id = engine.open(prompt_ids, params)
    try:
        while engine.has_work():
            for out in engine.step():
                if not out.finished:
                    yield GenerationChunk(out.text, out.token)
                    continue
                seq = engine.sequence(seq_id)
                stats = GenerationStats(
                    prompt_tokens=len(prompt_ids),
                    generated_tokens=len(seq.output_ids),
                    prefill_s=seq.timings.prefill_s,
                    decode_s=seq.timings.decode_s,
                    peak_memory_gb=mx.get_peak_memory() / 1e9,
                    speculative=seq.spec if engine.config.speculative is not None else None,
                )
                if out.finish_reason == "error":
                    raise RuntimeFailure(f"generation failed: {out.error}")
                yield GenerationChunk(out.text, out.token, out.finish_reason, stats)
    finally:
        engine.close(seq_id)


def generate(
    loaded: LoadedModel,
    prompt: str,
    params: SamplingParams | None = None,
    *,
    system: str | None = None,
    chat_template: bool = True,
    engine_config: EngineConfig | None = None,
) -> GenerationResult:
    """Generate a whole completion for a text prompt."""
    params = params or SamplingParams()
    prompt_ids = prepare_prompt(loaded.tokenizer, prompt, system, chat_template)
    pieces, tokens = [], []
    for chunk in stream_generate(loaded, prompt_ids, params, engine_config):
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.stats is not None:
            return GenerationResult("".join(pieces), tokens, chunk.finish_reason, chunk.stats)
    raise RuntimeError("generation ended without a final chunk")  # engine invariant, not user input
