"""The server's warm-up (server/warmup.py): short requests on a throwaway engine before the server turns ready, so
the first client does not wait for GPU kernels to compile; the serving engine starts clean."""

from __future__ import annotations

import logging
import threading
import time

import mlx.core as mx
import pytest
from tiny_models import save_tiny_mlx_llama

from mlxcel_core.bench import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig, constrained
from mlxcel_core.loading import load_model
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.server import warmup
from mlxcel_core.server.engine_loop import EngineLoop
from mlxcel_core.server.metrics import ServerMetrics
from mlxcel_core.server.warmup import WARMUP_PROMPT, WARMUP_TOKENS, WarmupPlan, warmup_plan


class _Loaded:
    def __init__(self):
        self.model, self.config = build_random_model("tiny", dtype="float32")
        self.tokenizer = RandomIdTokenizer(self.config["vocab_size"])


def _start(monkeypatch, **kwargs):
    """An EngineLoop on the tiny model, started and waited for; the engines that warm_up ran."""
    warmed = []
    real = warmup.warm_up

    def spy(engine, plan=WarmupPlan(), **kwargs):
        if not kwargs.get("dry_run"):  # (a GPU's backend runs the plan dry first, on an engine of its own)
            warmed.append(engine)
        return real(engine, plan, **kwargs)

    monkeypatch.setattr(warmup, "warm_up", spy)
    loop = EngineLoop(_Loaded, EngineConfig(max_batch_size=4), ServerMetrics(), **kwargs)
    loop.start()
    while loop.state == "loading":
        threading.Event().wait(0.02)
    return loop, warmed


