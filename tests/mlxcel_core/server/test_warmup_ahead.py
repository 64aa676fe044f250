"""The warm-up's dry run (server/warmup.py `warm_up_ahead`): where the backend compiles kernels of its own, the plan
runs first on a throwaway engine whose launches give zeros while the kernels compile side by side, then for real.

On CPU with a stand-in backend: the order, the dry engine's configuration (no compiled steps, no graph, the serving
storage), a tokenizer that ends no request, and that its failure costs only a warning. On CUDA: the real warm-up then
compiles nothing, and a served reply keeps the tokens it had before any of it."""

from __future__ import annotations

import gc
import logging
import re
import threading
from contextlib import contextmanager

import mlx.core as mx
import pytest

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend
from mlxcel_core.bench import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams
from mlxcel_core.server import warmup
from mlxcel_core.server.engine_loop import EngineLoop
from mlxcel_core.server.metrics import ServerMetrics
from mlxcel_core.server.warmup import WARMUP_PROMPT, WarmupPlan, dry_run_config, warm_up_ahead, warmup_plan


class _Loaded:
    def __init__(self):
        self.model, self.config = build_random_model("tiny", dtype="float32")
        self.tokenizer = RandomIdTokenizer(self.config["vocab_size"])


class _Ahead(Backend):
    """A backend that compiles ahead: its context records when the dry run is inside it."""

    def __init__(self):
        self.inside = False
        self.entered = 0

    def compile_ahead(self, model=None):
        @contextmanager
        def ahead():
            self.inside, self.entered = True, self.entered + 1
            try:
                yield
            finally:
                self.inside = False

        return ahead()


def _start(monkeypatch, backend, broken_dry_run=False):
    """An EngineLoop with the warm-up on; each warm_up call as (engine, dry_run, inside the backend's context)."""
    calls = []
    real = warmup.warm_up

    def spy(engine, plan=WarmupPlan(), dry_run=False, compiling=None):
        calls.append((engine, dry_run, getattr(backend, "inside", False)))
        if dry_run and broken_dry_run:
            raise RuntimeError("boom")
        return real(engine, plan, dry_run=dry_run, compiling=compiling)

    monkeypatch.setattr(warmup, "warm_up", spy)
    monkeypatch.setattr(backends, "_current", backend)
    loop = EngineLoop(_Loaded, EngineConfig(max_batch_size=4), ServerMetrics(), warmup=True)
    loop.start()
    while loop.state == "loading":
        threading.Event().wait(0.02)
    return loop, calls


def test_the_dry_run_comes_first_inside_the_backends_context_on_an_engine_that_keeps_nothing(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mlxcel.server")
    backend = _Ahead()
    loop, calls = _start(monkeypatch, backend)
    try:
        dry_log = next(r.getMessage() for r in caplog.records if "dry run parts" in r.getMessage())
        real_log = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up parts"))
        # (CPU: one request; on a GPU the dry run's lone reply compiles the real kernels, so the run goes on)
        assert re.fullmatch(r"warm-up dry run parts: lone reply [\d.]+ s(, .+)?", dry_log), dry_log
        assert re.fullmatch(r"warm-up parts: lone reply [\d.]+ s(, .+)?", real_log), real_log
        assert loop.state == "ready" and backend.entered == 1 and len(calls) == 2
        (dry, dry_flag, dry_inside), (real, real_flag, real_inside) = calls
        assert dry_flag and dry_inside and not real_flag and not real_inside
        serving = loop.engine.config
        assert dry.config.compile_decode is False and dry.config.decode_graph is False and dry.graph is None
        assert dry.config.storage == serving.resolved_storage and dry.runner.compiled is None
        assert real.config == serving and loop.engine not in (dry, real)
        assert loop.engine.runner.prefill_tokens == 0 and not loop.engine.has_work()
    finally:
        loop.stop()


def test_a_backend_without_compiles_of_its_own_gets_no_dry_run(monkeypatch):
    loop, calls = _start(monkeypatch, Backend())
    loop.stop()
    assert loop.error is None and [flag for _, flag, _ in calls] == [False]


def test_a_failed_dry_run_is_a_warning_and_the_warm_up_goes_on(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="mlxcel.server")
    backend = _Ahead()
    loop, calls = _start(monkeypatch, backend, broken_dry_run=True)
    loop.stop()
    assert [flag for _, flag, _ in calls] == [True, False] and loop.error is None
    assert "the warm-up's dry run failed (RuntimeError: boom)" in caplog.text and not backend.inside


def test_a_dry_runs_requests_end_at_no_end_of_sequence_token_and_sample_as_the_real_ones():
    """The dry run's logits are zeros, whose greedy token may be an end-of-sequence one: here the model's own first
    token is made one, so with the real tokenizer's stop the lone request would end at once. The dry run's engine gets
    a tokenizer that ends nothing, and its requests keep the real ones' sampling (the greedy readout: no logits
    processor suppressing tokens)."""
    loaded = _Loaded()
    probe = Engine(loaded.model, loaded.tokenizer, EngineConfig())
    probe.open(WARMUP_PROMPT, SamplingParams(max_tokens=1))
    first = [o.token for o in probe.step() if o.token is not None]
    while probe.has_work():
        first += [o.token for o in probe.step() if o.token is not None]
    loaded.tokenizer.eos_token_ids = frozenset(first[:1])
    for dry_run, tokens in ((False, 1), (True, 6)):
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig())
        opened, made = [], []
        open_, step = engine.open, engine.step

        def spy_open(prompt, params):
            opened.append(params)
            return open_(prompt, params)

        def spy_step():
            out = step()
            made.extend(o.token for o in out if o.token is not None)
            return out

        engine.open, engine.step = spy_open, spy_step
        warmup.warm_up(engine, WarmupPlan(lone_tokens=6), dry_run=dry_run)
        assert [(p.suppress_tokens, p.masked_greedy) for p in opened] == [((), True)]
        assert len(made) == tokens and made[0] == first[0]
        assert (engine.tokenizer.eos_token_ids == frozenset()) == dry_run
        assert engine.tokenizer.vocab_size == loaded.tokenizer.vocab_size  # (the rest is the real tokenizer's)


