"""`mlxcel bench`: llama-bench-style speed measurements of the engine, as plain data.

Conventions (llama-bench's, so numbers compare):
- prompts are random token ids, seeded, identical in every repetition; EOS is ignored (the bench engine's
  tokenizer has no EOS and decodes nothing, so neither tokenization nor detokenization is timed);
- tests: `pp512` prefill (time to first token of a 512-token prompt; t/s = 512 / TTFT), `tg128` (128 decode
  steps after a 1-token prompt, timed from the first token on: t/s = 128 / time), `pp512+tg128`
  (t/s = (512 + 128) / total time), and ` @ d4096` when a 4096-token prefix is prefilled, untimed, before the
  test: the timed request finds it in the KV cache (Conversation for dense storage, prefix cache for paged)
  and computes only the test's own tokens, which the engine's prefill counter reports (`prefill_computed`);
- one warm-up run, then `repetitions` timed runs: mean ± sample standard deviation (N - 1);
- batch `b` > 1: b different random prompts of the same length go to one Engine(max_batch_size=b) together;
  t/s is the AGGREGATE over all rows (pp: b*p / time until every row has its first token; tg: b*n tokens
  over n decode steps of the full batch, after every row has its first token; pp+tg: b*(p+n) / total).

`run_bench(model, config)` returns `BenchResult`s; `formatter(...)` renders them as md, json, jsonl or csv. How one
run drives the engine and reads the host clock is bench_runs.py (`run_requests`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from . import __version__
from .bench_model import BenchModel, RandomIdTokenizer, bench_header, environment, human_count, load_bench_model
from .bench_runs import forget_cached_prefixes, prefill_context, prefill_wait_steps, random_prompt, run_requests
from .errors import InputError, RuntimeFailure

__all__ = [  # the bench API (bench_model.py's and bench_runs.py's names re-exported: one import for its users)
    "FIELDS",
    "STORAGE_BACKENDS",
    "BenchConfig",
    "BenchModel",
    "BenchResult",
    "BenchTest",
    "RandomIdTokenizer",
    "bench_header",
    "environment",
    "forget_cached_prefixes",
    "format_mean_std",
    "human_count",
    "load_bench_model",
    "mean_std",
    "plan_tests",
    "random_prompt",
    "run_bench",
    "prefill_wait_steps",
    "run_requests",
]

STORAGE_BACKENDS = ("auto", "dense", "paged")

# Machine-readable fields, in order (llama-bench's names where one applies).
FIELDS = (
    "mlxcel_version",
    "mlx_version",
    "backend",
    "device",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_prompt",
    "n_gen",
    "n_depth",
    "kv_bits",
    "storage",
    "test",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
    "ttft_ms",
    "peak_memory_gb",
    "prefill_computed",
    "graph_steps",
    "warmup_ms",
    "samples_ns",
    "samples_ts",
)


# -- what to run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchTest:
    n_prompt: int
    n_gen: int
    n_depth: int = 0
    n_batch: int = 1

    @property
    def kind(self) -> str:
        return "pp" if self.n_gen == 0 else "tg" if self.n_prompt == 0 else "pg"

    @property
    def label(self) -> str:
        name = {"pp": f"pp{self.n_prompt}", "tg": f"tg{self.n_gen}"}.get(self.kind, f"pp{self.n_prompt}+tg{self.n_gen}")
        return name + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def test_tokens(self) -> int:
        """Prompt tokens of one row that the timed run must compute (tg feeds one token)."""
        return self.n_prompt if self.kind != "tg" else 1

    @property
    def credited_tokens(self) -> int:
        """Tokens t/s counts for the whole batch (per llama-bench: p, n, or p + n per row)."""
        return self.n_batch * (self.n_prompt + self.n_gen)


@dataclass(frozen=True)
class BenchConfig:
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    pg: tuple[tuple[int, int], ...] = ()
    n_depth: tuple[int, ...] = (0,)
    n_batch: tuple[int, ...] = (1,)
    repetitions: int = 5
    warmup: bool = True
    seed: int = 0
    kv_bits: int | None = None
    storage: str = "auto"
    prefill_chunk_size: int | None = None  # None: the engine's default (EngineConfig.resolved_prefill_chunk)

    def chunk(self, n_batch: int) -> int:
        """The prefill chunk of a test's engine (run at batch `n_batch`)."""
        from .engine import EngineConfig

        return EngineConfig(max_batch_size=n_batch, prefill_chunk_size=self.prefill_chunk_size).resolved_prefill_chunk

    def validate(self) -> None:
        def check(name: str, values, low: int) -> None:
            if not values:
                raise InputError(f"{name} needs at least one value")
            bad = [v for v in values if not isinstance(v, int) or v < low]
            if bad:
                raise InputError(f"{name} values must be integers >= {low}, got {bad[0]}")

        check("-p/--n-prompt", self.n_prompt, 0)
        check("-n/--n-gen", self.n_gen, 0)
        check("-d/--n-depth", self.n_depth, 0)
        check("-b/--batch-size", self.n_batch, 1)
        for p, n in self.pg:
            if p < 1 or n < 1:
                raise InputError(f"--pg needs two integers >= 1 (prompt, generated), got {p},{n}")
        if self.repetitions < 1:
            raise InputError(f"-r/--repetitions must be >= 1, got {self.repetitions}")
        if self.kv_bits not in (None, 4, 8):
            raise InputError(f"--kv-bits must be 4 or 8, got {self.kv_bits}")
        if self.storage not in STORAGE_BACKENDS:
            raise InputError(f"--decode-storage-backend must be auto, dense or paged, got '{self.storage}'")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise InputError(f"--prefill-chunk-size must be >= 1, got {self.prefill_chunk_size}")
        if not plan_tests(self):
            raise InputError("nothing to run: -p and -n are all 0 and no --pg was given")


