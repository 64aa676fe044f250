"""mlxcel_core.bench and loading.shapes: statistics, labels, aggregate batch t/s, depth reuse, random shapes."""

from __future__ import annotations

import csv
import io
import statistics

import mlx.core as mx
import pytest

from mlxcel_core.bench import (
    BenchConfig,
    BenchResult,
    BenchTest,
    bench_prompts,
    engine_for,
    format_mean_std,
    load_bench_model,
    mean_std,
    measure_test,
    plan_tests,
    random_prompt,
    run_bench,
)
from mlxcel_core.bench_output import render
from mlxcel_core.errors import InputError
from mlxcel_core.loading.shapes import (
    SHAPES,
    build_random_model,
    count_parameters,
    shape_config,
)


class StepClock:
    """Advances one second per reading: run_requests reads it once at submit and once per engine step."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture(scope="module")
def tiny():
    return load_bench_model(shape="tiny")


def result(test: BenchTest, samples_ns: list[int]) -> BenchResult:
    return BenchResult(
        test=test,
        model="m",
        model_filename="m",
        model_size=1,
        model_n_params=1,
        backend="mlx-cpu",
        device="cpu",
        samples_ns=samples_ns,
        ttft_ms=1.0,
        peak_memory_gb=0.1,
        prefill_computed=0,
    )


# -- statistics on injected timings ----------------------------------------------------------------
def test_mean_and_sample_stddev_of_injected_timings():
    r = result(BenchTest(512, 0), [1_000_000_000, 2_000_000_000, 4_000_000_000])
    assert r.samples_ts == pytest.approx([512.0, 256.0, 128.0])
    assert r.avg_ts == pytest.approx((512 + 256 + 128) / 3)
    # sample standard deviation: divide by N - 1
    mean = (512 + 256 + 128) / 3
    sd = (((512 - mean) ** 2 + (256 - mean) ** 2 + (128 - mean) ** 2) / 2) ** 0.5
    assert r.stddev_ts == pytest.approx(sd)
    assert r.stddev_ts == pytest.approx(statistics.stdev([512, 256, 128]))
    assert r.avg_ns == pytest.approx(7e9 / 3)
    assert format_mean_std(r.avg_ts, r.stddev_ts) == "298.67 ± 195.52"
    assert "298.67 ± 195.52" in render([r], "md")


def test_one_sample_has_zero_deviation_and_pp_tg_counts_both():
    assert mean_std([3.0]) == (3.0, 0.0)
    r = result(BenchTest(512, 128), [2_000_000_000])
    assert r.samples_ts == [320.0]  # (512 + 128) / 2 s
    assert r.stddev_ts == 0.0
    batch = result(BenchTest(0, 128, n_batch=8), [1_000_000_000])
    assert batch.samples_ts == [1024.0]  # aggregate: 8 rows x 128 tokens in 1 s


def test_labels_and_plan_follow_llama_bench():
    assert [t.label for t in plan_tests(BenchConfig(pg=((512, 128),), n_depth=(0, 4096)))] == [
        "pp512",
        "tg128",
        "pp512+tg128",
        "pp512 @ d4096",
        "tg128 @ d4096",
        "pp512+tg128 @ d4096",
    ]
    assert [t.label for t in plan_tests(BenchConfig(n_prompt=(0,), n_gen=(16, 32)))] == ["tg16", "tg32"]
    assert [t.n_batch for t in plan_tests(BenchConfig(n_batch=(1, 8)))] == [1, 1, 8, 8]


@pytest.mark.parametrize(
    "bad",
    [
        dict(n_prompt=(-1,)),
        dict(n_batch=()),
        dict(n_batch=(0,)),
        dict(repetitions=0),
        dict(n_prompt=(0,), n_gen=(0,)),
        dict(kv_bits=3),
        dict(storage="x"),
        dict(pg=((0, 4),)),
    ],
)
def test_bad_configs_are_input_errors(bad):
    with pytest.raises(InputError):
        BenchConfig(**bad).validate()


def test_random_prompts_are_seeded_and_rows_differ(tiny):
    assert random_prompt(320, 16, 0, "x") == random_prompt(320, 16, 0, "x")
    prompts, prefixes = bench_prompts(tiny, BenchTest(16, 0, n_depth=32, n_batch=3), seed=0)
    assert len({tuple(p) for p in prompts}) == 3 and all(len(p) == 16 for p in prompts)
    assert len(prefixes) == 3 and all(len(p) == 32 for p in prefixes)
    assert bench_prompts(tiny, BenchTest(16, 0, n_depth=32, n_batch=3), seed=0) == (prompts, prefixes)


# -- timing semantics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_batch_tg_reports_aggregate_tokens_per_decode_step(tiny, batch):
    """With a clock that ticks once per engine step, n full-batch decode steps take n 'seconds': t/s == b."""
    config = BenchConfig(n_prompt=(0,), n_gen=(6,), n_batch=(batch,), repetitions=2, warmup=False)
    (r,) = run_bench(tiny, config, clock=StepClock())
    assert r.test.label == "tg6" and r.test.n_batch == batch
    assert r.samples_ns == [6_000_000_000] * 2
    assert r.avg_ts == pytest.approx(batch)  # b * n tokens / n steps
    assert r.prefill_computed == batch  # one prompt token per row
    assert r.warmup_ms is None and r.to_dict()["warmup_ms"] is None  # (no warm-up run)


def test_warm_up_time_is_reported(tiny):
    """The warm-up run's wall time (a process's first test includes its kernel compiles on a GPU): with the step
    clock, its readings: one at its start, one at submit, one per engine step of the 6 decode steps + the prefill
    step, one at its end."""
    config = BenchConfig(n_prompt=(0,), n_gen=(6,), repetitions=1, warmup=True)
    (r,) = run_bench(tiny, config, clock=StepClock())
    assert r.samples_ns == [6_000_000_000]
    assert r.warmup_ms == r.to_dict()["warmup_ms"] and r.warmup_ms >= 7_000


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("batch", [1, 2])
def test_depth_prefix_is_not_recomputed_in_the_timed_region(tiny, storage, batch):
    test = BenchTest(16, 0, n_depth=64, n_batch=batch)
    engine = engine_for(tiny, test, BenchConfig(storage=storage))
    prompts, prefixes = bench_prompts(tiny, test, seed=0)
    seen = []
    add = engine.storage.add

    def spy(seq_id, prompt_ids, conversation=None):
        cached = add(seq_id, prompt_ids, conversation)
        seen.append((len(prompt_ids), cached))
        return cached

    engine.storage.add = spy
    for _ in range(2):  # repetitions reuse nothing of each other (identical ids, prefix cache emptied)
        seen.clear()
        sample = measure_test(engine, test, prompts, prefixes)
        # untimed depth prefill: 64 computed per row; timed: 64 + 16 tokens, 64 found in the cache
        assert seen == [(64, 0)] * batch + [(80, 64)] * batch
        assert sample.prefill_computed == 16 * batch

    # the counter would catch a recomputed prefix: without the cache the timed run computes all 80
    cold = engine_for(tiny, test, BenchConfig(storage=storage))
    assert measure_test(cold, test, [pre + p for pre, p in zip(prefixes, prompts)], None).prefill_computed == 80 * batch


def test_repetitions_keep_the_kv_arrays_the_size_one_request_needs(tiny):
    """Emptying the prefix cache between repetitions hands no block out: the pool's high water (and so its KV arrays,
    which the next write grows to cover it) stays at what one request used, not the pool's whole budget."""
    test = BenchTest(40, 4)
    engine = engine_for(tiny, test, BenchConfig(storage="paged"))
    prompts, prefixes = bench_prompts(tiny, test, seed=0)
    measure_test(engine, test, prompts, prefixes)
    pool, rows = engine.storage.pool, engine.storage.pool_rows
    used = pool.high_water
    assert 0 < used < pool.num_blocks
    for _ in range(2):
        sample = measure_test(engine, test, prompts, prefixes)
        assert sample.prefill_computed == 40  # nothing served from the cache
        assert (pool.high_water, engine.storage.pool_rows) == (used, rows)


