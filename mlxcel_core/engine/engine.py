"""Engine: the one decode loop behind generate, run and serve. A single sequence is a batch of one.

Each `step()` reads top to bottom: the scheduler's batch becomes a plan (plain data: which rows decode, which
prompts prefill, whether a row speculates or replays the backend's recorded decode step); the plan runs (one
forward for every decoding row, plus one prefill chunk or several whole prompts in one forward), every row is
sampled by its own sampler, the step is submitted to the device, and the *previous* step's tokens are read on the
host while the device computes this one (lookahead pipelining), stops applied.
A failing row ends with finish_reason "error"; the others go on.
A constrained row (structured output, constrained.py) has its grammar's token mask applied before its sampler's
stages; the mask needs the row's last token, so its step reads the previous step right after submitting the forward
and computes the mask on the host while the device runs that forward.
With a drafter configured, a sequence that decodes alone runs a speculative round instead of its
decode (speculative.py: draft, verify in one forward, trim); while batching, rows decode plainly.
What differs by backend (the greedy readout, the decode-step replayer) comes from backends.current().
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import mlx.core as mx
import numpy as np

from .. import backends
from ..backends.base import readout_of
from ..detokenizer import IncrementalDetokenizer, StopMatcher
from ..distributed.group import is_launched
from ..errors import InputError
from ..models.base import CausalLM, has_recurrent_layers
from ..sampling import RowSampler, SamplingParams, token_logprobs
from ..tokenizer import Tokenizer
from . import constrained
from .budget import state_tokens_per_sequence
from .compiled_decode import compile_enabled
from .dry_cache import DryBreakerCache
from .mask_worker import MaskWorker
from .plan import EngineMirror, Sampled, StepPlan
from .runner import ModelRunner
from .scheduler import BatchScheduler, ScheduledBatch, SchedulerConfig
from .speculative import Speculator, make_drafter, verify
from .storage import Conversation, make_storage
from .types import EngineConfig, EngineStats, FinishReason, Sequence, StepOutput

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens the detokenizer sees so the first word keeps its space


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        draft=None,
        dry_cache: DryBreakerCache | None = None,
    ):
        """`draft`: the loaded draft model config.speculative names; `dry_cache`: DRY breakers tokenized elsewhere."""
        self.config = config or EngineConfig()
        self.backend = backends.current()
        self.tokenizer = tokenizer
        self.max_context = min(model.max_context_length, self.config.max_context or model.max_context_length)
        compiled = compile_enabled(self.config.compile_decode)
        self.storage = make_storage(model, self.config, compiled)
        self.runner = ModelRunner(model, self.storage, compiled)
        self.scheduler = BatchScheduler(
            SchedulerConfig(
                max_batch_size=self.config.max_batch_size,
                prefill_chunk_size=self.config.resolved_prefill_chunk,
                prefill_grant_interval=self.config.resolved_prefill_grant_interval,
                kv_budget_tokens=self.config.kv_budget_for(self.max_context),
                prefill_batch_size=self._prefill_batch(),
                state_tokens=state_tokens_per_sequence(model, self.config.kv_bits),
            ),
            on_admit=self._admit,
        )
        self.graph = self._make_graph(model)
        self._ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}
        self._latest: dict[int, mx.array] = {}  # newest sampled token per row, maybe not read yet
        self._latest_batch: tuple = ((), [], None)  # the last whole batch: its rows, their tokens, its token array
        # Submitted steps not read yet, oldest first: each row's sampled token and the rows' tokens as one int32
        # vector (-1 where NaN).
        self._unread: list[tuple[dict[int, Sampled], mx.array]] = []
        self._conversations: dict[int, Conversation | None] = {}
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None) or tokenizer.vocab_size
        self.dry_cache = dry_cache if dry_cache is not None else DryBreakerCache(tokenizer)
        self.speculator: Speculator | None = None
        self._grammars: constrained.Grammars | None = None  # made at the first constrained row
        # Where a constrained step's host work runs beside its forward's submission (mask_worker.py), and the rows it
        # ended meanwhile, whose storage the engine's thread frees.
        self._mask_worker = MaskWorker() if self.backend.masks_on_worker() else None
        self._ended_on_worker: list[Sequence] | None = None
        # Rank 0 under tensor parallelism: a LeaderMirror that sends this engine's inputs to the other ranks.
        self.mirror: EngineMirror | None = None
        if self.config.speculative is not None:
            drafter = make_drafter(self.config.speculative, tokenizer, self.config.resolved_prefill_chunk, draft)
            self.speculator = Speculator(self.config.speculative, drafter)

    # -- public API -------------------------------------------------------------------------
    def open(self, prompt_ids: list[int], params: SamplingParams, conversation: Conversation | None = None) -> int:
        """Queue a sequence. With a `conversation`, KV state of earlier turns is reused and kept for the next."""
        if not prompt_ids:
            raise InputError("prompt is empty")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            capped = self.config.max_context is not None and self.max_context == self.config.max_context
            context = "the context is capped at" if capped else "the model's context is"
            raise InputError(f"prompt has {len(prompt_ids)} tokens; {context} {self.max_context}")
        params.check_token_ids(self.vocab_size)
        if self.mirror is not None:
            params = self.mirror.prepare(params)
        row_constraint = None
        if params.constraint is not None:  # ConstraintError (an InputError) when its grammar is known to be bad
            if self._grammars is None:
                self._grammars = constrained.Grammars(self.tokenizer, self.vocab_size)
            row_constraint = self._grammars.open(params.constraint)
        keep = not params.skip_special_tokens  # (other tokenizers, e.g. the benchmarks', take ids alone)
        decode = partial(self.tokenizer.decode, skip_special_tokens=False) if keep else self.tokenizer.decode
        seq = Sequence(
            seq_id=next(self._ids),
            prompt_ids=list(prompt_ids),
            params=params,
            max_tokens=min(params.max_tokens, room),
            sampler=RowSampler(params, len(prompt_ids), self._breakers(params)),
            detokenizer=IncrementalDetokenizer(decode, prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
            stop_matcher=StopMatcher(params.stop),
            constraint=row_constraint,
        )
        self.scheduler.add(seq.seq_id, len(prompt_ids), seq.max_tokens)
        self._sequences[seq.seq_id] = seq
        self._conversations[seq.seq_id] = conversation
        if self.mirror is not None:
            self.mirror.opened(seq.seq_id, prompt_ids, params, conversation, self.max_context)
        return seq.seq_id

    def close(self, seq_id: int) -> None:
        """Cancel a sequence; its resources are freed at the next step."""
        seq = self._sequences.get(seq_id)
        if seq is not None and seq.finish_reason is None:
            self.scheduler.cancel(seq_id)
            if self.mirror is not None:
                self.mirror.closed(seq_id)

    def sequence(self, seq_id: int) -> Sequence:
        return self._sequences[seq_id]

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's bookkeeping."""
        self._sequences.pop(seq_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unread)

    def stats(self) -> EngineStats:
        """What the server's metrics and the benchmarks report, without reaching into the engine's parts."""
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            prefill_tokens=self.runner.prefill_tokens,
            storage=self.storage.stats(),
            speculative=self.speculator.stats if self.speculator is not None else None,
            graph_replayed=self.graph.replayed if self.graph is not None else None,
            graph_not_replaying=self.graph.why_not if self.graph is not None and not self.graph.usable else None,
        )

    def forget_cached_prefixes(self) -> None:
        """Empty the prefix cache (benchmarks: a repetition must never reuse the previous one's identical prompt)."""
        self.storage.forget_cached()

    def step(self) -> list[StepOutput]:
        """Plan a step, run it, submit it, and read what is due."""
        if self.mirror is not None:
            self.mirror.before_step()
        if self.graph is not None and self.scheduler.num_waiting:
            self.graph.settle()  # admitting a sequence sets up its storage
        speculate = self.speculator is not None and sum(1 for _ in self._live()) == 1
        sync = not self.config.lookahead or speculate or any(s.params.needs_history for s in self._live())
        outputs = self._commit(keep=0) if sync else []
        plan = self._plan(self.scheduler.schedule(), sync, speculate)
        if self.graph is not None and plan.graph_row is None:
            self.graph.settle()  # MLX runs this step: the replayed steps before it first
        outputs += [self._end(self._sequences[s], "cancelled", token=None) for s in plan.batch.cancelled]
        outputs += self._decode(plan)
        outputs += self._prefill(plan)
        self._submit(plan.produced)
        # Read everything but this step (all of it when sync): the device computes it while the host reads.
        outputs += self._commit(keep=0 if sync or not plan.produced else 1)
        return outputs

    # -- a step, in order -------------------------------------------------------------------------
    def _plan(self, batch: ScheduledBatch, sync: bool, speculate: bool) -> StepPlan:
        """`sync`: every submitted step was read first (sampling processors or a drafter need every token so far);
        a replayed graph step is for a lone greedy row that nothing reads back early."""
        plan = StepPlan(batch, speculate=speculate and bool(batch.decode))
        if not (sync or speculate):
            plan.graph_row = self._graph_row(batch)
        return plan

    def _decode(self, plan: StepPlan) -> list[StepOutput]:
        """The decoding rows' step: a speculative round, a replayed graph, or one forward for all of them."""
        decode = plan.batch.decode
        if plan.speculate:
            speculated = self._speculate(self._sequences[decode[0]])
            if speculated is not None:
                return speculated
        if plan.graph_row is not None:
            return self._graph_decode(plan.graph_row, plan.produced)
        if not decode:
            return []
        tokens = self._latest_tokens(decode)
        return self._run(decode, plan.produced, lambda: self.runner.decode(decode, tokens))

    def _latest_tokens(self, decode: list[int]) -> mx.array:
        """The decoding rows' newest tokens as one array: the last batch's own token array where these rows are its
        rows, in order, and their newest tokens still its slices (no slices and concatenation to build)."""
        seq_ids, tokens, whole = self._latest_batch
        if seq_ids == tuple(decode) and all(self._latest[s] is t for s, t in zip(decode, tokens)):
            return whole
        return mx.concatenate([self._latest[s] for s in decode])  # one row: the array itself

    def _prefill(self, plan: StepPlan) -> list[StepOutput]:
        """Chunks of several prompts in one forward, or one chunk of one prompt (a row is sampled where its chunk ends
        its prompt)."""
        works = plan.batch.prefills
        if not works:
            return []
        now = time.perf_counter()
        for timings in (self._sequences[w.seq_id].timings for w in works):
            timings.prefill_start = timings.prefill_start or now
        seq_ids, sampled = tuple(w.seq_id for w in works), tuple(w.seq_id for w in works if w.last)
        chunks = [self._sequences[w.seq_id].prompt_ids[w.start : w.end] for w in works]
        if plan.batch.together:  # (their chunks start at 0, or all at one position: the scheduler's `together`)
            run = lambda: self.runner.prefill_together(seq_ids, chunks, [w.last for w in works], works[0].start)
        else:
            run = lambda: self.runner.prefill(seq_ids[0], chunks[0], works[0].start, works[0].last)
        return self._run(seq_ids, plan.produced, run, sampled)

    def _submit(self, produced: dict[int, Sampled]) -> None:
        """Hand the step to the device. The host reads its rows as one vector (-1: NaN logits), built and submitted
        now with the step: made later in _commit it would queue behind the next step's forward and wait for it."""
        if not produced:
            return
        rows = list(produced.values())
        whole = rows[0].whole
        if whole is not None and len(rows) == whole[1].size and all(r.whole is whole for r in rows):
            readout, arrays = whole[1], list(whole)  # one batch, every row of it: its two arrays, not a slice per row
            self._latest_batch = (tuple(produced), [r.token for r in rows], whole[0])
        else:
            readouts = [r.readout for r in rows]
            readout = readouts[0] if len(readouts) == 1 else mx.concatenate(readouts)
            arrays = [a for r in rows for a in r.arrays()] + ([readout] if isinstance(readout, mx.array) else [])
        mx.async_eval(arrays)  # (a replay's readout is the host's own)
        self._latest.update({s: sampled.token for s, sampled in produced.items()})
        self._unread.append((produced, readout))

    # -- internals ----------------------------------------------------------------------------
    def _make_graph(self, model: CausalLM):
        """The backend's replayer of a lone greedy row's decode steps (one recorded graph), where it has one and the
        engine's steps can be replayed: paged unquantized KV, no drafter, not a tensor-parallel rank."""
        config = self.config
        if not config.decode_graph or config.resolved_storage != "paged" or config.kv_bits is not None:
            return None
        if config.speculative is not None or is_launched() or has_recurrent_layers(model):  # (no state pool there)
            return None
        graph = self.backend.graph_decoder(model, self.storage, lambda seq_id: seq_id in self._latest)
        if graph is not None:
            self.storage.pad_block_tables = True  # one recording serves until the table's width doubles
        return graph

    def _prefill_batch(self) -> int:
        """Whole prompts a prefill forward may take. A tensor-parallel rank ignores the backend's default: every rank
        must plan the same forwards (distributed/mirror.py), and a rank on another host may not share this one's
        backend (EngineConfig.prefill_batch_size, the same on every rank, applies)."""
        if is_launched() and self.config.prefill_batch_size is None:
            return 1
        return self.config.resolved_prefill_batch

    def _live(self):
        return (s for s in self._sequences.values() if s.finish_reason is None)

    def _breakers(self, params: SamplingParams) -> dict | None:
        """The request's DRY sequence breakers as token sequences (dry_cache.py: computed once per set of breakers)."""
        if not params.dry_multiplier:
            return None
        return self.dry_cache.get(params.dry_sequence_breakers)

    def _admit(self, seq_id: int) -> int:
        seq = self._sequences[seq_id]
        seq.cached_tokens = self.storage.add(seq_id, seq.prompt_ids, self._conversations.pop(seq_id, None))
        return seq.cached_tokens, self.storage.prefill_stops(seq_id)

    def _run(self, seq_ids, produced, forward, sampled=None) -> list[StepOutput]:
        """Run one forward and sample the rows its logits are of (`sampled`, in order; None: all); a raised error
        ends exactly the rows it concerns."""
        try:
            logits = forward()
        except Exception as exc:  # the model or storage failed: every row of this forward is lost
            return [self._end(self._sequences[s], "error", None, f"{type(exc).__name__}: {exc}") for s in seq_ids]
        if sampled is not None and not sampled:
            return []
        seqs = [self._sequences[s] for s in (seq_ids if sampled is None else sampled)]
        outputs, masks = self._constrain(seqs, logits)
        if all(s.params.masked_greedy and s.params.logprobs is None for s in seqs):
            # The whole batch's tokens and readout at once, each row a slice (a lone row's whole-array slice is no op:
            # each op in a step's graph costs the host time, which bounds a small model's batch-1 decode on a GPU).
            # A free row's mask allows every token.
            if masks is None:
                tokens, readout = self.backend.greedy_tokens(logits)
            else:
                tokens, readout = self.backend.masked_greedy_tokens(logits, masks)
            live = [(i, s) for i, s in enumerate(seqs) if s.finish_reason is None]  # (_constrain may end rows)
            whole = (tokens, readout) if len(live) == len(seqs) else None
            produced.update({s.seq_id: Sampled(tokens[i : i + 1], readout[i : i + 1], whole=whole) for i, s in live})
            return outputs
        masked = logits if masks is None else constrained.apply_bitmask(logits, masks)
        for i, seq in enumerate(seqs):
            if seq.finish_reason is not None:
                continue  # ended by the tokens read in _constrain
            try:
                row = seq.sampler.process(masked[i : i + 1], seq.prompt_ids + seq.output_ids)
                logprobs = None
                if seq.params.logprobs is not None:  # of the model's distribution, before sampling filters
                    raw = logits[i, :].astype(mx.float32)  # (a slice; a bare [i] is a gather)
                    logprobs = raw - mx.logsumexp(raw)
                token = seq.sampler.draw(row).reshape(1)
                produced[seq.seq_id] = Sampled(token, readout_of(token, row), logprobs)
            except Exception as exc:  # a bad logits processor ends its own row only
                outputs.append(self._end(seq, "error", None, f"sampling failed: {type(exc).__name__}: {exc}"))
        return outputs

    def _constrain(self, seqs: list[Sequence], logits: mx.array) -> tuple[list[StepOutput], mx.array | None]:
        """The packed masks of `seqs`' allowed tokens (constrained.next_masks; None: no constrained row), and the
        outputs of the steps read to compute them. A mask depends on the row's last token: with lookahead that step is
        still unread, so the forward goes to the device first and the host reads the unread steps and computes the
        masks meanwhile (where the backend says so, on a worker thread while this one submits the forward:
        mask_worker.py). A dead end (no allowed token) ends its row with "error"."""
        if not any(s.constraint is not None for s in seqs):
            return [], None
        outputs = []
        reads_logprobs = any(s.logprobs is not None for step, _ in self._unread for s in step.values())
        if self._mask_worker is None or reads_logprobs:  # (a logprobs row's read computes with MLX: this thread's)
            mx.async_eval(logits)
            bitmask = self._masks(seqs, outputs)
        else:
            self._ended_on_worker = []
            try:
                bitmask = self._mask_worker.beside(partial(self._masks, seqs, outputs), partial(mx.async_eval, logits))
            finally:
                ended, self._ended_on_worker = self._ended_on_worker, None
                for seq in ended:
                    self._free(seq)
        return outputs, None if bitmask is None else mx.array(bitmask)

    def _masks(self, seqs: list[Sequence], outputs: list[StepOutput]) -> np.ndarray | None:
        """The host's part of `_constrain`, once the step's forward is on the device: read the earlier steps, then
        compute the rows' packed masks (None: no constrained row goes on: each ended, or every row is at a dead end).
        The outputs read and the dead ends go to `outputs`."""
        outputs += self._commit(keep=0)  # (this step's rows are not submitted yet: only earlier steps are read)
        rows = [s.constraint for s in seqs]  # (None for a row that has ended: _end drops its matcher)
        if all(row is None for row in rows):
            return None
        bitmask, dead = constrained.next_masks(rows)
        outputs += [self._dead_end(seqs[i], message) for i, message in dead.items()]
        return None if len(dead) == len(seqs) else bitmask

    def _speculate(self, seq: Sequence) -> list[StepOutput] | None:
        """One speculative round (draft, verify in one forward, trim); None when there is nothing to propose."""
        k = self.speculator.draft_size(seq)
        history = seq.prompt_ids + seq.output_ids
        try:
            proposals = self.speculator.drafter.propose(seq.seq_id, history, k) if k > 0 else []
            if not proposals:
                return None
            logits = self.runner.score(seq.seq_id, [history[-1]] + proposals)
            verdict = verify(seq.sampler, logits, proposals, history, seq.constraint)
        except constrained.ConstraintDeadEnd as exc:
            return [self._dead_end(seq, str(exc))]
        except Exception as exc:  # the drafter, the model or a logits processor failed: this row only
            return [self._end(seq, "error", None, f"speculative decoding failed: {type(exc).__name__}: {exc}")]
        if verdict.nan:
            return [self._end(seq, "error", None, "NaN logits (from the model or a logits processor)")]
        accepted = len(verdict.tokens) - 1
        self.runner.take_back(seq.seq_id, len(proposals) - accepted)
        self.speculator.drafter.rollback(seq.seq_id, len(history) + accepted)
        self.speculator.record(seq, len(proposals), accepted)
        self.scheduler.advance(seq.seq_id, accepted)
        self._latest[seq.seq_id] = mx.array([verdict.tokens[-1]])
        outputs = []
        for token in verdict.tokens:  # EOS, a stop string or max_tokens may end the row mid-draft
            outputs.append(self._append(seq, token))
            if outputs[-1].finished:
                break
        return outputs

    def _graph_row(self, batch: ScheduledBatch) -> int | None:
        """The row whose decode step this is, where it can be a replayed graph: one greedy row (free or constrained)
        decoding alone, nothing else in the step."""
        if (
            self.graph is None
            or not self.graph.usable
            or self.mirror is not None
            or len(batch.decode) != 1
            or batch.prefill is not None
            or batch.together
            or batch.cancelled
        ):
            return None
        seq_id = batch.decode[0]
        params = self._sequences[seq_id].params
        return seq_id if params.masked_greedy and params.logprobs is None and self.graph.takes(seq_id) else None

    def _graph_decode(self, seq_id: int, produced: dict) -> list[StepOutput]:
        """A replayed step of the lone row. A constrained row's replay runs its forward, then asks for the row's mask
        (`_masks`: the host reads the previous step and computes the mask while the device runs the forward), then
        its masked greedy; no token when the row ended meanwhile."""
        seq, outputs = self._sequences[seq_id], []
        masks = None if seq.constraint is None else partial(self._masks, [seq], outputs)
        try:
            token, readout = self.graph.decode(seq_id, self._latest[seq_id], masks)
        except Exception as exc:  # the model, the storage or the driver failed: this row ends, later steps are MLX's
            self.graph.give_up(exc)
            if seq.finish_reason is None:
                outputs.append(self._end(seq, "error", None, f"{type(exc).__name__}: {exc}"))
            return outputs
        if token is not None:
            produced[seq_id] = Sampled(token, readout)
        return outputs

    def _commit(self, keep: int) -> list[StepOutput]:
        """Read the submitted steps, oldest first, until `keep` are left unread."""
        outputs = []
        while len(self._unread) > keep:
            outputs += self._commit_step(*self._unread.pop(0))
        return outputs

    def _commit_step(self, unread: dict[int, Sampled], readout: mx.array) -> list[StepOutput]:
        read = readout.tolist()  # one host read for the whole step (not two per row); scheduled in step()
        outputs = []
        now = time.perf_counter()
        for (seq_id, sampled), token in zip(unread.items(), read):
            seq = self._sequences.get(seq_id)
            if seq is None or seq.finish_reason is not None:
                continue  # a lookahead token of a row that has already ended
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            if token < 0:
                outputs.append(self._end(seq, "error", None, "NaN logits (from the model or a logits processor)"))
                continue
            out = self._append(seq, token)
            if sampled.logprobs is not None:
                out.logprob, out.top_logprobs = token_logprobs(sampled.logprobs, token, seq.params.logprobs)
            outputs.append(out)
        return outputs

    def _append(self, seq: Sequence, token: int) -> StepOutput:
        eos = token in self.tokenizer.eos_token_ids
        if seq.constraint is not None and not eos:  # (the mask allows EOS only where the grammar may end)
            refused = seq.constraint.advance(token)
            if refused is not None:  # only when a logits processor left no allowed token a finite logit
                return self._dead_end(seq, refused)
        seq.output_ids.append(token)
        if eos:
            return self._end(seq, "stop", token, text=seq.flush_text())
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.add(token))
        if stopped:  # the stop string and anything after it are never emitted
            return self._end(seq, "stop", token, text=text)
        if seq.constraint is not None and seq.constraint.stopped:  # the grammar is complete
            return self._end(seq, "stop", token, text=text + seq.flush_text())
        if len(seq.output_ids) >= seq.max_tokens:
            return self._end(seq, "length", token, text=text + seq.flush_text())
        return StepOutput(seq.seq_id, token, text)

    def _end(
        self, seq: Sequence, reason: FinishReason, token: int | None, error: str | None = None, text: str = ""
    ) -> StepOutput:
        seq.finish_reason, seq.error = reason, error
        seq.constraint = None  # the matcher goes with the row
        self._conversations.pop(seq.seq_id, None)  # never admitted: nothing to keep
        seq.timings.finished = time.perf_counter()
        self.scheduler.finish(seq.seq_id)
        if self._ended_on_worker is not None:  # (freeing submits MLX work: the engine's thread does it, mask_worker.py)
            self._ended_on_worker.append(seq)
        else:
            self._free(seq)
        self._latest.pop(seq.seq_id, None)
        return StepOutput(seq.seq_id, token, text, reason, error)

    def _free(self, seq: Sequence) -> None:
        self.storage.free(seq.seq_id, seq.prompt_ids + seq.output_ids)
        if self.speculator is not None:
            self.speculator.drafter.free(seq.seq_id)

    def _dead_end(self, seq: Sequence, message: str) -> StepOutput:
        """End a constrained row whose grammar allows no further token: "error", marked as the output's failure."""
        out = self._end(seq, "error", None, message)
        out.dead_end = True
        return out