@pytest.mark.parametrize("compiled", [[], ["mlxcel_qmv_1"]])
def test_a_dry_run_whose_lone_reply_compiled_nothing_stops_there(monkeypatch, caplog, compiled):
    """A restart: the kernel cache holds the model's kernels, so the rest of the dry run would compile nothing
    either; the warm-up proper still runs the whole plan."""
    caplog.set_level(logging.INFO, logger="mlxcel.server")

    class Collecting(Backend):
        def compile_ahead(self, model=None):
            @contextmanager
            def ahead():
                yield type("Ahead", (), {"submitted": compiled})()

            return ahead()

    monkeypatch.setattr(backends, "_current", Collecting())
    loaded = _Loaded()
    opened = []

    def new_engine(dry=False):
        config = EngineConfig(max_batch_size=3)
        engine = Engine(loaded.model, loaded.tokenizer, dry_run_config(config) if dry else config)
        open_ = engine.open
        engine.open = lambda prompt, params: opened.append(dry) or open_(prompt, params)
        return engine

    warm_up_ahead(new_engine, WarmupPlan(lone_tokens=5, rows=3, prompt_lengths=(1, 2)))
    dry, real = opened.count(True), opened.count(False)
    assert real == 1 + 3 + 2 and dry == (1 if not compiled else real)
    assert ("(nothing left to compile)" in caplog.text) == (not compiled)


@pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs CUDA")
def test_on_cuda_the_warm_up_after_a_dry_run_compiles_nothing_the_dry_run_launched(monkeypatch, tmp_path):
    from mlxcel_core.backends.cuda.kernels import cubin_cache
    from mlxcel_core.loading.shapes import shape_config

    small = dict(shape_config("llama-3.2-1b"), num_hidden_layers=2)
    model, config = build_random_model("llama-3.2-1b", bits=4, seed=0, config=small)
    tokenizer = RandomIdTokenizer(config["vocab_size"])
    serving = EngineConfig(max_batch_size=4)

    def reply() -> list[int]:
        engine = Engine(model, tokenizer, serving)
        engine.open(list(range(100, 140)), SamplingParams(max_tokens=40))
        out = []
        while engine.has_work():
            out += [o.token for o in engine.step() if o.token is not None]
        return out

    before = reply()
    # an empty kernel cache for every cached kernel, made or to be made
    monkeypatch.setattr("mlxcel_core.paths.use_kernel_cache", lambda: tmp_path)
    for kernel in [o for o in gc.get_objects() if isinstance(o, cubin_cache.CachedKernel)]:
        monkeypatch.setattr(kernel, "directory", tmp_path)
        monkeypatch.setattr(kernel, "_variants", {})
    compiled, real_compile = [], cubin_cache.compile_cubin

    def compile_cubin(text, name, arch):
        compiled.append((name, threading.current_thread().name))
        return real_compile(text, name, arch)

    monkeypatch.setattr(cubin_cache, "compile_cubin", compile_cubin)

    new_engine = lambda dry=False: Engine(model, tokenizer, dry_run_config(serving) if dry else serving)  # noqa: E731
    warm_up_ahead(new_engine, warmup_plan(serving))
    ahead = [name for name, thread in compiled if thread.startswith("mlxcel-nvrtc")]
    later = [name for name, thread in compiled if not thread.startswith("mlxcel-nvrtc")]
    # (the warm-up proper compiles nothing: its graph recording's address kernels and final norm were launched dry)
    assert len(ahead) >= 10 and later == [], (len(ahead), later)
    assert reply() == before


@pytest.mark.parametrize("warm", [True, False])
def test_serve_starts_mlxs_modules_from_the_checkpoint_before_reading_its_weights(monkeypatch, tmp_path, warm):
    """`mlxcel serve` with its warm-up: once the model directory is found, before its weights are read, the backend
    starts MLX's modules from the checkpoint's files (Backend.mlx_modules_early), so the compiles overlap the load;
    a GGUF file (its dtype is the loader's choice) and a failure there start nothing and fail nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from servers import start_server
    from tiny_models import save_tiny_llama

    from mlxcel_core.loading import load as load_module
    from mlxcel_core.loading.resolve import ModelSource

    events = []

    class Early(Backend):
        def mlx_modules_early(self, checkpoint):
            events.append(("early", checkpoint))
            return 2

    real_weights = load_module.load_hf_weights
    monkeypatch.setattr(
        load_module, "load_hf_weights", lambda *a, **k: events.append("weights") or real_weights(*a, **k)
    )
    monkeypatch.setattr(backends, "_current", Early())
    path = save_tiny_llama(tmp_path / "m")
    server = start_server(path, warmup=warm)
    try:
        with server.client() as client:
            assert client.get("/health").status_code == 200
    finally:
        server.stop()
    assert events == ([("early", path)] if warm else []) + ["weights"]
    events.clear()
    warmup.modules_early(ModelSource(tmp_path / "m.gguf", "gguf", "local GGUF"))

    class Broken(Backend):
        def mlx_modules_early(self, checkpoint):
            raise OSError("no cache directory")

    monkeypatch.setattr(backends, "_current", Broken())
    warmup.modules_early(ModelSource(path, "hf-dir", "local directory"))
    assert events == []