def test_run_bench_end_to_end_on_tiny(tiny):
    config = BenchConfig(n_prompt=(8,), n_gen=(4,), pg=((8, 4),), n_depth=(0, 32), repetitions=2, warmup=True)
    results = run_bench(tiny, config)
    assert [r.test.label for r in results] == ["pp8", "tg4", "pp8+tg4", "pp8 @ d32", "tg4 @ d32", "pp8+tg4 @ d32"]
    for r in results:
        assert len(r.samples_ns) == 2 and all(ns > 0 for ns in r.samples_ns)
        assert r.avg_ts > 0 and r.ttft_ms > 0 and r.peak_memory_gb > 0 and r.warmup_ms > 0
        assert r.prefill_computed == r.test.test_tokens
        assert r.to_dict()["model_type"] == "tiny (random) bf16"


# -- random-weight shapes ----------------------------------------------------------------------------------
def llama_params(c: dict) -> int:
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head = h // c["num_attention_heads"]
    attn = h * head * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    return v * h * (1 if c["tie_word_embeddings"] else 2) + layers * per_layer + h


@pytest.mark.parametrize(
    "name,expected",
    [
        ("llama-3-8b", 8_030_261_248),
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3-70b", 70_553_706_496),
        ("smollm2-135m", 134_515_008),
    ],
)
def test_shapes_have_the_published_parameter_counts(name, expected):
    assert llama_params(shape_config(name)) == expected


