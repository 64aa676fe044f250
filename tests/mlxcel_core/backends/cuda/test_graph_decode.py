"""backends/cuda/graph_decode.py: a lone greedy row's decode steps replayed as one CUDA graph (the CUDA backend's
replayer; EngineConfig.decode_graph=False builds an engine without it).

On CPU: the engine's side with MLX standing in for the CUDA driver (a GraphDecoder whose `_build` keeps the step's
layout and whose `_launch` computes the step with MLX from the same storage ints). Requests arriving and ending at
different steps give the plain engine's tokens, the stand-in serves exactly the steps where one greedy row decodes
alone, and the engine settles it before anything of MLX's runs. A constrained row's replays (forward, the engine's
mask, masked greedy) give the plain engine's constrained tokens, also where the row ends between the two parts
(grammar complete, dead end). `blockers` is checked on made-up launches.
On CUDA: the real graph on a Llama-3.2-1B-shaped 4-bit model gives the plain engine's greedy tokens, replaying, free
and constrained.
"""

from __future__ import annotations

import contextlib
import ctypes

import mlx.core as mx
import numpy as np
import pytest
from engine_drive import drive
from graph_stand_in import attach_stand_in
from tiny_models import save_tiny_llama

from mlxcel_core import backends
from mlxcel_core.backends.cuda.graph_decode import GraphDecoder, _Replay, _Slot, blockers, module_arrays
from mlxcel_core.backends.cuda.kernels.cubin_cache import Launch
from mlxcel_core.constraints import Constraint
from mlxcel_core.engine import Engine, EngineConfig, constrained
from mlxcel_core.engine.step_inputs import packed_ints
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(11)
PROMPTS = [rng.integers(3, 300, size=n).tolist() for n in (7, 30, 3, 12)]
ARRIVAL_STEP = [0, 9, 10, 40]
MAX_TOKENS = [24, 6, 20, 70]  # the last runs alone past block boundaries (32-token blocks) and a table width change


@pytest.fixture(autouse=True)
def no_real_graph(monkeypatch):
    """The stand-in tests' engines make no GraphDecoder of their own (on CUDA the backend's default would)."""
    monkeypatch.setattr(backends.current(), "graph_decoder", lambda model, storage, open_rows: None)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    lm = load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny-graph"))), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


@pytest.mark.parametrize("logprobs_row", [None, 2])
def test_the_stand_in_serves_lone_greedy_rows_and_gives_the_plain_tokens(loaded, logprobs_row):
    params = [SamplingParams(max_tokens=n, logprobs=2 if i == logprobs_row else None) for i, n in enumerate(MAX_TOKENS)]
    # (whole-prompt prefills, as on a GPU: a CPU chunk keeps a prefilling row live beside the lone decoding one)
    config = EngineConfig(max_batch_size=4, storage="paged", prefill_chunk_size=2048)
    plain = drive(Engine(loaded.model, loaded.tokenizer, config), PROMPTS, ARRIVAL_STEP, params)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    assert engine.graph is None  # (no_real_graph)
    stand_in = attach_stand_in(engine)
    assert drive(engine, PROMPTS, ARRIVAL_STEP, params) == plain
    assert {i: len(t) for i, t in plain.items()} == dict(enumerate(MAX_TOKENS))
    assert stand_in.alone and set(stand_in.alone) == {1}  # replays only while one row is live
    # Rows 0 (alone at first) and 3 (alone at the end) replay; row 2 is the logprobs row in one run, never replayed.
    assert stand_in.replayed > 60
    # recorded once per block-table width, then adopted (after MLX steps, by the next row), not every step
    assert 2 <= stand_in.recorded <= 4 and stand_in.adopted >= 1
    assert stand_in.settles > 0


def _lone_engine(loaded):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    stand_in = attach_stand_in(engine)
    return engine, stand_in


