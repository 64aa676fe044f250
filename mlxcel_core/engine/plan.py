"""What one engine step runs, as plain data: the plan made before any of it is built, each sampled row's lazy token,
and what a mirror of the engine's inputs sees (engine.py drives them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..sampling import SamplingParams
from .scheduler import ScheduledBatch
from .storage import Conversation


@dataclass
class Sampled:
    """A row's sampled token, still lazy until the host reads it."""

    token: mx.array  # [1]: the next step's input for this row
    readout: mx.array  # int32 [1]: the token as the host reads it, -1 where the logits held a NaN
    logprobs: mx.array | None = None  # the row's log-softmax [V] when the request asked for logprobs
    # The batch's (tokens, readout) this row's token and readout are slices of, every row of it sampled in order:
    # the engine submits and reads those two arrays, not a slice per row (each op costs the host time).
    whole: tuple[mx.array, mx.array] | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.token, self.readout, self.logprobs) if isinstance(a, mx.array)]


@dataclass
class StepPlan:
    """What one step runs, decided before any of it is built."""

    batch: ScheduledBatch  # the scheduler's rows: decoding, prefilling, cancelled
    speculate: bool = False  # the lone decoding row runs a speculative round instead of its decode
    graph_row: int | None = None  # the lone decoding row whose step the backend's recorded graph replays
    produced: dict[int, Sampled] = field(default_factory=dict)  # each sampled row's token, filled as it runs


class EngineMirror(Protocol):
    """Sees every input of an Engine (distributed/mirror.py's LeaderMirror sends them to the other ranks)."""

    def prepare(self, params: SamplingParams) -> SamplingParams: ...
    def opened(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        conversation: Conversation | None,
        max_context: int,
    ) -> None: ...
    def closed(self, seq_id: int) -> None: ...
    def before_step(self) -> None: ...
