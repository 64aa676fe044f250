"""Plain data passed between the engine, its runner and callers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from ..detokenizer import IncrementalDetokenizer, StopMatcher
from ..sampling import RowSampler, SamplingParams

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    seq_id: int
    token: int | None  # None when the sequence ended without a new token (cancel)
    text: str  # newly completed text, stop strings removed
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SequenceTimings:
    opened: float = field(default_factory=time.perf_counter)
    prefill_start: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def prefill_s(self) -> float:
        return (self.first_token or 0.0) - (self.prefill_start or 0.0)

    @property
    def decode_s(self) -> float:
        return (self.finished or 0.0) - (self.first_token or 0.0)


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RowSampler
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cancel_requested: bool = False
    timings: SequenceTimings = field(default_factory=SequenceTimings)