def test_a_rows_first_step_is_mlxs_and_its_second_records(loaded):
    engine, stand_in = _lone_engine(loaded)
    engine.open(PROMPTS[0], SamplingParams(max_tokens=8))
    engine.step()  # the prompt
    engine.step()  # first decode step: MLX's, so nothing waits for the GPU before the prompt's token is read
    assert (stand_in.recorded, stand_in.replayed) == (0, 0)
    engine.step()
    assert (stand_in.recorded, stand_in.replayed) == (1, 0)
    engine.step()
    assert (stand_in.recorded, stand_in.replayed) == (1, 1)


def test_a_replay_is_adopted_after_an_mlx_step_and_by_the_next_request(loaded):
    engine, stand_in = _lone_engine(loaded)
    first = engine.open(PROMPTS[0], SamplingParams(max_tokens=8))
    for _ in range(4):
        engine.step()
    assert (stand_in.recorded, stand_in.adopted) == (1, 0)
    engine._latest[first] = engine._latest[first] + 0  # as after an MLX step: another array holds the newest token
    engine.step()
    assert (stand_in.recorded, stand_in.adopted) == (1, 1)
    while engine.has_work():
        engine.step()
    # a new request of the same block-table width replays the recording from its first decode step
    plain_engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    expected = drive(plain_engine, [PROMPTS[2]], [0], [SamplingParams(max_tokens=6)])[0]
    replayed = stand_in.replayed
    assert drive(engine, [PROMPTS[2]], [0], [SamplingParams(max_tokens=6)])[0] == expected
    assert stand_in.recorded == 1 and stand_in.adopted == 2 and stand_in.replayed == replayed + 5


def test_replays_are_dropped_when_an_mlx_write_moved_the_pools(loaded):
    engine, stand_in = _lone_engine(loaded)
    stand_in.pools_moved = True
    drive(engine, [PROMPTS[0]], [0], [SamplingParams(max_tokens=8)])
    assert stand_in.recorded == 1
    # the next prompt's prefill writes the pools as new arrays at new addresses: the recording is dropped, made again
    drive(engine, [PROMPTS[2]], [0], [SamplingParams(max_tokens=8)])
    assert stand_in.recorded == 2 and stand_in.adopted == 0


@pytest.mark.parametrize("moved", [False, True])
def test_a_recording_that_moved_the_pools_drops_the_others(loaded, moved):
    engine, stand_in = _lone_engine(loaded)
    stand_in.pools_moved = moved
    drive(engine, [PROMPTS[3]], [0], [SamplingParams(max_tokens=70)])  # crosses block-table widths: records again
    assert stand_in.recorded >= 2
    assert len(stand_in.replays) == (1 if moved else stand_in.recorded)


def test_a_replay_that_fails_ends_its_row_and_leaves_later_steps_to_mlx(loaded):
    engine, stand_in = _lone_engine(loaded)
    expected = drive(
        Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged")),
        [PROMPTS[2]],
        [0],
        [SamplingParams(max_tokens=12)],
    )[0]
    launch = stand_in._launch

    def failing(*args):
        raise RuntimeError("cuGraphLaunch: CUDA error 999 (stand-in)")

    stand_in._launch = failing
    seq = engine.open(PROMPTS[0], SamplingParams(max_tokens=12))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    engine.release(seq)
    assert outputs[-1].finish_reason == "error" and "CUDA error 999" in outputs[-1].error
    assert not stand_in.usable and "CUDA error 999" in stand_in.why_not
    stand_in._launch = launch
    replayed = stand_in.replayed
    assert drive(engine, [PROMPTS[2]], [0], [SamplingParams(max_tokens=12)])[0] == expected  # MLX's steps
    assert stand_in.replayed == replayed


def test_a_replay_is_not_adopted_while_the_row_that_owns_its_token_is_open(loaded):
    engine, stand_in = _lone_engine(loaded)
    engine.open(PROMPTS[0], SamplingParams(max_tokens=8))
    for _ in range(4):
        engine.step()
    replay = next(iter(stand_in.replays.values()))
    assert not stand_in._adopt(replay, 12345, replay.token + 0)