def plan_tests(config: BenchConfig) -> list[BenchTest]:
    """llama-bench's order: for each batch size and depth, the pp tests, then tg, then pp+tg."""
    tests = []
    for b in config.n_batch:
        for d in config.n_depth:
            tests += [BenchTest(p, 0, d, b) for p in config.n_prompt if p > 0]
            tests += [BenchTest(0, n, d, b) for n in config.n_gen if n > 0]
            tests += [BenchTest(p, n, d, b) for p, n in config.pg]
    return tests


# -- results -------------------------------------------------------------------------------------------
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (N - 1); the deviation of a single value is 0, as in llama-bench."""
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def format_mean_std(mean: float, std: float) -> str:
    return "%.2f ± %.2f" % (mean, std)


@dataclass
class BenchResult:
    test: BenchTest
    model: str  # description, e.g. "llama-3-8b (random) Q4 g64"
    model_filename: str  # -m spec or shape name
    model_size: int  # bytes of parameters in memory
    model_n_params: int
    backend: str
    device: str
    samples_ns: list[int]  # timed region of each repetition
    ttft_ms: float  # mean time to first token (mean over rows in a batch)
    peak_memory_gb: float
    prefill_computed: int  # prompt tokens the engine computed inside the timed region (max over repetitions)
    kv_bits: int | None = None
    storage: str = "auto"
    # wall time of the warm-up run (None without one): a process's first test includes compiling its GPU kernels
    warmup_ms: float | None = None
    # decode steps replayed as one recorded graph in the timed runs (Engine.stats); None: the engine has no replayer
    graph_steps: int | None = None
    mlxcel_version: str = __version__
    mlx_version: str = ""
    test_time: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    @property
    def samples_ts(self) -> list[float]:
        return [self.test.credited_tokens * 1e9 / ns for ns in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return mean_std(self.samples_ts)[0]

    @property
    def stddev_ts(self) -> float:
        return mean_std(self.samples_ts)[1]

    @property
    def avg_ns(self) -> float:
        return mean_std(self.samples_ns)[0]

    @property
    def stddev_ns(self) -> float:
        return mean_std(self.samples_ns)[1]

    def to_dict(self) -> dict[str, Any]:
        t = self.test
        values = {
            "mlxcel_version": self.mlxcel_version,
            "mlx_version": self.mlx_version,
            "backend": self.backend,
            "device": self.device,
            "model_filename": self.model_filename,
            "model_type": self.model,
            "model_size": self.model_size,
            "model_n_params": self.model_n_params,
            "n_batch": t.n_batch,
            "n_prompt": t.n_prompt,
            "n_gen": t.n_gen,
            "n_depth": t.n_depth,
            "kv_bits": self.kv_bits,
            "storage": self.storage,
            "test": t.label,
            "test_time": self.test_time,
            "avg_ns": int(round(self.avg_ns)),
            "stddev_ns": int(round(self.stddev_ns)),
            "avg_ts": self.avg_ts,
            "stddev_ts": self.stddev_ts,
            "ttft_ms": self.ttft_ms,
            "peak_memory_gb": self.peak_memory_gb,
            "prefill_computed": self.prefill_computed,
            "graph_steps": self.graph_steps,
            "warmup_ms": self.warmup_ms,
            "samples_ns": list(self.samples_ns),
            "samples_ts": self.samples_ts,
        }
        return {k: values[k] for k in FIELDS}


# -- environment and model -------------------------------------------------------------------------------
def _tg_margin(prompt_len: int, batch: int, chunk: int) -> int:
    """Extra max_tokens so early rows are still decoding when the last row gets its first token."""
    chunks = -(-prompt_len // chunk)
    return 2 + batch * chunks * (1 if chunks == 1 else 16)


@dataclass
class Sample:
    seconds: float
    ttft_s: float  # mean over rows
    prefill_computed: int


def measure_test(
    engine,
    test: BenchTest,
    prompts: list[list[int]],
    prefixes: list[list[int]] | None,
    clock: Callable[[], float] = time.perf_counter,
    chunk: int = 2048,
) -> Sample:
    """One repetition of one test on `engine` (depth prefix prefilled first, untimed)."""
    forget_cached_prefixes(engine)
    conversations = prefill_context(engine, prefixes) if prefixes else None
    full = [(pre or []) + p for pre, p in zip(prefixes or [None] * len(prompts), prompts)]
    if test.kind == "pp":
        run = run_requests(engine, full, 1, conversations, clock=clock)
        seconds = run.all_first_tokens - run.submitted
    elif test.kind == "pg":
        run = run_requests(engine, full, test.n_gen + 1, conversations, clock=clock)
        seconds = run.end - run.submitted
    else:
        margin = 0 if test.n_batch == 1 else _tg_margin(max(len(p) for p in full), test.n_batch, chunk)
        run = run_requests(engine, full, test.n_gen + 1 + margin, conversations, steady_tokens=test.n_gen, clock=clock)
        seconds = run.end - run.window_start
        if run.window_tokens != test.n_gen * test.n_batch:
            raise RuntimeFailure(
                f"{test.label}: only {run.window_tokens} of {test.n_gen * test.n_batch} tokens "
                "were decoded with the whole batch running (is the model's context too short?)"
            )
    return Sample(seconds, statistics.fmean(run.ttft), run.prefill_computed)


def engine_for(bench_model: BenchModel, test: BenchTest, config: BenchConfig):
    """An Engine for one test: batch = the test's b, KV budget sized for b rows of depth + prompt + output."""
    from .engine import Engine, EngineConfig

    prompt_len = test.n_depth + test.test_tokens
    per_row = prompt_len + test.n_gen + 1 + _tg_margin(prompt_len, test.n_batch, config.chunk(test.n_batch)) + 64
    cfg = EngineConfig(
        max_batch_size=test.n_batch,
        kv_bits=config.kv_bits,
        storage=config.storage,
        prefill_chunk_size=config.chunk(test.n_batch),
        kv_budget_tokens=test.n_batch * per_row,
    )
    return Engine(bench_model.model, RandomIdTokenizer(bench_model.vocab_size), cfg)


