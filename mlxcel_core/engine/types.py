"""Plain data passed between the engine, its scheduler, its runner and callers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ..detokenizer import IncrementalDetokenizer, StopMatcher
from ..errors import InputError
from ..sampling import RowSampler, SamplingParams

FinishReason = Literal["stop", "length", "cancelled", "error"]
StorageKind = Literal["auto", "dense", "paged"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py): one drafter proposes up to `num_draft_tokens` per round."""

    num_draft_tokens: int = 5
    ngram: int = 0  # prompt lookup: match the sequence's last 1..ngram tokens earlier in it (0 = off)
    draft_model: str | None = None  # a smaller model with the same tokenizer (path, .gguf or Hub id)

    def __post_init__(self):
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 64:
            raise InputError(f"num-draft-tokens must be an integer in [1, 64], got {self.num_draft_tokens}")
        if not isinstance(self.ngram, int) or not 0 <= self.ngram <= 16:
            raise InputError(f"draft-ngram must be an integer in [0, 16] (0 = off), got {self.ngram}")
        if self.ngram and self.draft_model:
            raise InputError("give one drafter: --draft-ngram (prompt lookup) or --draft-model, not both")
        if not self.ngram and not self.draft_model:
            raise InputError("speculative decoding needs a drafter: --draft-ngram N or --draft-model PATH")


@dataclass
class SpecStats:
    """Speculative decoding counters (per sequence, and engine totals)."""

    rounds: int = 0  # verify forwards
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens the target's sampler agreed with

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per round (each round also emits one token of the target's own)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted


SOLO_PREFILL_CHUNK = 2048  # prompt tokens a batch-1 prefill forward computes (bounds memory on long prompts)


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 1
    prefill_chunk_size: int | None = None  # prompt tokens a prefill forward computes; None: the backend's
    # decode steps between two chunks of a started prompt while rows decode; None: the backend's (16 on a GPU, 1 on
    # CPU)
    prefill_grant_interval: int | None = None
    storage: StorageKind = "auto"  # auto: paged when batching or when decode steps compile on CUDA, else dense
    kv_bits: int | None = None  # 8 or 4: quantized KV cache
    block_size: int = 32
    kv_budget_tokens: int | None = None  # None: as much as memory allows
    prefix_cache: bool = True  # paged storage only
    lookahead: bool = True  # submit step n+1 before reading step n
    # decode steps as one compiled graph (engine/compiled_decode.py); None: the backend's default (on a GPU)
    compile_decode: bool | None = None
    # a lone greedy row's decode steps replayed as one recorded graph, where the backend has one (CUDA)
    decode_graph: bool = True
    # split-K factor of paged decode attention; None: chosen per shape (MLXCEL_PAGED_DECODE_SPLITS >
    # autotune cache per MLXCEL_AUTOTUNE > heuristic), as `mlxcel tune` measures it
    num_splits: int | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # whole prompts one prefill forward may take (paged storage, unquantized KV; else one at a time); None: the
    # backend's default (several on a GPU, 1 on CPU)
    prefill_batch_size: int | None = None
    max_context: int | None = None  # cap on the model's context (prompt + completion tokens); None: the model's

    @property
    def resolved_prefill_chunk(self) -> int:
        """prefill_chunk_size; else, batching, the backend's (backends/base.py: a chunk holds the running rows about
        a second at most); at batch 1, where no row runs beside a prefill, SOLO_PREFILL_CHUNK."""
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        if self.max_batch_size == 1:
            return SOLO_PREFILL_CHUNK
        from .. import backends

        return backends.current().prefill_chunk()

    @property
    def resolved_prefill_grant_interval(self) -> int:
        if self.prefill_grant_interval is not None:
            return self.prefill_grant_interval
        from .. import backends

        return backends.current().prefill_grant_interval()

    @property
    def resolved_prefill_batch(self) -> int:
        if self.resolved_storage != "paged" or self.kv_bits is not None:  # (a quantized pool's prefill reads back)
            return 1
        if self.prefill_batch_size is not None:
            return self.prefill_batch_size
        from .. import backends

        return backends.current().prefill_batch()

    @property
    def resolved_storage(self) -> str:
        """auto: paged when batching; at batch 1 paged too where decode steps compile on CUDA (a dense step cannot
        compile there without leaving MLX's fused attention, see compiled_decode.py), else dense."""
        if self.storage != "auto":
            return self.storage
        if self.max_batch_size > 1:
            return "paged"
        from .compiled_decode import compile_enabled, dense_mask_is_slow

        paged_compiles = self.kv_bits is None and self.speculative is None and compile_enabled(self.compile_decode)
        return "paged" if paged_compiles and dense_mask_is_slow() else "dense"

    def kv_budget_for(self, max_context: int) -> int | None:
        """KV tokens the engine admits: the explicit budget; else, paged (always a finite pool), the whole context
        at batch 1 (its pools grow as blocks are used) or DEFAULT_KV_BUDGET_TOKENS when batching; dense: no limit."""
        if self.kv_budget_tokens is not None or self.resolved_storage != "paged":
            return self.kv_budget_tokens
        if self.max_batch_size == 1:
            return max_context
        from .paged import DEFAULT_KV_BUDGET_TOKENS

        return DEFAULT_KV_BUDGET_TOKENS


@dataclass(frozen=True)
class EngineStats:
    """Engine.stats(): what the server's metrics and the benchmarks read."""

    running: int  # sequences admitted and not finished
    waiting: int  # sequences queued for admission
    prefill_tokens: int  # prompt tokens computed so far (prefix-cache hits are not)
    storage: dict[str, int]  # the KV storage's own counters (PagedStorage.stats, DenseStorage.stats)
    speculative: SpecStats | None  # engine totals, with a drafter
    graph_replayed: int | None  # decode steps replayed as a recorded graph; None: the engine has no replayer
    graph_not_replaying: str | None = None  # why the engine's replayer stopped replaying, if it did


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    seq_id: int
    token: int | None  # None when the sequence ended without a new token (cancel, error)
    text: str  # newly completed text, stop strings removed
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprob: float | None = None  # of `token`, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # most likely alternatives, best first
    # "error" because the row's constraint (structured output) reached a dead end: the output failed, not the server
    dead_end: bool = False

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
    max_tokens: int  # params.max_tokens, capped by the model's context
    sampler: RowSampler
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: SequenceTimings = field(default_factory=SequenceTimings)
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding, when the engine has a drafter
    constraint: Any = None  # a constrained row's grammar state (constrained.RowConstraint); dropped when it ends

    def flush_text(self) -> str:
        """Text held back for a possible stop string or partial character, now that no more follows."""
        text, stopped = self.stop_matcher.feed(self.detokenizer.flush())
        return text if stopped else text + self.stop_matcher.flush()
