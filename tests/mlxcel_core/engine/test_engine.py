"""The engine's fast paths (KV cache + lookahead, batching) give the plain path's tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_core.engine import Engine
from mlxcel_core.errors import InputError
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

# Different lengths, including a 1-token prompt whose row is all padding during the prompt-body pass.
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [64, 128, 11], [200, 31, 9, 8, 7, 6, 5, 4, 3, 2, 1], [9]]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()  # random weights: run every row to its length limit
    return lm


def plain_greedy(model, prompt, steps):
    """Recompute the whole sequence every step: no cache, no batching, no pipelining."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(mx.argmax(model(mx.array([tokens]))[0, -1]).item())
    return tokens[len(prompt) :]


def run(engine: Engine) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
    return out


def test_single_sequence_matches_plain_recompute(loaded):
    engine = Engine(loaded.model, loaded.tokenizer)
    seq = engine.open(PROMPTS[0], SamplingParams(max_tokens=20))
    assert run(engine)[seq] == plain_greedy(loaded.model, PROMPTS[0], 20)
    assert engine.sequence(seq).finish_reason == "length"


def test_batch_rows_match_solo_runs(loaded):
    limits = [12, 5, 9, 6]  # rows finish at different steps and leave the batch
    engine = Engine(loaded.model, loaded.tokenizer)
    ids = [engine.open(p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, limits)]
    batched = run(engine)
    for seq, prompt, n in zip(ids, PROMPTS, limits):
        assert batched[seq] == plain_greedy(loaded.model, prompt, n)


def test_seeded_sampling_row_does_not_depend_on_neighbours(loaded):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    solo = Engine(loaded.model, loaded.tokenizer)
    sid = solo.open(PROMPTS[1], params)
    alone = run(solo)[sid]
    batch = Engine(loaded.model, loaded.tokenizer)
    batch.open(PROMPTS[0], SamplingParams(temperature=0.7, seed=1, max_tokens=10))
    bid = batch.open(PROMPTS[1], params)
    batch.open(PROMPTS[2], SamplingParams(max_tokens=3))
    assert run(batch)[bid] == alone


def test_cancel_ends_one_row_and_the_rest_continue(loaded):
    engine = Engine(loaded.model, loaded.tokenizer)
    keep = engine.open(PROMPTS[0], SamplingParams(max_tokens=8))
    drop = engine.open(PROMPTS[2], SamplingParams(max_tokens=8))
    reasons = {}
    tokens = {keep: [], drop: []}
    steps = 0
    while engine.has_work():
        steps += 1
        if steps == 2:
            engine.close(drop)
        for o in engine.step():
            if o.token is not None:
                tokens[o.seq_id].append(o.token)
            if o.finished:
                reasons[o.seq_id] = o.finish_reason
    assert reasons == {keep: "length", drop: "cancelled"}
    assert tokens[drop] == []
    assert len(tokens[keep]) == 8


def test_eos_stops_and_is_reported(loaded):
    engine = Engine(loaded.model, loaded.tokenizer)
    expected = plain_greedy(loaded.model, PROMPTS[0], 6)
    loaded.tokenizer.eos_token_ids = {expected[3]}
    try:
        seq = engine.open(PROMPTS[0], SamplingParams(max_tokens=20))
        got = run(engine)[seq]
    finally:
        loaded.tokenizer.eos_token_ids = set()
    first_eos = expected.index(expected[3])
    assert got == expected[: first_eos + 1]
    assert engine.sequence(seq).finish_reason == "stop"


def test_prompt_longer_than_context_is_an_input_error(loaded):
    engine = Engine(loaded.model, loaded.tokenizer)
    with pytest.raises(InputError, match="context"):
        engine.open([1] * loaded.model.max_context_length, SamplingParams())
    with pytest.raises(InputError, match="empty"):
        engine.open([], SamplingParams())


def test_generation_stops_at_the_context_limit(loaded):
    engine = Engine(loaded.model, loaded.tokenizer)
    limit = loaded.model.max_context_length
    seq = engine.open([7] * (limit - 3), SamplingParams(max_tokens=100))
    assert len(run(engine)[seq]) == 3
    assert engine.sequence(seq).finish_reason == "length"


def test_auto_storage_and_kv_budget(monkeypatch):
    """auto: paged when batching; at batch 1 paged only where decode steps compile on CUDA (no kv_bits, no
    drafter), else dense. Paged at batch 1 admits the whole context (its pools grow as used)."""
    from mlxcel_core.engine import compiled_decode
    from mlxcel_core.engine.paged import DEFAULT_KV_BUDGET_TOKENS
    from mlxcel_core.engine.types import EngineConfig, SpeculativeConfig

    assert EngineConfig(max_batch_size=4).resolved_storage == "paged"
    monkeypatch.setattr(compiled_decode, "dense_mask_is_slow", lambda: False)  # CPU / Metal
    assert EngineConfig(compile_decode=True).resolved_storage == "dense"
    monkeypatch.setattr(compiled_decode, "dense_mask_is_slow", lambda: True)  # CUDA
    assert EngineConfig(compile_decode=True).resolved_storage == "paged"
    assert EngineConfig(compile_decode=False).resolved_storage == "dense"
    assert EngineConfig(compile_decode=True, kv_bits=8).resolved_storage == "dense"
    assert EngineConfig(compile_decode=True, speculative=SpeculativeConfig(ngram=3)).resolved_storage == "dense"
    assert EngineConfig(compile_decode=True, storage="dense").resolved_storage == "dense"
    assert EngineConfig(compile_decode=True).kv_budget_for(131072) == 131072
    assert EngineConfig(compile_decode=True, kv_budget_tokens=4096).kv_budget_for(131072) == 4096
    assert EngineConfig(max_batch_size=8).kv_budget_for(131072) == DEFAULT_KV_BUDGET_TOKENS
    assert EngineConfig(compile_decode=False).kv_budget_for(131072) is None
