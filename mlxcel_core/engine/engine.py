"""Engine: open sequences, step the running batch, close them.

v0 scheduling: sequences opened while no batch runs are prefilled together as one batch, which
then decodes until every row has finished; sequences opened meanwhile wait for the next batch.

Each step is pipelined one token ahead: step n+1's forward is submitted (mx.async_eval) before the
host reads step n's tokens, so the device never idles while Python checks stops and detokenizes.
"""

from __future__ import annotations

import itertools
import time

import mlx.core as mx

from ..detokenizer import IncrementalDetokenizer, StopMatcher
from ..errors import InputError
from ..models.base import CausalLM
from ..sampling import RowSampler, SamplingParams
from ..tokenizer import Tokenizer
from .runner import ModelRunner
from .types import FinishReason, Sequence, StepOutput

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens the detokenizer sees so the first word keeps its space


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, max_batch_size: int = 8):
        self.runner = ModelRunner(model)
        self.tokenizer = tokenizer
        self.max_context = model.max_context_length
        self.max_batch_size = max_batch_size
        self._ids = itertools.count()
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._sequences: dict[int, Sequence] = {}
        self._next_tokens: mx.array | None = None  # submitted, not yet read: one token per running row

    # -- public API -------------------------------------------------------------------------
    def open(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise InputError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InputError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        seq = Sequence(
            seq_id=next(self._ids),
            prompt_ids=list(prompt_ids),
            params=params,
            sampler=RowSampler(params),
            detokenizer=IncrementalDetokenizer(self.tokenizer.decode, prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
            stop_matcher=StopMatcher(params.stop),
        )
        self._sequences[seq.seq_id] = seq
        self._waiting.append(seq)
        return seq.seq_id

    def close(self, seq_id: int) -> None:
        """Cancel a sequence; its row is dropped at the next step."""
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.finish_reason is None:
            seq.cancel_requested = True

    def sequence(self, seq_id: int) -> Sequence:
        return self._sequences[seq_id]

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's bookkeeping."""
        self._sequences.pop(seq_id, None)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[StepOutput]:
        outputs = self._drop_cancelled()
        if not self._running:
            if not self._waiting:
                return outputs
            self._start_batch()
        current = self._next_tokens
        if self._may_continue():
            self._next_tokens = self._sample(self.runner.decode(current))
            mx.async_eval(self._next_tokens)
        else:
            self._next_tokens = None
        outputs += self._commit(current.tolist())
        return outputs

    # -- internals ----------------------------------------------------------------------------
    def _start_batch(self) -> None:
        self._running, self._waiting = self._waiting[: self.max_batch_size], self._waiting[self.max_batch_size:]
        now = time.perf_counter()
        for seq in self._running:
            seq.timings.prefill_start = now
        logits = self.runner.prefill([s.prompt_ids for s in self._running])
        self._next_tokens = self._sample(logits)
        mx.async_eval(self._next_tokens)

    def _sample(self, logits: mx.array) -> mx.array:
        if all(s.params.greedy for s in self._running):
            return mx.argmax(logits, axis=-1)
        return mx.concatenate([s.sampler(logits[i : i + 1]) for i, s in enumerate(self._running)])

    def _may_continue(self) -> bool:
        """False when every row is certain to finish on the token being read now."""
        return any(not self._at_length_limit(s, extra=1) for s in self._running)

    def _at_length_limit(self, seq: Sequence, extra: int = 0) -> bool:
        generated = len(seq.output_ids) + extra
        return generated >= seq.params.max_tokens or len(seq.prompt_ids) + generated >= self.max_context

    def _commit(self, tokens: list[int]) -> list[StepOutput]:
        outputs, keep = [], []
        now = time.perf_counter()
        for row, (seq, token) in enumerate(zip(self._running, tokens)):
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            out = self._append(seq, token)
            outputs.append(out)
            if out.finished:
                seq.timings.finished = now
            else:
                keep.append(row)
        self._keep_rows(keep)
        return outputs

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        seq.output_ids.append(token)
        reason: FinishReason | None = None
        if token in self.tokenizer.eos_token_ids:
            reason, text = "stop", self._flush(seq)
        else:
            text, stopped = seq.stop_matcher.feed(seq.detokenizer.add(token))
            if stopped:
                reason = "stop"  # the stop string and anything after it are never emitted
            elif self._at_length_limit(seq):
                reason = "length"
                text += self._flush(seq)
        seq.finish_reason = reason
        return StepOutput(seq.seq_id, token, text, reason)

    @staticmethod
    def _flush(seq: Sequence) -> str:
        """Text held back for a possible stop string or partial character, now that no more follows."""
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
        return text if stopped else text + seq.stop_matcher.flush()

    def _drop_cancelled(self) -> list[StepOutput]:
        outputs = []
        for seq in list(self._waiting):
            if seq.cancel_requested:
                self._waiting.remove(seq)
                seq.finish_reason = "cancelled"
                outputs.append(StepOutput(seq.seq_id, None, "", "cancelled"))
        keep = []
        for row, seq in enumerate(self._running):
            if seq.cancel_requested:
                seq.finish_reason = "cancelled"
                seq.timings.finished = time.perf_counter()
                outputs.append(StepOutput(seq.seq_id, None, "", "cancelled"))
            else:
                keep.append(row)
        if len(keep) != len(self._running):
            self._keep_rows(keep)
        return outputs

    def _keep_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._next_tokens = None
            self.runner.release()
            return
        self.runner.keep_rows(keep)
        if self._next_tokens is not None:
            self._next_tokens = self._next_tokens[mx.array(keep)]
