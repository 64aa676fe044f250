"""Paged KV pools grow before a compiled decode step, never inside it.

mx.compile traces a step once per input shapes, with the storage's `pool_rows` (a Python int) fixed in the trace.
Twelve rows prefilled together fill 120 of the pools' 128 blocks; their decode steps at positions 36-39 trace a step
over 128-block pools that needs no growth; at position 40 every row takes a new block (132 > 128) with the same input
shapes, so that trace would run again and index blocks past the pools' end (on CPU a corrupted heap, on CUDA reads of
other memory). Checked before every compiled step: the pools cover every block handed out; and the tokens are the
op-by-op engine's.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_core.bench_model import RandomIdTokenizer
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.engine.compiled_decode import CompiledDecoder
from mlxcel_core.engine.paged_views import DecodeView
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams

ROWS, PROMPT, BLOCK = 12, 36, 4


@pytest.fixture(scope="module")
def tiny():
    model, config = build_random_model("tiny", dtype="float32", seed=1)
    return model, RandomIdTokenizer(config["vocab_size"])


def run(tiny, compile_decode: bool) -> dict[int, list[int]]:
    model, tokenizer = tiny
    rng = np.random.default_rng(0)
    config = EngineConfig(
        max_batch_size=ROWS,
        storage="paged",
        block_size=BLOCK,
        compile_decode=compile_decode,
        prefill_chunk_size=2048,
        prefill_batch_size=ROWS,
    )
    engine = Engine(model, tokenizer, config)
    ids = {
        engine.open(rng.integers(3, 300, size=PROMPT).tolist(), SamplingParams(max_tokens=40)): i for i in range(ROWS)
    }
    tokens: dict[int, list[int]] = {i: [] for i in ids.values()}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.token is not None:
                tokens[ids[out.seq_id]].append(out.token)
    return tokens


def test_compiled_steps_get_pools_that_cover_their_blocks(tiny, monkeypatch):
    expected = run(tiny, compile_decode=False)
    steps, decode = [], CompiledDecoder.decode

    def checked(self, tokens, caches):
        storage = next(c for c in caches if isinstance(c, DecodeView)).storage
        rows = {pools[0].shape[0] for pools in storage.pools if pools is not None}
        assert min(rows) >= storage.pool.high_water, f"pools of {rows} blocks, block {storage.pool.high_water - 1} used"
        steps.append(storage.pool.high_water)
        return decode(self, tokens, caches)

    monkeypatch.setattr(CompiledDecoder, "decode", checked)
    assert run(tiny, compile_decode=True) == expected
    assert 120 in steps and max(steps) > 128  # compiled steps before and after the pools grew past 128 blocks