def test_the_warm_up_runs_on_its_own_engine_before_ready(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mlxcel.server")
    loop, warmed = _start(monkeypatch, warmup=True)
    try:
        assert loop.state == "ready" and len(warmed) == 1 and warmed[0] is not loop.engine
        plan = warmup_plan(loop.engine_config)  # (on CPU one request, on a GPU more)
        requests = 1 + (plan.rows if plan.rows > 1 else 0)  # (a constrained one needs a tokenizer with text)
        assert warmed[0].runner.prefill_tokens == requests * len(WARMUP_PROMPT) + sum(plan.prompt_lengths)  # ...
        assert loop.engine.runner.prefill_tokens == 0 and loop.engine.storage.stats().get("prefix_hits", 0) == 0
        assert not loop.engine.has_work()  # ... and the serving engine starts clean
        assert "warm-up: " in caplog.text
    finally:
        loop.stop()


def test_the_warm_up_log_counts_the_backends_own_compiles(monkeypatch, caplog):
    """The backend's kernels compiled in the process (CUDA: the kernel cache's NVRTC compiles) join the warm-up's log
    line; a backend that compiles none adds nothing."""
    from mlxcel_core import backends
    from mlxcel_core.backends.base import Backend

    class Compiling(Backend):
        def kernel_compiles(self):
            return 42, 12.345

    caplog.set_level(logging.INFO, logger="mlxcel.server")
    monkeypatch.setattr(backends, "_current", Compiling())
    loop, _ = _start(monkeypatch, warmup=True)
    loop.stop()
    assert "; mlxcel's kernels: 42 compiled in 12.3 s" in caplog.text
    monkeypatch.setattr(backends, "_current", Backend())
    caplog.clear()
    loop, _ = _start(monkeypatch, warmup=True)
    loop.stop()
    assert "warm-up: " in caplog.text and "mlxcel's kernels" not in caplog.text


@pytest.mark.parametrize("kwargs", [{}, {"warmup": False}])
def test_no_warm_up_unless_asked(monkeypatch, kwargs):
    loop, warmed = _start(monkeypatch, **kwargs)
    loop.stop()
    assert loop.state in ("ready", "stopped") and warmed == []


def test_a_tensor_parallel_leader_does_not_warm_up():
    """Its ranks mirror every engine input: a warm-up they did not see would desynchronize them."""
    loop = EngineLoop(_Loaded, EngineConfig(max_batch_size=4), ServerMetrics(), warmup=True, group=object())
    assert loop.warmup is False


def test_warm_up_decodes_its_tokens():
    loaded = _Loaded()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    produced = []
    step = engine.step

    def counting_step():
        out = step()
        produced.extend(o.token for o in out if o.token is not None)
        return out

    engine.step = counting_step
    assert warmup.warm_up(engine) > 0 and len(produced) == WARMUP_TOKENS


def test_warm_up_fits_a_short_context():
    loaded = _Loaded()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    engine.max_context = 10  # (as --ctx-size would cap it)
    assert warmup.warm_up(engine) > 0 and engine.runner.prefill_tokens == 10 - WARMUP_TOKENS


def test_a_failing_warm_up_fails_the_load(monkeypatch):
    failed = []

    def broken(engine, plan=WarmupPlan(), **kwargs):
        raise RuntimeError("the warm-up request failed: boom")

    monkeypatch.setattr(warmup, "warm_up", broken)
    loop = EngineLoop(
        _Loaded, EngineConfig(max_batch_size=4), ServerMetrics(), warmup=True, on_load_failed=failed.append
    )
    loop.start()
    deadline = time.monotonic() + 120  # (on CUDA the load first compiles MLX's modules the steps need)
    while time.monotonic() < deadline:  # the state turns "failed" just before the callback runs
        if loop.state != "loading" and failed:
            break
        threading.Event().wait(0.02)
    assert loop.state == "failed" and "boom" in str(loop.error) and failed
    assert loop.health().startswith("The engine is not running: the warm-up request failed")


def test_the_warm_up_runs_a_lone_request_then_every_batch_size_then_each_short_prompt(monkeypatch):
    """What a GPU builds per shape: the decode kernels and the compiled step per batch size (requests join one a step:
    1..rows), the kernels per prompt length up to their rows (each prefilled alone and whole), and the CUDA graph of a
    lone greedy request (one first, decoding alone)."""
    loaded = _Loaded()
    # (whole-prompt prefills, as on a GPU, where the warm-up runs)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, prefill_chunk_size=2048))
    sizes, prefills = [], []
    decode, prefill = engine.runner.decode, engine.runner.prefill

    def spying_decode(seq_ids, tokens):
        sizes.append(len(seq_ids))
        return decode(seq_ids, tokens)

    def spying_prefill(*args, **kwargs):
        before = engine.runner.prefill_tokens
        out = prefill(*args, **kwargs)
        prefills.append(engine.runner.prefill_tokens - before)
        return out

    engine.runner.decode, engine.runner.prefill = spying_decode, spying_prefill
    assert warmup.warm_up(engine, WarmupPlan(lone_tokens=6, rows=3, prompt_lengths=(1, 2, 5))) > 0
    # The lone request's 5 decode steps, then batches of each size up to 3 (on CPU 1, 2, 3 in order; on a GPU a new
    # row's prefill takes its own step, so the first batch there is 2); the short prompts decode nothing.
    assert sizes[:5] == [1] * 5 and set(sizes[5:]) <= {1, 2, 3} and {2, 3} <= set(sizes[5:])
    assert prefills == [len(WARMUP_PROMPT)] * 4 + [1, 2, 5] and not engine.has_work()


def test_a_burst_grows_the_decode_batch_a_prefill_batch_a_step_up_to_the_whole_burst():
    """As a burst of clients does on a GPU (prefill batches of 8 there; of 4 here): every size it passes through, and
    the burst's own, runs a decode step, so its compiled steps and kernel variants are built before a client waits."""
    loaded = _Loaded()
    config = EngineConfig(max_batch_size=10, prefill_batch_size=4, prefill_chunk_size=2048)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    sizes, decode = [], engine.runner.decode

    def spying_decode(seq_ids, tokens):
        sizes.append(len(seq_ids))
        return decode(seq_ids, tokens)

    engine.runner.decode = spying_decode
    assert warmup.warm_up(engine, WarmupPlan(burst=10)) > 0 and not engine.has_work()
    burst = sizes[sizes.index(next(s for s in sizes if s > 1)) :]  # (after the lone request's steps: on a GPU its
    # replayed graph steps do not call runner.decode)
    assert burst[:3] == [4, 8, 10] and max(burst) == 10


def test_the_plan_on_a_gpu_covers_the_split_attention_and_the_kernels_rows_and_on_cpu_one_request(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert warmup_plan(EngineConfig(max_batch_size=4)) == WarmupPlan(rows=1, prompt_lengths=())
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert warmup_plan(EngineConfig(max_batch_size=4)) == WarmupPlan(
        lone_tokens=2 * 64 + 1 - len(WARMUP_PROMPT), rows=4, prompt_lengths=tuple(range(1, 9)), constrained=True
    )
    assert warmup_plan(EngineConfig(max_batch_size=32)).rows == 8
    assert (
        warmup_plan(EngineConfig(max_batch_size=32)).describe()
        == "a lone reply of 113 tokens, decode batches of 1 to 8, a burst of 32 requests, prompts of 1 to 8 tokens, "
        "a constrained reply"
    )
    assert (
        warmup_plan(EngineConfig(max_batch_size=32)).burst == 32
        and warmup_plan(EngineConfig(max_batch_size=8)).burst == 0
    )
    assert WarmupPlan().describe() == f"a lone reply of {WARMUP_TOKENS} tokens"


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs CUDA")
def test_on_cuda_the_warm_up_records_and_replays_the_graph_and_prefills_each_short_prompt():
    """The graph's recording compiles kernels of its own (the address kernels), and each short prompt length its
    matvec variants: without them in the warm-up, a fresh H200's first request after it spent 1.3 s recording and
    1.5 s in a 5-token prefill (benchmarks/RESULTS.md, twenty-third session)."""
    model, config = build_random_model("llama-3.2-1b", bits=4, seed=0)
    engine = Engine(model, RandomIdTokenizer(config["vocab_size"]), EngineConfig(max_batch_size=4))
    plan = warmup_plan(engine.config)
    assert plan.prompt_lengths and engine.graph is not None
    before = engine.runner.prefill_tokens
    splits = []
    choose = engine.storage.choose_splits
    engine.storage.choose_splits = lambda *args: splits.append(choose(*args)) or splits[-1]
    warmup.warm_up(engine, plan)
    assert engine.graph.recorded >= 2 and engine.graph.replayed >= 1, engine.graph.why_not
    assert min(splits) == 1 and max(splits) > 1  # both forms of the attention kernel ran
    assert engine.runner.prefill_tokens - before >= sum(plan.prompt_lengths) + len(WARMUP_PROMPT)


def test_a_constrained_warm_up_request_decodes_digits_and_its_failure_is_only_a_warning(monkeypatch, caplog, tmp_path):
    """On a GPU the plan adds a lone constrained request (the masked greedy kernel and its replay); a tokenizer whose
    grammar fails leaves free requests served."""
    loaded = load_model(str(save_tiny_mlx_llama(tmp_path / "tiny")), log=lambda m: None)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    produced = []
    step = engine.step

    def counting_step():
        out = step()
        produced.extend(o.token for o in out if o.token is not None and engine.sequence(o.seq_id).params.constraint)
        return out

    engine.step = counting_step
    assert warmup.warm_up(engine, WarmupPlan(lone_tokens=2, constrained=True)) > 0
    assert len(produced) == WARMUP_TOKENS and loaded.tokenizer.decode(produced).isdigit()
    assert engine.runner.prefill_tokens == 2 * len(WARMUP_PROMPT)
    caplog.set_level(logging.WARNING, logger="mlxcel.server")

    def dead_end(self, allows_any):
        raise constrained.ConstraintDeadEnd("llguidance cannot read this tokenizer (test)")

    monkeypatch.setattr(constrained.RowConstraint, "check", dead_end)
    broken = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    assert warmup.warm_up(broken, WarmupPlan(lone_tokens=2, constrained=True)) > 0
    assert "constrained request failed" in caplog.text and "(test)" in caplog.text
