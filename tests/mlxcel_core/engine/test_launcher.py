"""The threaded launcher (MLXCEL_LAUNCH_THREAD=1, engine/launcher.py) gives the inline engine's tokens."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from tiny_models import save_tiny_llama
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.launcher import SWITCH_INTERVAL_S, InlineLauncher, ThreadLauncher
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(5)
PROMPTS = [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 1, 40, 9)]
ARRIVAL_STEP = [0, 0, 3, 4, 20]
MAX_TOKENS = [30, 12, 25, 9, 14]


@pytest.fixture(autouse=True)
def switch_interval():
    """Threaded engines lower the process's GIL switch interval: the other tests get theirs back."""
    kept = sys.getswitchinterval()
    yield
    sys.setswitchinterval(kept)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    lm = load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny-launch"))), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def drive(engine: Engine, params, close_at: dict[int, int] | None = None, unread: list | None = None):
    """Open request i at step ARRIVAL_STEP[i] (close it at step close_at[i]); each request's tokens. `unread`: gets
    how many steps were submitted and not read after each step."""
    ids, out, step = {}, {}, 0
    while len(ids) < len(PROMPTS) or engine.has_work():
        for i, (prompt, at) in enumerate(zip(PROMPTS, ARRIVAL_STEP)):
            if at == step and i not in ids:
                ids[i] = engine.open(prompt, params[i])
        for i, at in (close_at or {}).items():
            if at == step:
                engine.close(ids[i])
        for o in engine.step():
            assert o.error is None, o.error
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
        if unread is not None:
            unread.append(len(engine._unread))
        step += 1
    return {i: out.get(s, []) for i, s in ids.items()}


def run(loaded, monkeypatch, threaded: bool, close_at=None, launches: list | None = None, unread=None):
    monkeypatch.setenv("MLXCEL_COMPILE", "1")  # the threaded launcher serves compiled paged steps only
    monkeypatch.setenv("MLXCEL_LAUNCH_THREAD", "1" if threaded else "0")
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_batch_size=4, storage="paged", block_size=8, prefill_chunk_size=8))
    assert isinstance(engine.launcher, ThreadLauncher if threaded else InlineLauncher)
    if launches is not None:
        real = engine.launcher._launch
        monkeypatch.setattr(engine.launcher, "_launch",
                            lambda arrays: (launches.append(threading.current_thread().name), real(arrays)))
    return drive(engine, [SamplingParams(max_tokens=m) for m in MAX_TOKENS], close_at, unread)


def test_threaded_engine_gives_the_inline_tokens(loaded, monkeypatch):
    """Staggered requests, prefill in chunks (each non-last chunk evaluates on the engine's thread), rows joining
    and leaving: every token as the inline engine's, each step launched on the worker thread."""
    inline_unread, unread, launches = [], [], []
    want = run(loaded, monkeypatch, threaded=False, unread=inline_unread)
    assert run(loaded, monkeypatch, threaded=True, launches=launches, unread=unread) == want
    assert launches and all(name.startswith("mlxcel-launch") for name in launches)
    assert max(inline_unread) == 1 and unread.count(2) > 20  # steady steps overlapped (read two steps back)
    assert [len(t) for t in want.values()] == MAX_TOKENS


def test_a_model_with_lazy_constants(monkeypatch, tmp_path):
    """Llama 3 RoPE scaling: the model's RoPE holds frequencies computed (lazily) when it was built, on the engine
    thread's default stream, which the launcher thread cannot run (MLX 0.32: "There is no Stream(gpu, 0) in current
    thread", on the H200 with the Llama-3.2-1B shape). The threaded engine evaluates them first."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    lm = load_model(str(save_tiny_llama(tmp_path, rope_scaling=scaling)), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    want = run(lm, monkeypatch, threaded=False)
    lm = load_model(str(tmp_path), log=lambda m: None)  # built again: its constants lazy again
    lm.tokenizer.eos_token_ids = set()
    assert run(lm, monkeypatch, threaded=True) == want


def test_a_row_ending_on_eos_two_steps_back(loaded, monkeypatch):
    """With lookahead 2 a row's EOS is read while two more of its steps are built: they are dropped, and the
    other rows' tokens do not change."""
    free = run(loaded, monkeypatch, threaded=False)
    eos = free[0][10]  # a token request 0 makes mid-way
    loaded.tokenizer.eos_token_ids = {eos}
    try:
        want = run(loaded, monkeypatch, threaded=False)
        got = run(loaded, monkeypatch, threaded=True)
    finally:
        loaded.tokenizer.eos_token_ids = set()
    assert got == want and len(want[0]) <= 11 and want[0][-1] == eos


def test_a_closed_row_mid_decode(loaded, monkeypatch):
    """A request closed mid-decode ends at once: its tokens not read yet are dropped (one step more of them with
    lookahead 2, so it may end a token shorter); the other rows do not change."""
    want = run(loaded, monkeypatch, threaded=False, close_at={0: 12})
    got = run(loaded, monkeypatch, threaded=True, close_at={0: 12})
    assert {i: t for i, t in got.items() if i} == {i: t for i, t in want.items() if i}
    assert len(want[0]) < MAX_TOKENS[0] and len(want[0]) - 1 <= len(got[0]) <= len(want[0])
    assert got[0] == want[0][:len(got[0])]


def test_inline_unless_asked_and_compiled_paged(loaded, monkeypatch):
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    monkeypatch.delenv("MLXCEL_LAUNCH_THREAD", raising=False)
    assert isinstance(Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="paged")).launcher, InlineLauncher)
    monkeypatch.setenv("MLXCEL_LAUNCH_THREAD", "1")
    assert isinstance(Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="dense")).launcher, InlineLauncher)
    monkeypatch.setenv("MLXCEL_COMPILE", "0")
    assert isinstance(Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="paged")).launcher, InlineLauncher)
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    monkeypatch.setenv("MLX_RANK", "0")  # a tensor-parallel rank
    assert isinstance(Engine(loaded.model, loaded.tokenizer, EngineConfig(storage="paged")).launcher, InlineLauncher)


def test_a_failed_launch_raises_on_the_engine_thread(monkeypatch):
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: switch.append(seconds))
    switch = []
    launcher = ThreadLauncher()
    assert switch == [min(sys.getswitchinterval(), SWITCH_INTERVAL_S)]  # the launcher gets the GIL when it needs it

    def fail(arrays):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(launcher, "_launch", fail)
    launcher.submit([mx.array(1)])
    with pytest.raises(RuntimeError, match="launch failed"):
        launcher.wait()
    launcher.wait()  # reported once
