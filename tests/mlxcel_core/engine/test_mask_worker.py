"""A constrained step's host work on the mask worker (engine/mask_worker.py) gives the engine's own tokens, and ending
rows there leaves their storage to the engine's thread."""

from __future__ import annotations

import threading
import time

import pytest
from engine_drive import run_rows

from mlxcel_core import backends
from mlxcel_core.constraints import Constraint
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.mask_worker import MaskWorker
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), log=lambda m: None)


def rows(loaded):
    x = loaded.tokenizer.encode("x", add_special_tokens=False)[0]
    return [
        SamplingParams(max_tokens=40, constraint=Constraint.json_schema(SCHEMA)),  # ends when the object closes
        SamplingParams(max_tokens=7, constraint=Constraint.regex("[0-9]{2,30}")),  # ends at max_tokens
        SamplingParams(max_tokens=12),  # free
        SamplingParams(max_tokens=9, constraint=Constraint.regex("x+"), suppress_tokens=(x,)),  # a dead end
        SamplingParams(max_tokens=6, constraint=Constraint.regex("abc")),  # the grammar completes
        SamplingParams(max_tokens=10, constraint=Constraint.regex("[a-z ]+"), temperature=0.8, seed=3),
    ]


def run(engine, loaded, params, prompt="Hello world"):
    return [
        (tokens, (reason, error)) for tokens, reason, error in run_rows(engine, loaded.tokenizer.encode(prompt), params)
    ]


@pytest.fixture
def on_worker(monkeypatch):
    """The current backend runs constrained steps' host work on the worker; what the worker ran, and the threads
    that freed rows' storage."""
    monkeypatch.setattr(type(backends.current()), "masks_on_worker", lambda self: True)
    seen = {"worker_steps": 0, "free_threads": set()}
    beside = MaskWorker.beside

    def counting(self, work, submit):
        seen["worker_steps"] += 1
        return beside(self, work, submit)

    monkeypatch.setattr(MaskWorker, "beside", counting)
    return seen


def freeing_threads(engine, seen):
    free = engine.storage.free

    def recorded(*args, **kw):
        seen["free_threads"].add(threading.current_thread().name)
        return free(*args, **kw)

    engine.storage.free = recorded


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_the_worker_gives_the_engines_tokens_and_ends(loaded, storage, on_worker, monkeypatch):
    config = EngineConfig(max_batch_size=6, storage=storage)
    with monkeypatch.context() as plain:
        plain.setattr(type(backends.current()), "masks_on_worker", lambda self: False)
        expected = run(Engine(loaded.model, loaded.tokenizer, config), loaded, rows(loaded))
    engine = Engine(loaded.model, loaded.tokenizer, config)
    assert engine._mask_worker is not None
    freeing_threads(engine, on_worker)
    assert run(engine, loaded, rows(loaded)) == expected
    assert on_worker["worker_steps"] >= 5  # the constrained steps ran there
    assert on_worker["free_threads"] == {threading.main_thread().name}  # rows it ended were freed here
    reasons = {end[0] for _, end in expected}
    assert {"stop", "length", "error"} <= reasons  # (the rows end each way, so the worker ended rows of each)


def test_logprobs_are_read_on_the_engines_thread(loaded, on_worker, monkeypatch):
    """Reading a row's logprobs computes with MLX: a step with such a row unread keeps its host work here."""
    from mlxcel_core.engine import engine as engine_module

    threads, real = [], engine_module.token_logprobs

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(engine_module, "token_logprobs", recorded)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2))
    params = [
        SamplingParams(max_tokens=8, constraint=Constraint.regex("[0-9]{8}")),
        SamplingParams(max_tokens=8, logprobs=2),
    ]
    run(engine, loaded, params)
    assert len(threads) == 8 and set(threads) == {threading.main_thread().name}


def test_a_prefix_the_worker_ended_is_reused(loaded, on_worker):
    """A row ended on the worker keeps its conversation's state (the engine's thread stores it): the second turn
    computes only its new tokens."""
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    prompt = "Hello world, here is a longer prompt so that whole blocks of it are cached for the next turn"
    digits = SamplingParams(max_tokens=20, constraint=Constraint.regex("[0-9]{20}"))
    [(first, _)] = run(engine, loaded, [digits], prompt)
    follow = loaded.tokenizer.encode(prompt) + first + loaded.tokenizer.encode(" and more")
    seq = engine.open(follow, SamplingParams(max_tokens=2))
    while engine.has_work():
        engine.step()
    assert on_worker["worker_steps"] > 0 and engine.sequence(seq).cached_tokens > 0


def test_the_works_error_is_raised_after_the_submission():
    worker, order = MaskWorker(), []

    def work():
        time.sleep(0.05)
        order.append("work")
        raise ValueError("in the work")

    with pytest.raises(ValueError, match="in the work"):
        worker.beside(work, lambda: order.append("submitted"))
    assert order == ["submitted", "work"]

    def failing_submit():
        raise RuntimeError("in the submission")

    with pytest.raises(RuntimeError, match="in the submission"):
        worker.beside(lambda: (time.sleep(0.05), order.append("second work")), failing_submit)
    assert order[-1] == "second work"  # waited for before the submission's error went up
    worker.close()
