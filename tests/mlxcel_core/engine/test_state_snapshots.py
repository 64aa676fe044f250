"""The prefix cache of models with recurrent layers (engine/state_snapshots.py): a chat's second turn and a shared
system prompt start from a kept state and compute only what follows it, with the tokens and log-probabilities of an
engine without a prefix cache; snapshots are bounded, go with their blocks, and a half-written state is never kept."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from parity import load_quiet, prompt_ids
from recurrent_tiny import FAMILIES, save_tiny_recurrent

from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.state_pool import StatePool
from mlxcel_core.engine.state_snapshots import StateSnapshots
from mlxcel_core.kv.block_pool import BlockPool
from mlxcel_core.sampling import SamplingParams

BS = 8
CONFIG = dict(max_batch_size=2, storage="paged", block_size=BS, prefill_chunk_size=64, compile_decode=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    loaded = {}
    for family in FAMILIES:
        loaded[family] = load_quiet(save_tiny_recurrent(root / family, family))
        loaded[family].tokenizer.eos_token_ids = set()  # every request runs to max_tokens
    return loaded


def engine(loaded, **config) -> Engine:
    return Engine(loaded.model, loaded.tokenizer, EngineConfig(**{**CONFIG, **config}))


def run(engine: Engine, prompt: list[int], steps: int = 10) -> dict:
    """One greedy request alone: its tokens, top-3 log-probabilities per token, cached and computed prompt tokens."""
    seq_id = engine.open(prompt, SamplingParams(max_tokens=steps, logprobs=3))
    before = engine.runner.prefill_tokens
    tokens, logprobs = [], []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.token is not None:
                tokens.append(out.token)
                logprobs.append([lp for _, lp in out.top_logprobs])
    computed = engine.runner.prefill_tokens - before
    return dict(
        tokens=tokens, logprobs=np.array(logprobs), cached=engine.sequence(seq_id).cached_tokens, computed=computed
    )


def assert_same_output(got: dict, cold: dict) -> None:
    """Greedy tokens equal, and log-probabilities too (a wrong state can keep a random model's argmax)."""
    assert got["tokens"] == cold["tokens"]
    np.testing.assert_allclose(got["logprobs"], cold["logprobs"], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_second_turn_computes_only_new_tokens(models, family):
    warm, cold = engine(models[family]), engine(models[family], prefix_cache=False)
    first_prompt = prompt_ids(30, seed=1)
    first = run(warm, first_prompt, steps=13)
    assert (first["cached"], first["computed"]) == (0, 30)
    second_prompt = first_prompt + first["tokens"] + prompt_ids(7, seed=2)
    second = run(warm, second_prompt)
    # The state at the newest boundary of turn 1 (42 tokens were computed: 40); Nemotron-H's decode steps compute
    # other maths than a prompt (dt unclamped), so it keeps prompts only: the first prompt's last boundary, 24.
    cached = 24 if family == "nemotron_h" else 40
    assert (second["cached"], second["computed"]) == (cached, len(second_prompt) - cached)
    assert warm.stats().storage["prefix_hits"] == 1
    assert_same_output(second, run(cold, second_prompt))


def test_a_shared_system_prompt_is_kept_where_requests_diverge(models):
    """The first request keeps its prompt's last boundary; the second, diverging after the shared 20 tokens, computes
    them and keeps the state at their last boundary (16); the third starts there."""
    warm, cold = engine(models["lfm2"]), engine(models["lfm2"], prefix_cache=False)
    system = prompt_ids(20, seed=5)
    results = [run(warm, system + prompt_ids(12, seed=seed), steps=4) for seed in (6, 7, 8)]
    assert [r["cached"] for r in results] == [0, 0, 16]
    assert results[2]["computed"] == 32 - 16
    assert_same_output(results[2], run(cold, system + prompt_ids(12, seed=8), steps=4))


def test_snapshots_are_bounded_and_go_with_their_blocks(models):
    loaded = models["qwen3_5"]
    bounded = engine(loaded, max_batch_size=1)
    assert bounded.storage.snapshots.most == 4
    for seed in range(6):
        run(bounded, prompt_ids(30, seed=seed), steps=12)
        assert bounded.stats().storage["state_snapshots"] <= 4
    bounded.forget_cached_prefixes()
    assert (bounded.stats().storage["state_snapshots"], bounded.stats().storage["state_snapshot_bytes"]) == (0, 0)

    # A budget of a few requests' blocks: the oldest prompts' blocks are evicted, and their snapshots with them.
    small = engine(loaded, kv_budget_tokens=200)
    prompts = [prompt_ids(40, seed=seed) for seed in range(7)]  # 5 blocks cached each, 35 in a pool of 28
    for prompt in prompts:
        run(small, prompt, steps=8)
    assert small.stats().storage["evictions"] > 0
    again = run(small, prompts[0], steps=8)
    assert again["cached"] == 0
    assert_same_output(again, run(engine(loaded, prefix_cache=False), prompts[0], steps=8))
    assert run(small, prompts[0], steps=8)["cached"] == 32  # kept again

    # Snapshots count in the budget: as a long request takes blocks, the kept ones give way.
    snapshots = small.storage.snapshots
    assert snapshots.count >= 2
    small.open(prompt_ids(120, seed=9), SamplingParams(max_tokens=40))
    least = snapshots.count
    while small.has_work():
        small.step()
        assert snapshots.count == 0 or snapshots.used() + snapshots.count * snapshots.tokens <= 200
        least = min(least, snapshots.count)
    assert least < 2


def test_a_state_some_layer_did_not_write_is_not_kept():
    """A forward that raised after some recurrent layers wrote their state leaves the others' arrays as they were."""
    states = StatePool([True, False, True], slots=2)
    snapshots = StateSnapshots(states, BlockPool(8, block_size=4), most=4)
    state = [mx.ones((1, 3))]
    states.write(0, mx.array([states.slot(7)]), state)
    states.write(2, mx.array([states.slot(7)]), state)
    snapshots.expect(7, 4)
    states.write(0, mx.array([states.slot(7)]), state)  # layer 2 never wrote
    snapshots.capture()
    assert snapshots.count == 0
    snapshots.expect(7, 4)
    for layer in (0, 2):
        states.write(layer, mx.array([states.slot(7)]), state)
    snapshots.capture()
    assert snapshots.count == 1 and snapshots.nbytes == 2 * 3 * 4


def test_a_state_a_kernel_updated_in_place_is_kept():
    """A decode step whose kernels updated the rows' state in the pool's own arrays (StateView.in_place: the arrays
    stay the same objects) replaced the state as a write does; a compiled step's returned arrays too."""
    written = []
    states = StatePool([True, False, True], slots=2, wrote_in_place=written.append)
    snapshots = StateSnapshots(states, BlockPool(8, block_size=4), most=4)
    for layer in (0, 2):
        states.write(layer, mx.array([states.slot(7)]), [mx.ones((1, 3))])
    views = states.views([None] * 3, [7], fresh=False)
    before = [states.arrays[layer] for layer in (0, 2)]
    snapshots.expect(7, 4)
    for layer in (0, 2):
        parts, slots = views[layer].in_place()
        assert parts is states.arrays[layer] and slots.tolist() == [states.slot_of[7]]
        views[layer].wrote_in_place(mx.zeros((1,)))
    assert [states.arrays[layer] for layer in (0, 2)] == before and len(written) == 2
    snapshots.capture()
    assert snapshots.count == 1
    snapshots.expect(7, 8)
    states.replaced()
    snapshots.capture()
    assert snapshots.count == 1 and 8 in snapshots._taken[7]  # the newer decode boundary replaced the older
    assert states.views([None] * 3, [7], fresh=True)[0].in_place() is None  # a sequence's first tokens: no state
