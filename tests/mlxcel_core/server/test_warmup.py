"""The server's warm-up (engine_loop.warm_up): one short request on a throwaway engine before the server turns ready,
so the first client does not wait for GPU kernels to compile; the serving engine starts clean."""

from __future__ import annotations

import logging
import threading

import mlx.core as mx
import pytest

from mlxcel_core.bench import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.models.shapes import build_random_model
from mlxcel_core.server import engine_loop
from mlxcel_core.server.engine_loop import WARMUP_PROMPT, WARMUP_TOKENS, EngineLoop, warmup_rows
from mlxcel_core.server.metrics import ServerMetrics


class _Loaded:
    def __init__(self):
        self.model, self.config = build_random_model("tiny", dtype="float32")
        self.tokenizer = RandomIdTokenizer(self.config["vocab_size"])


def _start(monkeypatch, **kwargs):
    """An EngineLoop on the tiny model, started and waited for; the engines that warm_up ran."""
    warmed = []
    real = engine_loop.warm_up

    def spy(engine, rows=1):
        warmed.append(engine)
        return real(engine, rows)

    monkeypatch.setattr(engine_loop, "warm_up", spy)
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
        assert warmed[0].runner.prefill_tokens == len(WARMUP_PROMPT)  # it did prefill ...
        assert loop.engine.runner.prefill_tokens == 0 and loop.engine.storage.stats().get("prefix_hits", 0) == 0
        assert not loop.engine.has_work()  # ... and the serving engine starts clean
        assert "warm-up: " in caplog.text
    finally:
        loop.stop()


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
    assert engine_loop.warm_up(engine) > 0 and len(produced) == WARMUP_TOKENS


def test_warm_up_fits_a_short_context():
    loaded = _Loaded()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    engine.max_context = 10  # (as --ctx-size would cap it)
    assert engine_loop.warm_up(engine) > 0 and engine.runner.prefill_tokens == 10 - WARMUP_TOKENS


def test_a_failing_warm_up_fails_the_load(monkeypatch):
    failed = []

    def broken(engine, rows=1):
        raise RuntimeError("the warm-up request failed: boom")

    monkeypatch.setattr(engine_loop, "warm_up", broken)
    loop = EngineLoop(_Loaded, EngineConfig(max_batch_size=4), ServerMetrics(), warmup=True,
                      on_load_failed=failed.append)
    loop.start()
    while loop.state == "loading":
        threading.Event().wait(0.02)
    assert loop.state == "failed" and "boom" in str(loop.error) and failed
    assert loop.health().startswith("The engine is not running: the warm-up request failed")


def test_on_a_gpu_the_warm_up_decodes_every_batch_size_up_to_the_limit(monkeypatch):
    """The decode kernels and the compiled step are built per batch size: on a GPU the warm-up visits 1..min(batch
    limit, 8) (requests join one a step), so no client's first batch of a new size waits for compiles; on CPU 1."""
    loaded = _Loaded()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4))
    sizes = []
    decode = engine.runner.decode

    def spying(seq_ids, tokens, before_trace=None):
        sizes.append(len(seq_ids))
        return decode(seq_ids, tokens, before_trace)

    engine.runner.decode = spying
    assert engine_loop.warm_up(engine, rows=3) > 0
    assert sizes[:3] == [1, 2, 3] and max(sizes) == 3 and not engine.has_work()
    assert engine.runner.prefill_tokens == 3 * len(WARMUP_PROMPT)

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert warmup_rows(EngineConfig(max_batch_size=4)) == 1
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert warmup_rows(EngineConfig(max_batch_size=4)) == 4
    assert warmup_rows(EngineConfig(max_batch_size=32)) == 8