def test_blockers_name_what_a_replay_would_read_stale():
    a, w, out1, out2, ints, tok = (mx.zeros((4,)) for _ in range(6))
    where = {id(a): 1000, id(w): 5000, id(out1): 9000, id(out2): 9100, id(ints): 200, id(tok): 300}
    good = [
        Launch("k1", b"", [w, ints, tok], [out1], [], (1, 1, 1), (1, 1, 1)),
        Launch("k2", b"", [out1, w], [out2], [], (1, 1, 1), (1, 1, 1)),
    ]
    assert blockers(good, where, held={5000}, step_ints=(200, 264), fresh={300}, copied=set()) == []
    # a launch reads a view of the input token (another array object at the same address): still the token
    view = tok[None]
    where[id(view)] = 300
    viewed = [Launch("k1", b"", [w, ints, view], [out1], [], (1, 1, 1), (1, 1, 1))]
    assert blockers(viewed, where, {5000}, (200, 264), {300}, set()) == []
    stale = good + [Launch("k3", b"", [a], [], [], (1, 1, 1), (1, 1, 1))]
    assert blockers(stale, where, {5000}, (200, 264), {300}, set()) == [
        "launch 2 (k3) reads a (4,) mlx.core.float32 array made by MLX in the step"
    ]
    assert "copies first" in blockers(good, where, {5000}, (200, 264), {300}, {id(w)})[0]
    mlx_own = [Launch(None, b"", [w], [], [], (1, 1, 1), (1, 1, 1))]
    assert "not a cached kernel" in blockers(mlx_own, where, {5000}, (200, 264), set(), set())[0]
    # an output read before its launch ran is not "an earlier launch's output"
    backwards = [good[1], good[0]]
    assert len(blockers(backwards, where, {5000}, (200, 264), {300}, set())) == 1


HEX = Constraint.regex("[0-9a-f]{40}")  # complete after 40 characters: the row stops on the grammar


def _lone_tokens(engine, prompt, params) -> tuple[list[int], str, str | None]:
    seq = engine.open(prompt, params)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    engine.release(seq)
    return [o.token for o in outputs if o.token is not None], outputs[-1].finish_reason, outputs[-1].error


@pytest.mark.parametrize("constraint", [HEX, Constraint.grammar('start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]/\n')])
def test_a_constrained_row_replays_in_two_parts_and_gives_the_plain_tokens(loaded, constraint):
    params = SamplingParams(max_tokens=60, constraint=constraint)
    plain_engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    free = _lone_tokens(plain_engine, PROMPTS[0], SamplingParams(max_tokens=20))
    expected = _lone_tokens(plain_engine, PROMPTS[1], params)
    engine, stand_in = _lone_engine(loaded)
    assert _lone_tokens(engine, PROMPTS[1], params) == expected
    assert stand_in.built_masked >= 1 and stand_in.masked_replays >= min(len(expected[0]) - 4, 20)
    # a free row after it records its own (unmasked) replays: the keys differ, the tokens are its own
    assert _lone_tokens(engine, PROMPTS[0], SamplingParams(max_tokens=20)) == free
    assert stand_in.recorded > stand_in.built_masked and stand_in.usable


