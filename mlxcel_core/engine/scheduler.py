"""BatchScheduler: admission, chunked prefill and decode policy. No MLX here: plain data in and out.

Each call to `schedule()` plans one engine step:
- admit waiting requests (FIFO) while the batch has room and their KV reservation fits the budget;
  a request that could never fit is refused when it is added;
- decode every row that has produced a token and has not reached its token limit, in one forward;
- give at most one prefill chunk (`prefill_chunk_size` tokens) to the oldest unfinished prefill:
  always when nothing decodes or when the request has not started yet (so a new arrival stalls running
  decodes for one chunk at most), otherwise once every `prefill_grant_interval` decode steps; a chunk ends at
  each of the request's stops (positions the storage keeps a recurrent state at, engine/state_snapshots.py);
- with `prefill_batch_size` > 1, when that chunk starts its prompt and ends it or its first stop, add other
  admitted prompts that have not started to the same forward (`together`), each from its start to its first stop
  (`last` False) or its end, up to that many prompts and `prefill_chunk_size` tokens counted padded (prompts x the
  longest; a chunk that ends at a stop is never padded). The rest of a prompt that stopped early there goes before
  other prefills and is granted as a prompt not started is, without waiting for the grant interval: its first token
  comes as soon as it would have alone; such rests that start and end at the same positions share a forward too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import InputError


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8
    prefill_chunk_size: int = 2048
    prefill_grant_interval: int = 16
    kv_budget_tokens: int | None = None  # None: no limit
    prefill_batch_size: int = 1  # whole prompts one prefill forward may take
    state_tokens: int = 0  # a sequence's recurrent state in KV-budget tokens (budget.state_tokens_per_sequence)

    def __post_init__(self):
        if min(self.max_batch_size, self.prefill_chunk_size, self.prefill_grant_interval, self.prefill_batch_size) < 1:
            raise InputError(
                "max_batch_size, prefill_chunk_size, prefill_grant_interval and prefill_batch_size must be >= 1"
            )


@dataclass(frozen=True)
class PrefillWork:
    seq_id: int
    start: int  # first prompt position to compute
    end: int  # one past the last
    last: bool  # the chunk that ends the prompt: its logits give the first token


@dataclass(frozen=True)
class ScheduledBatch:
    decode: tuple[int, ...] = ()
    prefill: PrefillWork | None = None
    together: tuple[PrefillWork, ...] = ()  # whole prompts prefilled in the same forward as `prefill` (one too)
    admitted: tuple[int, ...] = ()
    cancelled: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.admitted or self.cancelled)

    @property
    def prefills(self) -> tuple[PrefillWork, ...]:
        """Every prefill of this step, one forward: `prefill` and those `together` with it."""
        return () if self.prefill is None else (self.prefill, *self.together)


@dataclass
class _Request:
    seq_id: int
    prompt_len: int
    max_tokens: int
    computed: int = 0  # prompt tokens in the KV cache (computed or reused from the prefix cache)
    produced: int = 0  # tokens sampled so far, read or not
    started: bool = False
    cancelled: bool = False
    state_tokens: int = 0  # the recurrent state's share of the KV budget
    stops: tuple[int, ...] = ()  # prompt positions a prefill chunk must end at
    eager: bool = False  # stopped early in a forward with others: its rest is granted without waiting

    @property
    def reservation(self) -> int:
        return self.prompt_len + self.max_tokens + self.state_tokens


class BatchScheduler:
    def __init__(
        self, config: SchedulerConfig, on_admit: Callable[[int], int | tuple[int, tuple[int, ...]]] = lambda seq_id: 0
    ):
        """`on_admit(seq_id)` sets up the sequence's storage and returns its prompt tokens already cached, or those and
        the positions its prefill chunks must end at."""
        self.config = config
        self._on_admit = on_admit
        self._waiting: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}  # admitted, in admission order
        self._reserved = 0
        self._decode_steps_since_prefill = 0

    # -- requests ------------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_len: int, max_tokens: int) -> None:
        request = _Request(seq_id, prompt_len, max_tokens, state_tokens=self.config.state_tokens)
        budget = self.config.kv_budget_tokens
        if budget is not None and request.reservation > budget:
            state = f" + recurrent state {request.state_tokens}" if request.state_tokens else ""
            raise InputError(
                f"request needs {request.reservation} KV tokens (prompt {prompt_len} + max_tokens "
                f"{max_tokens}{state}) but the KV budget holds {budget}"
            )
        self._waiting.append(request)

    def cancel(self, seq_id: int) -> None:
        for request in list(self._waiting) + list(self._active.values()):
            if request.seq_id == seq_id:
                request.cancelled = True

    def finish(self, seq_id: int) -> None:
        """The engine ended this sequence (stop, length, error): free its slot and reservation."""
        request = self._active.pop(seq_id, None)
        if request is not None:
            self._reserved -= request.reservation

    def advance(self, seq_id: int, extra: int) -> None:
        """The sequence produced `extra` tokens beyond the one its decode step was planned for (speculation)."""
        request = self._active.get(seq_id)
        if request is not None:
            request.produced += extra

    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._active)

    # -- planning ----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cancelled = self._drop_cancelled()
        admitted = self._admit()
        decode = tuple(
            r.seq_id for r in self._active.values() if r.computed == r.prompt_len and 0 < r.produced < r.max_tokens
        )
        prefill = self._next_prefill(bool(decode))
        together = self._prefill_together(prefill) if prefill is not None else ()
        for seq_id in decode:
            self._active[seq_id].produced += 1
        if prefill is not None:
            self._decode_steps_since_prefill = 0
        elif decode:
            self._decode_steps_since_prefill += 1
        return ScheduledBatch(decode, prefill, together, admitted, cancelled)

    def _drop_cancelled(self) -> tuple[int, ...]:
        gone = [r.seq_id for r in self._waiting if r.cancelled]
        self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for request in [r for r in self._active.values() if r.cancelled]:
            gone.append(request.seq_id)
            self.finish(request.seq_id)
        return tuple(gone)

    def _admit(self) -> tuple[int, ...]:
        admitted = []
        budget = self.config.kv_budget_tokens
        while self._waiting and len(self._active) < self.config.max_batch_size:
            head = self._waiting[0]
            if budget is not None and self._reserved + head.reservation > budget:
                break  # it fits once running rows finish; FIFO keeps arrival order fair
            self._waiting.popleft()
            self._active[head.seq_id] = head
            self._reserved += head.reservation
            admitted_as = self._on_admit(head.seq_id)
            cached, head.stops = admitted_as if isinstance(admitted_as, tuple) else (admitted_as, ())
            # Keep at least the last prompt token to compute: its logits give the first token.
            head.computed = min(cached, head.prompt_len - 1)
            admitted.append(head.seq_id)
        return tuple(admitted)

    def _next_prefill(self, decoding: bool) -> PrefillWork | None:
        unfinished = [r for r in self._active.values() if r.computed < r.prompt_len]
        if not unfinished:
            return None
        request = next((r for r in unfinished if r.eager), unfinished[0])  # the rest of a forward with others first
        granted = (
            not decoding
            or not request.started
            or request.eager
            or self._decode_steps_since_prefill >= self.config.prefill_grant_interval
        )
        if not granted:
            return None
        start, end = request.computed, self._chunk_end(request)
        request.computed, request.started = end, True
        last = end == request.prompt_len
        if last:
            request.produced = 1
        return PrefillWork(request.seq_id, start, end, last)

    def _chunk_end(self, request: _Request) -> int:
        """Where the request's next prefill chunk ends: a chunk on, at its next stop, or at its prompt's end."""
        start = request.computed
        stops = (stop for stop in request.stops if stop > start)
        return min(request.prompt_len, start + self.config.prefill_chunk_size, *stops)

    def _prefill_together(self, first: PrefillWork) -> tuple[PrefillWork, ...]:
        """Prompts not started yet to prefill in `first`'s forward (itself a prompt's first chunk, ending the prompt
        or at its first stop), each up to its first stop or its end. A chunk that ends at a stop is never padded (the
        forward is as long as it): the recurrent layers' chunked scans group positions from a row's first column, so
        only an unpadded row computes its state at the stop as its chunk prefilled alone does (the same snapshot)."""
        limit, budget = self.config.prefill_batch_size, self.config.prefill_chunk_size
        if limit > 1 and first.start != 0 and self._active[first.seq_id].eager:
            return self._rests_together(first)
        if limit == 1 or first.start != 0 or first.end != _first_end(self._active[first.seq_id]):
            return ()
        longest, fixed, together = first.end, first.end in self._active[first.seq_id].stops, []
        for request in self._active.values():
            if len(together) + 1 == limit:
                break
            if request.started or request.computed != 0:
                continue  # under way, or part of its prompt from the prefix cache: prefilled on its own
            end = _first_end(request)
            last, stop = end == request.prompt_len, end in request.stops
            if (end > longest and fixed) or (end < longest and stop):
                continue  # it would pad a chunk that ends at a stop
            if (len(together) + 2) * max(longest, end) > budget:
                continue  # a shorter one further on may still fit
            longest, fixed = max(longest, end), fixed or stop
            request.computed, request.started, request.produced = end, True, int(last)
            together.append(PrefillWork(request.seq_id, 0, end, last))
        if together:
            for work in (first, *together):
                self._active[work.seq_id].eager = not work.last
        return tuple(together)

    def _rests_together(self, first: PrefillWork) -> tuple[PrefillWork, ...]:
        """The next chunks of other prompts that stopped early in a forward with others, where they start and end
        where `first` (such a chunk) does: one forward of unpadded rows at the same positions."""
        limit, budget = self.config.prefill_batch_size, self.config.prefill_chunk_size
        length, together = first.end - first.start, []
        for request in self._active.values():
            if len(together) + 1 == limit or (len(together) + 2) * length > budget:
                break
            if not request.eager or request.computed != first.start or self._chunk_end(request) != first.end:
                continue
            last = first.end == request.prompt_len
            request.computed, request.produced = first.end, int(last)
            together.append(PrefillWork(request.seq_id, first.start, first.end, last))
        return tuple(together)


def _first_end(request: _Request) -> int:
    """Where a not started prompt's first chunk in a forward with others ends: its first stop, else its end."""
    return min((request.prompt_len, *request.stops))
