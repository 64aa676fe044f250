"""Shared checks of a family with recurrent layers (a per-sequence state beside or instead of KV caches): the engine
carries the state across prefill chunks, frees it with its row, takes rejected draft tokens back out of it, and
refuses tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
from parity import load_quiet, prompt_ids

from mlxcel_core.errors import UnsupportedModelError


def generate(loaded, prompts, steps=12, close_after=None, **config):
    """Greedy tokens of `prompts` on one engine (`steps`: for all, or one count per prompt); `close_after` (step
    count, seq index): cancel that row then."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    loaded.tokenizer.eos_token_ids = set()
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(**{"compile_decode": False, **config}))
    counts = steps if isinstance(steps, list) else [steps] * len(prompts)
    ids = [engine.open(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, counts)]
    tokens = {i: [] for i in ids}
    step = 0
    while engine.has_work():
        step += 1
        if close_after is not None and step == close_after[0]:
            engine.close(ids[close_after[1]])
        for out in engine.step():
            assert out.error is None, out.error
            if out.token is not None:
                tokens[out.seq_id].append(out.token)
    return engine, [tokens[i] for i in ids]


def assert_state_paths(path: Path, model_type: str) -> None:
    """Dense chunked prefill equals the whole prompt's; a cancelled row and finished rows give their state slots and
    blocks back while the other rows keep their solo tokens; speculative decoding (prompt lookup) gives the plain
    tokens; tensor parallelism is refused, naming the model type."""
    from mlxcel_core.distributed.shard import check_shardable
    from mlxcel_core.engine import SpeculativeConfig

    loaded = load_quiet(path)
    prompt = prompt_ids(37, seed=3)
    _, whole = generate(loaded, [prompt], storage="dense")
    _, chunked = generate(loaded, [prompt], storage="dense", prefill_chunk_size=5)
    assert chunked == whole

    prompts = [prompt_ids(n, seed=n) for n in (11, 5, 20)]
    engine, tokens = generate(
        loaded, prompts, max_batch_size=3, storage="paged", block_size=8, prefill_chunk_size=8, close_after=(6, 1)
    )
    assert engine.storage.states.in_use == 0 and engine.storage.stats()["state_slots_used"] == 0
    assert engine.storage.pool.num_available() == engine.storage.pool.num_blocks
    assert len(tokens[0]) == len(tokens[2]) == 12 and len(tokens[1]) < 12
    assert tokens[2] == generate(loaded, [prompts[2]], storage="dense")[1][0]

    engine, spec = generate(loaded, [prompt], storage="dense", speculative=SpeculativeConfig(ngram=2))
    assert spec == whole and engine.speculator.stats.rounds > 0
    with pytest.raises(UnsupportedModelError, match=f"tensor parallelism does not support {model_type}"):
        check_shardable(loaded.model, 2)
