"""Prompts of a model with recurrent layers prefilled together up to their first stop (engine/scheduler.py,
engine/state_snapshots.py): the same greedy tokens as one prompt at a time and as no prefix cache, the same snapshots
bit for bit, fewer prefill forwards, a kept snapshot reused by a later request, and a cancel mid-prefill that gives
every state slot and block back."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from parity import load_quiet, prompt_ids
from recurrent_tiny import FAMILIES, save_tiny_recurrent

from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.sampling import SamplingParams

BS = 8
# First stops (the prompts' last block boundaries): 24 for the first four, 8 for the fifth; the sixth has none.
LENGTHS = (30, 30, 25, 31, 13, 5)
CONFIG = dict(max_batch_size=len(LENGTHS), storage="paged", block_size=BS, prefill_chunk_size=256, compile_decode=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent-together")
    loaded = {}
    for family in FAMILIES:
        loaded[family] = load_quiet(save_tiny_recurrent(root / family, family))
        loaded[family].tokenizer.eos_token_ids = set()  # every request runs to max_tokens
    return loaded


def prompts() -> list[list[int]]:
    return [prompt_ids(n, seed=i) for i, n in enumerate(LENGTHS)]


def make(loaded, **config) -> tuple[Engine, list[str]]:
    """An engine whose runner records each prefill forward ("alone" or "together")."""
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(**{**CONFIG, **config}))
    calls, runner = [], engine.runner
    prefill, together = runner.prefill, runner.prefill_together
    runner.prefill = lambda *args: calls.append("alone") or prefill(*args)
    runner.prefill_together = lambda *args: calls.append("together") or together(*args)
    return engine, calls


def drive(engine: Engine, prompts: list[list[int]], steps: int, close: tuple[int, ...] = ()) -> list[dict]:
    """Open every prompt at once and step to the end; `close`: rows cancelled after the first step. Per row: its
    tokens, top-3 log-probabilities per token, and its finish reason."""
    ids = [engine.open(p, SamplingParams(max_tokens=steps, logprobs=3)) for p in prompts]
    rows = {i: dict(tokens=[], logprobs=[], finish=None) for i in ids}
    step = 0
    while engine.has_work():
        outputs = engine.step()
        step += 1
        if step == 1:
            for row in close:
                engine.close(ids[row])
        for out in outputs:
            assert out.error is None, out.error
            if out.token is not None:
                rows[out.seq_id]["tokens"].append(out.token)
                rows[out.seq_id]["logprobs"].append([lp for _, lp in out.top_logprobs])
            rows[out.seq_id]["finish"] = out.finish_reason or rows[out.seq_id]["finish"]
    return [rows[i] for i in ids]


def assert_same_tokens(got: list[dict], want: list[dict], atol: float = 1e-4) -> None:
    """Greedy tokens equal, and log-probabilities too (a wrong state can keep a random model's argmax)."""
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"]
        np.testing.assert_allclose(np.array(g["logprobs"]), np.array(w["logprobs"]), atol=atol)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_equal_one_at_a_time_alone_and_without_prefix_cache(models, family):
    loaded = models[family]
    together, calls = make(loaded, prefill_batch_size=8)
    got = drive(together, prompts(), steps=12)
    # 30, 30, 25 and 31 to their stop (24) and the whole 5 in one forward; the rests of the two 30s in one (the same
    # positions), of 25 and 31 one each; then 13 alone (its stop, 8, would have been padded), in two chunks.
    assert calls == ["together", "together"] + ["alone"] * 4
    one_by_one, alone_calls = make(loaded, prefill_batch_size=1)
    assert_same_tokens(got, drive(one_by_one, prompts(), steps=12))
    assert alone_calls == ["alone"] * 11
    # Without a prefix cache a prompt's scan runs in one chunk, not split at its stop: the same maths, rounded
    # otherwise (Nemotron-H's log-probabilities move by 2e-4 over 12 batched decode steps).
    cold = drive(make(loaded, prefill_batch_size=8, prefix_cache=False)[0], prompts(), steps=12)
    assert_same_tokens(got, cold, atol=1e-3)
    for prompt, row in zip(prompts(), got):  # (a batch's decode steps round otherwise than a lone row's: tokens)
        assert row["tokens"] == drive(make(loaded)[0], [prompt], steps=12)[0]["tokens"]
    assert together.storage.states.in_use == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_snapshots_equal_the_one_at_a_time_ones_and_serve_a_later_request(models, family):
    """Each prompt's snapshot at its stop (one token each: no decode step takes one) is the one a chunk prefilled
    alone leaves, array for array; a later request extending a prompt starts from it."""
    loaded = models[family]
    together, calls = make(loaded, prefill_batch_size=8)
    drive(together, prompts(), steps=1)
    assert calls[0] == "together"
    one_by_one, _ = make(loaded, prefill_batch_size=1)
    drive(one_by_one, prompts(), steps=1)
    kept, want = together.storage.snapshots._kept, one_by_one.storage.snapshots._kept
    assert len(kept) == 5 and list(kept) == list(want)
    for block_hash, state in kept.items():
        for parts, wanted in zip(state, want[block_hash], strict=True):
            assert (parts is None) == (wanted is None)
            for array, wanted_array in zip(parts or [], wanted or [], strict=True):
                assert mx.array_equal(array, wanted_array).item()

    longer = prompts()[0] + prompt_ids(9, seed=40)
    before = together.runner.prefill_tokens
    [row] = drive(together, [longer], steps=8)
    assert together.stats().storage["prefix_hits"] == 1
    assert together.runner.prefill_tokens - before == len(longer) - 24
    assert_same_tokens([row], drive(make(loaded, prefix_cache=False)[0], [longer], steps=8))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cancel_mid_prefill_gives_state_slots_and_blocks_back(models, family):
    """Rows 1 (stopped at 24 in the forward with others, its rest due with row 0's) and 4 (not started) are
    cancelled after the first step; the others keep their tokens, and the pool and the state slots end empty."""
    loaded = models[family]
    engine, calls = make(loaded, prefill_batch_size=8)
    got = drive(engine, prompts(), steps=6, close=(1, 4))
    assert calls[0] == "together"
    assert [row["finish"] for row in got] == ["length", "cancelled", "length", "length", "cancelled", "length"]
    assert got[1]["tokens"] == got[4]["tokens"] == []
    want = drive(make(loaded, prefill_batch_size=1)[0], prompts(), steps=6)
    assert_same_tokens([got[i] for i in (0, 2, 3, 5)], [want[i] for i in (0, 2, 3, 5)])
    assert engine.storage.states.in_use == 0 and engine.stats().storage["state_slots_used"] == 0
    assert engine.storage.pool.num_available() == engine.storage.pool.num_blocks
