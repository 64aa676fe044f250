"""EngineLoop: the one thread that owns the model and the Engine (MLX is used from this thread only).

It loads the model, then loops: drain the inbox (new jobs, cancellations), run `engine.step()`, and
push each StepOutput to its request's asyncio queue with `loop.call_soon_threadsafe` (the `emit`
callback of a Job). Events a request receives, per job (one job per choice of `n`):

    ("opened")  the engine accepted the sequence        ("error")  it did not (bad parameters, ...)
    ("token")   a StepOutput that is not the last one   ("final")  the last StepOutput plus usage

A cancelled job (client gone) is closed in the engine; its KV blocks are freed at the next step.
If `step()` itself raises, every live job gets a final error and a fresh Engine takes over; after
`max_failures` failures in a row the thread stops and health turns 503.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..engine import Engine, EngineConfig, StepOutput
from ..engine.constrained import prepare as prepare_constraints
from ..engine.dry_cache import DryBreakerCache
from ..sampling import SamplingParams
from .errors import APIError
from .metrics import ServerMetrics
from .warmup import compiled, dry_run_config, warm_up_ahead, warmup_plan

log = logging.getLogger("mlxcel.server")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Event:
    kind: str  # "opened" | "error" | "token" | "final"
    index: int  # the choice this job serves
    output: StepOutput | None = None
    usage: Usage | None = None
    error: Exception | None = None


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    make_params: Callable[[], SamplingParams]  # called on the engine thread (processors hold MLX arrays)
    index: int
    emit: Callable[[Event], None]  # thread-safe: hands the event to the request's event loop
    seq_id: int | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


class EngineLoop:
    def __init__(
        self,
        load: Callable,
        engine_config: EngineConfig,
        metrics: ServerMetrics,
        ctx_size: int | None = None,
        capacity: int = 64,
        max_failures: int = 3,
        on_load_failed: Callable[[BaseException], None] | None = None,
        group=None,
        warmup: bool = False,
    ):
        """`group`: this is rank 0 of a tensor-parallel group; the other ranks mirror the engine's inputs
        (distributed/mirror.py). A failed step then stops the server (a fresh Engine here could not be
        matched on the other ranks). `warmup`: before turning ready, run the warm-up plan's short requests on a
        throwaway engine (server/warmup.py; not with `group`, whose ranks would have to mirror it)."""
        self._load, self.engine_config, self.metrics = load, engine_config, metrics
        self.group = group
        self.warmup = warmup and group is None
        if group is not None:
            max_failures = 1
        self.ctx_size, self.capacity, self.max_failures = ctx_size, capacity, max_failures
        self._on_load_failed = on_load_failed
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: BaseException | None = None
        self.loaded = None  # LoadedModel, once loaded
        self.draft = None  # the draft model (LoadedModel) of speculative decoding, when configured
        self.engine: Engine | None = None
        self.dry_cache: DryBreakerCache | None = None  # shared by every Engine of this model (engine/dry_cache.py)
        self.max_context = 0
        self.heartbeat = time.monotonic()  # the engine loop's last turn: a wedged engine turns health 503
        self.stall_timeout = 600.0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._in_flight = 0  # jobs submitted and not finished (waiting or running)
        self._jobs: dict[int, Job] = {}  # seq_id -> job, engine thread only
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)

    # -- called from the event loop ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self._thread.is_alive()

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self.ready:
            stalled = time.monotonic() - self.heartbeat
            if stalled > self.stall_timeout:
                return f"The engine has not finished a step for {stalled:.0f} s"
            return None
        if self.state == "ready":
            return "The engine thread is not running"
        if self.state == "loading":
            return "Loading model"
        if self.state == "failed":
            return f"The engine is not running: {self.error}"
        return "The server is shutting down"

    @property
    def queue_depth(self) -> int:
        return max(0, self._in_flight - (self.engine.stats().running if self.engine else 0))

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs for the engine; 503 when the engine is down or the queue is full."""
        with self._lock:  # the engine thread changes state under this lock too: no job is left behind
            reason = self.health()
            if reason is not None:
                raise APIError(503, reason)
            if self._in_flight + len(jobs) > self.capacity:
                self.metrics.rejected.inc()
                raise APIError(
                    503,
                    f"The server is busy: {self._in_flight} sequences running or queued "
                    f"(limit {self.capacity}). Retry later.",
                )
            self._in_flight += len(jobs)
            for job in jobs:
                self._inbox.put(("submit", job))
        self._wake.set()

    def cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._inbox.put(("cancel", job))
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------------
    def _new_engine(self, dry: bool = False) -> Engine:
        """An engine on the loaded model; `dry`: the warm-up's dry run's (warmup.dry_run_config)."""
        if self.dry_cache is None:
            self.dry_cache = DryBreakerCache(self.loaded.tokenizer)
        config = dry_run_config(self.engine_config) if dry else self.engine_config
        engine = Engine(self.loaded.model, self.loaded.tokenizer, config, draft=self.draft, dry_cache=self.dry_cache)
        ctx = engine.max_context
        if self.ctx_size:
            ctx = min(ctx, self.ctx_size)
        budget = self.engine_config.kv_budget_for(engine.max_context)
        if budget:  # a request must fit the KV budget on its own, its recurrent state (if any) included
            ctx = min(ctx, budget - engine.scheduler.config.state_tokens)
        engine.max_context = self.max_context = ctx
        if self.group is not None:
            from ..distributed.mirror import LeaderMirror

            engine.mirror = LeaderMirror(self.group)
        return engine

    def _run(self) -> None:
        try:
            self.loaded = self._load()
            speculative = self.engine_config.speculative
            if speculative is not None and speculative.draft_model:
                from ..loading import load_model

                self.draft = load_model(speculative.draft_model, log=lambda m: log.info("draft model: %s", m))
            if self.warmup:  # (on an engine like the serving one, dropped after)
                plan = warmup_plan(self.engine_config)
                seconds = warm_up_ahead(self._new_engine, plan, self.loaded.model)
                log.info("warm-up: %.1f s (%s)%s", seconds, plan.describe(), compiled())
            self.engine = self._new_engine()
            # The tokenizer in llguidance's form, built on a worker thread now so that the first request with a
            # response_format does not wait for it (engine/constrained.py).
            prepare_constraints(self.loaded.tokenizer, self.engine.vocab_size)
        except BaseException as exc:  # noqa: BLE001 - reported to the CLI, which exits
            self.state, self.error = "failed", exc
            log.error("model failed to load: %s", exc)
            if self._on_load_failed is not None:
                self._on_load_failed(exc)
            return
        self.state = "ready"
        log.info(
            "model ready: context %d tokens, batch %d, %s KV storage",
            self.max_context,
            self.engine_config.max_batch_size,
            self.engine_config.resolved_storage,
        )
        try:
            self._serve()
        finally:
            if self.engine.mirror is not None:  # the other ranks return (or already lost this one)
                try:
                    self.engine.mirror.stop()
                except Exception as exc:  # noqa: BLE001 - a peer is gone; nothing more to tell it
                    log.error("could not stop the other ranks: %s", exc)
            # MLX gives this thread its own default stream. Left to the process's exit, that stream (with the
            # compiled decode graphs traced on it) made MLX abort there ("terminate called without an active
            # exception", exit 134): finish its work and destroy it while the thread is still alive.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        failures = 0
        while not self._stopping:
            self.heartbeat = time.monotonic()
            self._wake.clear()
            try:
                self._drain()
                if not self.engine.has_work():
                    self._publish()
                    self._wake.wait(0.5)
                    continue
                outputs = self.engine.step()
                self._dispatch(outputs)
                self._publish()
                failures = 0
            except Exception as exc:  # the engine itself broke (not one row): fail everyone, start over
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                if failures >= self.max_failures:
                    self._set_state("failed", exc)
                self._fail_all(f"inference backend error: {type(exc).__name__}: {exc}")
                if self.state == "failed":
                    if self.group is not None and self._on_load_failed is not None:
                        self._on_load_failed(exc)  # tensor parallel: the ranks are out of step, stop serving
                    return
                try:
                    self.engine = self._new_engine()
                except Exception as again:  # noqa: BLE001
                    self._set_state("failed", again)
                    self._fail_all(f"inference backend error: {type(again).__name__}: {again}")
                    return
                self.metrics.reset_engine_counters()
        self._set_state("stopped")
        self._fail_all("The server is shutting down")

    def _set_state(self, state: str, error: BaseException | None = None) -> None:
        with self._lock:
            self.state, self.error = state, error or self.error

    def _drain(self) -> None:
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._open(job)
            else:
                job.cancelled = True
                if job.seq_id is not None:
                    self.engine.close(job.seq_id)

    def _open(self, job: Job) -> None:
        try:
            params = job.make_params()
            job.seq_id = self.engine.open(job.prompt_ids, params)
        except Exception as exc:  # invalid parameters (InputError) or a bug: this job only
            self._finished(job)
            job.emit(Event("error", job.index, error=exc))
            return
        self._jobs[job.seq_id] = job
        job.emit(Event("opened", job.index))

    def _finished(self, job: Job) -> None:
        with self._lock:
            self._in_flight -= 1

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        produced = 0
        for out in outputs:
            job = self._jobs.get(out.seq_id)
            if job is None:
                continue
            if out.token is not None:
                produced += 1
                if job.first_token is None:
                    job.first_token = now
                    self.metrics.ttft.observe(now - job.submitted)
            if not out.finished:
                job.emit(Event("token", job.index, out))
                continue
            seq = self.engine.sequence(out.seq_id)
            usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens)
            decode_s = seq.timings.decode_s
            tps = (usage.completion_tokens - 1) / decode_s if usage.completion_tokens > 1 and decode_s > 0 else 0.0
            if tps:
                self.metrics.decode_tps.observe(tps)
            self.metrics.requests.labels(out.finish_reason).inc()
            ttft_ms = (job.first_token - job.submitted) * 1000 if job.first_token else float("nan")
            log.info(
                "seq %d: %s, prompt %d tokens (%d cached), completion %d tokens, ttft %.1f ms, %.1f tok/s%s",
                out.seq_id,
                out.finish_reason,
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
                ttft_ms,
                tps,
                f" ({out.error})" if out.error else "",
            )
            self.engine.release(out.seq_id)
            del self._jobs[out.seq_id]
            self._finished(job)
            job.emit(Event("final", job.index, out, usage))
        if produced:
            self.metrics.tokens_predicted.inc(produced)

    def _publish(self) -> None:
        stats = self.engine.stats()
        storage = stats.storage if self.engine_config.resolved_storage == "paged" else {}
        self.metrics.record_step(
            running=stats.running,
            waiting=self.queue_depth,
            prefill_tokens=stats.prefill_tokens,
            storage_stats=storage,
            speculative=stats.speculative,
        )

    def _fail_all(self, message: str) -> None:
        """End every job (live or still in the inbox) with an error."""
        for seq_id, job in list(self._jobs.items()):
            try:
                seq = self.engine.sequence(seq_id)
                usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens)
            except Exception:  # noqa: BLE001 - a broken engine may not know it any more
                usage = None
            job.seq_id, job.cancelled = None, True  # its id means nothing to the next Engine
            self._finished(job)
            job.emit(Event("final", job.index, StepOutput(seq_id, None, "", "error", message), usage))
        self._jobs.clear()
        while True:
            try:
                kind, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._finished(job)
                job.emit(Event("error", job.index, error=APIError(503, message)))