def test_a_row_that_ends_between_the_two_parts_gets_no_token_and_the_graph_goes_on(loaded, monkeypatch):
    engine, stand_in = _lone_engine(loaded)
    tokens, reason, _ = _lone_tokens(engine, PROMPTS[1], SamplingParams(max_tokens=60, constraint=HEX))
    assert reason == "stop" and len(tokens) <= 40  # the replay after the last token ran the forward alone
    calls = {"n": 0}
    check = constrained.RowConstraint.check

    def dead_after_ten(self, allows_any):
        calls["n"] += 1
        if calls["n"] > 10:
            raise constrained.ConstraintDeadEnd("no token can continue (test)")
        check(self, allows_any)

    monkeypatch.setattr(constrained.RowConstraint, "check", dead_after_ten)
    tokens, reason, error = _lone_tokens(engine, PROMPTS[1], SamplingParams(max_tokens=60, constraint=HEX))
    assert (len(tokens), reason) == (10, "error") and "(test)" in error
    monkeypatch.undo()
    assert stand_in.usable
    plain_engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2, storage="paged"))
    expected = _lone_tokens(plain_engine, PROMPTS[2], SamplingParams(max_tokens=30, constraint=HEX))
    assert _lone_tokens(engine, PROMPTS[2], SamplingParams(max_tokens=30, constraint=HEX)) == expected


def test_module_arrays_include_private_ones(loaded):
    model = loaded.model
    layer = model.layers[0]
    layer._cached_constant = mx.ones((3,))
    try:
        found = {id(a) for a in module_arrays(model)}
        assert id(layer._cached_constant) in found
        assert id(model.layers[-1].self_attn.q_proj.weight) in found
    finally:
        del layer["_cached_constant"]


cuda = pytest.mark.skipif(not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("bits", [4, None], ids=["4bit", "bf16"])  # (bf16 replays since the 16-bit lookup kernel)
def test_the_cuda_graph_gives_the_plain_engines_greedy_tokens(monkeypatch, bits):
    from mlxcel_core.bench import RandomIdTokenizer, random_prompt
    from mlxcel_core.loading.shapes import build_random_model

    model, config = build_random_model("llama-3.2-1b", bits=bits, seed=0)
    prompt = random_prompt(config["vocab_size"], 100, 0, "graph-test")

    def tokens(engine):
        seq = engine.open(prompt, SamplingParams(max_tokens=60))
        out = []
        while engine.has_work():
            out += [o.token for o in engine.step() if o.token is not None]
        engine.release(seq)
        return out

    tokenizer = RandomIdTokenizer(config["vocab_size"])
    plain_engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1, decode_graph=False))
    assert plain_engine.graph is None
    # The second request's prompt comes from the prefix cache but for its last partial block: a 4-token prefill,
    # whose rounding differs from the whole prompt's. On these random weights its greedy tokens differ from the
    # first request's (seen on the H200), in both engines alike, so each request is compared with its plain twin.
    plain, plain_again = tokens(plain_engine), tokens(plain_engine)
    monkeypatch.undo()  # the backend's own replayer from here on
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1))
    assert engine.graph is not None
    graph = engine.graph

    def counters():
        return dict(recorded=graph.recorded, replayed=graph.replayed, adopted=graph.adopted, why_not=graph.why_not)

    def first_difference(out, expected):
        return next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), min(len(out), len(expected)))

    first = tokens(engine)
    assert first == plain, ("request 1 differs at", first_difference(first, plain), counters())
    assert graph.usable and graph.replayed >= 50, counters()
    recorded, replayed = graph.recorded, graph.replayed
    second = tokens(engine)  # the next request adopts the recordings: none made again
    assert second == plain_again, ("request 2 differs at", first_difference(second, plain_again), counters())
    assert graph.recorded == recorded and graph.replayed >= replayed + 55 and graph.adopted >= 1, counters()