def test_tiny_shape_builds_random_weights_and_quantizes():
    import mlx.core as mx
    import mlx.nn as nn

    model, config = build_random_model("tiny", dtype="float32")
    n_params, size = count_parameters(model)
    assert n_params == llama_params(config) and size == 4 * n_params
    w = model.layers[0].mlp.up_proj.weight
    assert w.dtype == mx.float32 and 0.015 < float(mx.std(w)) < 0.025
    assert float(model.layers[0].input_layernorm.weight.min()) == 1.0
    q, _ = build_random_model("tiny", bits=4)
    assert isinstance(q.layers[0].mlp.up_proj, nn.QuantizedLinear) and q.layers[0].mlp.up_proj.bits == 4
    assert q.layers[0].mlp.up_proj.group_size == 64
    assert count_parameters(q)[0] == n_params
    # bfloat16 as asked, but on the CPU a quantized model computes in float32 (loading/weights.py's float32_on_cpu)
    assert q.model.norm.weight.dtype == (mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
    logits = q(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, SHAPES["tiny"]["vocab_size"]) and not bool(mx.isnan(logits).any())


def test_unknown_shape_and_bad_options():
    with pytest.raises(InputError, match="unknown model shape 'gpt-5'"):
        load_bench_model(shape="gpt-5")
    with pytest.raises(InputError, match="not both"):
        load_bench_model(model="x", shape="tiny")
    with pytest.raises(InputError, match="--bits must be 4 or 8"):
        load_bench_model(shape="tiny", bits=3)


def test_header_names_the_decode_steps_and_the_backend(monkeypatch):
    from mlxcel_core import backends, cpu_blas
    from mlxcel_core.backends.base import Backend
    from mlxcel_core.bench import BenchModel, bench_header

    model = BenchModel(model=None, vocab_size=320, description="tiny", filename="x", n_params=1000, size_bytes=2**20)
    monkeypatch.setattr(backends, "_current", Backend())
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    header = bench_header(model)  # on CPU no GPU-only setting: no compiled steps, no batched prefill
    assert header.endswith(f"(x); MLX ops (the portable backend); CPU float32 products: {cpu_blas.status()}")
    assert "decode steps" not in header and "prefilled together" not in header
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert bench_header(model).endswith(
        "; decode steps compiled where supported; MLX ops (the portable backend); "
        "waiting prompts prefilled together: up to 8"
    )

    class WithKernels(Backend):
        name = "cuda"

        def describe(self):
            return "our kernels"

    monkeypatch.setattr(backends, "_current", WithKernels())
    assert bench_header(model).endswith(
        "; decode steps compiled where supported, a lone greedy row's steps replayed "
        "as one recorded graph; our kernels; waiting prompts prefilled together: up "
        "to 8"
    )


# -- the CUDA graph's share of the timed steps ----------------------------------------------------------------
def test_graph_steps_count_the_timed_runs_replayed_steps(tiny, monkeypatch):
    """graph_steps: the decode steps of the timed runs the engine's graph replayed (a stand-in graph here, MLX in place
    of the driver); the warm-up records, so every timed decode step is a replay. None where the engine has no graph."""
    from graph_stand_in import attach_stand_in

    import mlxcel_core.bench as bench
    from mlxcel_core import backends

    config = BenchConfig(n_prompt=(0,), n_gen=(6,), repetitions=2, storage="paged")
    # Without a replayer (the portable backend's engines make none; on CUDA the real one is tested elsewhere):
    monkeypatch.setattr(backends.current(), "graph_decoder", lambda model, storage, open_rows: None)
    (plain,) = run_bench(tiny, config)
    assert plain.graph_steps is None and plain.to_dict()["graph_steps"] is None
    made = []

    def engine_with_graph(*args):
        engine = real(*args)
        made.append(attach_stand_in(engine))
        return engine

    real = bench.engine_for
    monkeypatch.setattr(bench, "engine_for", engine_with_graph)
    (r,) = run_bench(tiny, config)
    (stand_in,) = made
    assert stand_in.recorded == 1  # in the warm-up
    assert r.graph_steps == r.to_dict()["graph_steps"] == 2 * 6  # tg6: the prompt's token, then 6 replayed steps
    (row,) = csv.DictReader(io.StringIO(render([r], "csv")))
    assert row["graph_steps"] == "12"


@pytest.mark.parametrize("chunk,interval", [(32, 1), (16, 3), (4096, 16)])
def test_steady_windows_hold_every_row_when_prompts_span_several_chunks(tiny, chunk, interval):
    """prefill_wait_steps bounds the last row's wait (prompts prefilled one after another, chunk by chunk, between
    decode steps), so a steady-mode run's rows all decode through the window: exactly b x n tokens in it."""
    from mlxcel_core.bench import RandomIdTokenizer, prefill_wait_steps, run_requests
    from mlxcel_core.engine import Engine, EngineConfig

    b, gen = 8, 16
    config = EngineConfig(max_batch_size=b, prefill_chunk_size=chunk, prefill_grant_interval=interval)
    prompts = [random_prompt(tiny.vocab_size, 128, "window", b, i) for i in range(b)]
    engine = Engine(tiny.model, RandomIdTokenizer(tiny.vocab_size), config)
    run = run_requests(engine, prompts, gen + 1 + prefill_wait_steps(config, prompts), steady_tokens=gen)
    assert run.window_tokens == b * gen