def bench_prompts(
    bench_model: BenchModel, test: BenchTest, seed: int
) -> tuple[list[list[int]], list[list[int]] | None]:
    """(the test's own prompt per row, the depth prefix per row or None); rows differ, repetitions do not."""
    v = bench_model.vocab_size
    prompts = [random_prompt(v, test.test_tokens, seed, "prompt", row, test.test_tokens) for row in range(test.n_batch)]
    prefixes = (
        [random_prompt(v, test.n_depth, seed, "depth", row, test.n_depth) for row in range(test.n_batch)]
        if test.n_depth
        else None
    )
    return prompts, prefixes


def run_bench(
    bench_model: BenchModel,
    config: BenchConfig,
    on_result: Callable[[BenchResult], None] | None = None,
    log: Callable[[str], None] = lambda m: None,
    clock: Callable[[], float] = time.perf_counter,
    env: dict[str, str] | None = None,
) -> list[BenchResult]:
    """Run every planned test: warm-up (unless disabled), then `repetitions` timed runs each."""
    config.validate()
    env = env or environment()
    results = []
    for test in plan_tests(config):
        context = test.n_depth + test.test_tokens + test.n_gen + 1
        if context > bench_model.model.max_context_length:
            raise InputError(
                f"{test.label} needs {context} positions; the model's context is {bench_model.model.max_context_length}"
            )
        results.append(_run_test(bench_model, config, test, log, clock, env))
        if on_result is not None:
            on_result(results[-1])
    return results