@cuda
def test_a_closed_graph_gives_back_the_driver_and_a_new_engine_replays_the_same_tokens(monkeypatch):
    """`mlxcel bench` makes an engine a test and serve a throwaway one for its warm-up: closing a graph that has
    replayed (its CUDA graphs, buffers, events, cubins and stream) must leave the next engine's graph working."""
    from mlxcel_core.bench import RandomIdTokenizer, random_prompt
    from mlxcel_core.loading.shapes import build_random_model

    model, config = build_random_model("llama-3.2-1b", bits=4, seed=0)
    tokenizer = RandomIdTokenizer(config["vocab_size"])
    prompt = random_prompt(config["vocab_size"], 64, 0, "graph-close-test")
    monkeypatch.undo()  # the backend's own replayer

    def replayed_tokens():
        engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1))
        seq = engine.open(prompt, SamplingParams(max_tokens=40))
        out = []
        while engine.has_work():
            out += [o.token for o in engine.step() if o.token is not None]
        engine.release(seq)
        graph = engine.graph
        assert graph.usable and graph.replayed >= 30, graph.why_not
        graph.close()  # explicitly, so a failure raises here instead of inside a finalizer
        assert graph.driver is None and not graph.replays
        return out

    first = replayed_tokens()
    for _ in range(2):
        assert replayed_tokens() == first


@cuda
def test_the_cuda_graph_replays_a_constrained_row_with_the_plain_engines_tokens(monkeypatch, tmp_path):
    """The two-part replay (forward graph, the host's mask, masked greedy graph) on the device, a free row's replays
    beside it: the plain engine's tokens, every replayed constrained token allowed by the grammar."""
    import dataclasses
    import re

    from tiny_models import save_tiny_mlx_llama

    from mlxcel_core.bench import random_prompt
    from mlxcel_core.loading.shapes import build_random_model

    model, config = build_random_model("llama-3.2-1b", bits=4, seed=0)
    tokenizer = load_model(str(save_tiny_mlx_llama(tmp_path / "tok")), log=lambda m: None).tokenizer
    tokenizer = dataclasses.replace(tokenizer, eos_token_ids=set())  # (the grammar keeps its EOS: never reached)
    prompt = random_prompt(config["vocab_size"], 100, 0, "graph-constrained-test")
    hex_params = SamplingParams(max_tokens=50, constraint=Constraint.regex("[0-9a-f]{200}"))
    free_params = SamplingParams(max_tokens=30)
    plain_engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1, decode_graph=False))
    plain = [_lone_tokens(plain_engine, prompt, p) for p in (hex_params, free_params, hex_params)]
    monkeypatch.undo()  # the backend's own replayer from here on
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1))
    graph = engine.graph
    got = [_lone_tokens(engine, prompt, p) for p in (hex_params, free_params, hex_params)]
    counters = dict(recorded=graph.recorded, replayed=graph.replayed, adopted=graph.adopted, why_not=graph.why_not)
    assert got == plain, counters
    assert re.fullmatch("[0-9a-f]+", tokenizer.decode(got[0][0])) and len(got[0][0]) == 50
    assert graph.usable and graph.replayed >= 110 and any(r.masked is not None for r in graph.replays.values())


