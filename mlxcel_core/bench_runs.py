"""Driving an Engine with a batch of prompts and timing what the host sees (`mlxcel bench` and the benchmarks/
scripts): seeded random prompts, one timed run of requests, the untimed prefill of a depth prefix, and emptying a
paged prefix cache between repetitions."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from .errors import RuntimeFailure


def random_prompt(vocab_size: int, length: int, *key) -> list[int]:
    """Seeded random ids: the same key gives the same ids in every run and process."""
    rng = random.Random(":".join(str(k) for k in key))
    return [rng.randrange(vocab_size) for _ in range(length)]


@dataclass
class RunTiming:
    """Host-clock timestamps of one engine run (all rows), as the host could read the tokens."""

    submitted: float
    first_token: list[float]  # per row
    end: float  # all rows finished, or the end of the steady-decode window
    window_start: float | None = None  # every row has its first token (steady mode)
    window_tokens: int = 0  # tokens read after window_start (steady mode)
    prefill_computed: int = 0  # prompt tokens the engine computed during the run (Engine.stats)

    @property
    def ttft(self) -> list[float]:
        return [t - self.submitted for t in self.first_token]

    @property
    def all_first_tokens(self) -> float:
        return max(self.first_token)


def prefill_wait_steps(config, prompts: list[list[int]]) -> int:
    """Steps the last of `prompts` (submitted together) may wait for its first token while the earlier rows decode,
    at worst: one prompt after another (a recurrent model's prompts with state-snapshot stops prefill one by one), each
    chunk in a step of its own after prefill_grant_interval decode-only steps (the scheduler's grant), plus the
    readout's lookahead. Steady-mode runs add it to max_tokens so that no row finishes before the window ends."""
    chunks = sum(-(-len(p) // config.resolved_prefill_chunk) for p in prompts)
    return chunks * (config.resolved_prefill_grant_interval + 1) + 2


def run_requests(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    conversations=None,
    steady_tokens: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    params=None,
) -> RunTiming:
    """Submit every prompt at once, greedy, and step the engine; time what the host sees.

    `params`: the rows' SamplingParams instead (benchmarks/structured_outputs.py: constrained rows).

    With `steady_tokens` = n, the run is timed until every row has its first token and then n more decode
    steps of the full batch have been read (`window_tokens` counts them); the rows are then cancelled and
    the engine drained outside the timed region.
    """
    from .sampling import SamplingParams

    params = params or SamplingParams(max_tokens=max_tokens)
    conversations = conversations or [None] * len(prompts)
    before = engine.stats().prefill_tokens
    submitted = clock()
    seq_ids = [engine.open(p, params, c) for p, c in zip(prompts, conversations)]
    progress = _Progress(seq_ids, None if steady_tokens is None else steady_tokens * len(prompts))
    end = None
    try:
        while engine.has_work():
            outputs = engine.step()
            now = clock()
            if progress.read(outputs, now):
                end = now
                break
        computed = engine.stats().prefill_tokens - before
    finally:
        for seq in seq_ids:  # steady mode: stop the rows; a failure: leave the engine clean
            engine.close(seq)
        while engine.has_work():
            engine.step()
        for seq in seq_ids:
            engine.release(seq)
    first = progress.first
    if end is None or len(first) < len(prompts):
        raise RuntimeFailure("the engine stopped before every request produced a token")
    return RunTiming(
        submitted, [first[i] for i in range(len(prompts))], end, progress.window_start, progress.window_tokens, computed
    )


class _Progress:
    """What run_requests has read so far: each row's first token time, the finished rows, and (with a `target` of
    decode tokens) the steady window, which opens when every row has its first token."""

    def __init__(self, seq_ids: list[int], target: int | None):
        self.row_of = {s: i for i, s in enumerate(seq_ids)}
        self.target = target
        self.first: dict[int, float] = {}
        self.done: set[int] = set()
        self.window_start: float | None = None
        self.window_tokens = 0

    def read(self, outputs, now: float) -> bool:
        """Take one step's outputs; whether the timed run ends with them."""
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeFailure(f"generation failed: {out.error}")
            row = self.row_of.get(out.seq_id)
            if row is None:
                continue
            if out.token is not None:
                if row not in self.first:
                    self.first[row] = now
                elif self.window_start is not None:
                    self.window_tokens += 1
            if out.finished:
                self.done.add(row)
        all_done = len(self.done) == len(self.row_of)
        if self.target is None:
            return all_done
        if self.window_start is None and len(self.first) == len(self.row_of):
            self.window_start = now
        return all_done or (self.window_start is not None and self.window_tokens >= self.target)


def prefill_context(engine, prefixes: list[list[int]]):
    """Prefill each row's depth prefix (untimed) and return the Conversations that keep its KV state.

    Dense storage reuses a Conversation's caches; paged storage finds the blocks in its prefix cache.
    """
    from .engine import Conversation

    conversations = [Conversation() for _ in prefixes]
    run_requests(engine, prefixes, 1, conversations)
    return conversations


def forget_cached_prefixes(engine) -> None:
    """Empty the engine's prefix cache, so a repetition never reuses the previous one's (identical) prompt."""
    engine.forget_cached_prefixes()