def _run_test(bench_model: BenchModel, config: BenchConfig, test, log, clock, env: dict[str, str]) -> BenchResult:
    """One planned test on a fresh engine: its warm-up, its timed repetitions, their result."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    engine = engine_for(bench_model, test, config)
    prompts, prefixes = bench_prompts(bench_model, test, config.seed)
    label = f"{test.label} (b={test.n_batch})"
    warmup_ms = None
    if config.warmup:
        log(f"{label}: warm-up")
        start = clock()
        measure_test(engine, test, prompts, prefixes, clock, config.chunk(test.n_batch))
        warmup_ms = (clock() - start) * 1000
        log(f"{label}: warm-up took {warmup_ms:.1f} ms")
    replayed_before = engine.stats().graph_replayed
    samples = []
    for rep in range(config.repetitions):
        sample = measure_test(engine, test, prompts, prefixes, clock, config.chunk(test.n_batch))
        log(
            f"{label}: run {rep + 1}/{config.repetitions}: {sample.seconds * 1000:.1f} ms, "
            f"{test.credited_tokens / sample.seconds:.2f} t/s, prefill computed {sample.prefill_computed}"
        )
        samples.append(sample)
    if engine.stats().graph_not_replaying:
        log(f"{label}: no decode step was replayed as a recorded graph: {engine.stats().graph_not_replaying}")
    return BenchResult(
        test=test,
        model=bench_model.description,
        model_filename=bench_model.filename,
        model_size=bench_model.size_bytes,
        model_n_params=bench_model.n_params,
        backend=env["backend"],
        device=env["device"],
        samples_ns=[int(round(s.seconds * 1e9)) for s in samples],
        ttft_ms=statistics.fmean(s.ttft_s for s in samples) * 1000,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        prefill_computed=max(s.prefill_computed for s in samples),
        kv_bits=config.kv_bits,
        storage=engine.config.resolved_storage,
        mlx_version=env["mlx_version"],
        warmup_ms=warmup_ms,
        graph_steps=None if replayed_before is None else engine.stats().graph_replayed - replayed_before,
    )