class FakeDriver:
    """The driver calls `_launch` makes, on host memory: uploads copy bytes into `device` (address -> bytes)."""

    def __init__(self):
        self.calls, self.device, self.buffers = [], {}, []

    def host(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        self.buffers.append(buf)
        return ctypes.c_void_p(ctypes.addressof(buf))

    def upload(self, dst, host, nbytes):
        address = host.value if isinstance(host, ctypes.c_void_p) else host
        self.device[dst] = ctypes.string_at(address, nbytes)
        self.calls.append(("upload", dst))

    def launch_graph(self, exe):
        self.calls.append(("graph", exe))

    def download(self, host, src, nbytes):
        ctypes.memmove(host, src.to_bytes(4, "little", signed=True), 4)  # the "token" read back: its address
        self.calls.append(("download", src))

    def record(self, event):
        self.calls.append(("record", event))

    def pinned(self, nbytes):
        return self.host(nbytes)

    def wait(self, event):
        self.calls.append(("wait", event))


def test_close_destroys_the_graphs_then_closes_the_driver():
    decoder = GraphDecoder(model=None, storage=None)
    calls = []

    class Driver:
        @contextlib.contextmanager
        def current(self):
            calls.append("push")
            yield
            calls.append("pop")

        def synchronize(self):
            calls.append("synchronize")

        def destroy_graph(self, exe):
            calls.append(("destroy", exe))

        def close(self):
            calls.append("close")

    decoder.driver = Driver()
    token = mx.zeros((1,), mx.uint32)
    decoder.replays = {
        "a": _Replay(0, "exe-a", token, 0, 0, 0, [], [], []),
        "b": _Replay(0, None, token, 0, 0, 0, [], [], []),
    }
    decoder.close()
    assert calls == ["push", "synchronize", ("destroy", "exe-a"), "pop", "close"] and not decoder.replays
    assert decoder.driver is None and decoder.slots == []
    decoder.close()  # nothing left: nothing called
    assert len(calls) == 5


def test_a_replay_uploads_the_steps_ints_and_position_then_reads_its_token_through_a_slot():
    decoder = GraphDecoder(model=None, storage=None)
    decoder.driver = driver = FakeDriver()
    decoder.slots = [_Slot(driver.host(4096 * 4), driver.host(64), driver.host(4), f"event{i}") for i in range(4)]
    replay = _Replay(
        0,
        "exe",
        mx.zeros((1,), mx.uint32),
        token_at=55,
        readout_at=77,
        ints_at=1000,
        spans=[],
        positions=[(2000, 0.5)],
        arrays=[],
    )
    parts = ([3], [4], [[0, 1, 2, 0]], [517], [518])
    flat, _ = packed_ints(*parts)
    readouts = []
    for step in range(6):
        readouts.append(decoder._launch(replay, parts, flat))
        decoder.replayed += 1
    assert driver.device[1000] == np.array(flat, np.int32).tobytes()
    assert np.frombuffer(driver.device[2000], np.float32)[0] == np.float32(517) * np.float32(0.5)
    first = driver.calls[:5]
    assert first == [("upload", 1000), ("upload", 2000), ("graph", "exe"), ("download", 77), ("record", "event0")]
    # a slot is waited for before its pinned buffers are written again (the fifth replay reuses the first slot)
    waits = [c for c in driver.calls if c[0] == "wait"]
    assert waits == [("wait", "event0"), ("wait", "event1")]
    assert readouts[-1].tolist() == [77] and driver.calls[-1] == ("wait", "event1")


def test_a_constrained_replay_runs_the_forward_then_asks_for_the_mask_then_runs_the_masked_greedy():
    """The mask is asked for once the forward graph is queued, copied into the recorded mask array through the slot's
    pinned buffer, then the masked greedy graph runs and the readout comes back; a row that ended meanwhile (no mask)
    gets neither, but its slot's event is recorded (its pinned ints may still feed a queued copy)."""
    decoder = GraphDecoder(model=None, storage=None)
    decoder.driver = driver = FakeDriver()
    decoder.slots = [_Slot(driver.host(4096 * 4), driver.host(64), driver.host(4), f"event{i}") for i in range(4)]
    token = mx.zeros((1,), mx.uint32)
    replay = _Replay(0, "exe", token, 55, 77, 1000, [], [], [], masked="exe-mask", mask_at=3000)
    parts = ([3], [4], [[0, 1, 2, 0]], [517], [518])
    flat, _ = packed_ints(*parts)
    bitmask = np.arange(1, 9, dtype=np.int32).reshape(1, 8)

    def masks():
        driver.calls.append(("masks",))
        return bitmask

    readout = decoder._launch(replay, parts, flat, masks)
    assert driver.calls == [
        ("upload", 1000),
        ("graph", "exe"),
        ("masks",),
        ("upload", 3000),
        ("graph", "exe-mask"),
        ("download", 77),
        ("record", "event0"),
    ]
    assert driver.device[3000] == bitmask.tobytes() and readout.tolist() == [77]
    decoder.replayed += 1
    driver.calls.clear()
    assert decoder._launch(replay, parts, flat, lambda: None) is None
    assert driver.calls == [("upload", 1000), ("graph", "exe"), ("record", "event1")]
