"""Every sampler stage through the engine: a row's tokens depend on its own seed and params only, never on
its batch neighbours (dense and paged), and bad token ids are refused when the sequence is opened."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.errors import InputError
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(11)
PROMPTS = [rng.integers(3, 300, size=n).tolist() for n in (7, 19, 3, 30)]
PARAMS = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, xtc_threshold=0.02, xtc_probability=0.5, max_tokens=14),
    SamplingParams(
        temperature=0.8,
        top_k=20,
        seed=12,
        repetition_penalty=1.3,
        repeat_last_n=16,
        dry_multiplier=0.8,
        dry_allowed_length=1,
        max_tokens=12,
    ),
    SamplingParams(
        presence_penalty=1.5, frequency_penalty=0.5, logit_bias={5: 3.0}, suppress_tokens=(7,), max_tokens=10
    ),
    SamplingParams(temperature=1.2, min_p=0.05, seed=13, max_tokens=16),
]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def run(engine: Engine, rows: list[int], arrivals: list[int]) -> dict[int, list[int]]:
    ids, out, step = {}, {}, 0
    while len(ids) < len(rows) or engine.has_work():
        for row, at in zip(rows, arrivals):
            if at == step and row not in ids:
                ids[row] = engine.open(PROMPTS[row], PARAMS[row])
        for o in engine.step():
            assert o.error is None, o.error
            if o.token is not None:
                out.setdefault(o.seq_id, []).append(o.token)
        step += 1
    return {row: out[s] for row, s in ids.items()}


@pytest.fixture(scope="module")
def alone(loaded):
    return {row: run(Engine(loaded.model, loaded.tokenizer), [row], [0])[row] for row in range(len(PROMPTS))}


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("rows, arrivals", [([0, 1, 2, 3], [0, 0, 2, 5]), ([3, 0], [0, 1]), ([1, 2], [0, 0])])
def test_a_row_does_not_depend_on_its_neighbours(loaded, alone, storage, rows, arrivals):
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=4, storage=storage, block_size=8))
    got = run(engine, rows, arrivals)
    assert got == {row: alone[row] for row in rows}


def test_knobs_change_the_output(loaded, alone):
    """The stages are really applied: the same seed without them gives other tokens."""
    plain = SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=12)
    engine = Engine(loaded.model, loaded.tokenizer)
    seq = engine.open(PROMPTS[1], plain)
    while engine.has_work():
        engine.step()
    assert engine.sequence(seq).output_ids != alone[1]
    assert 7 not in alone[2]  # suppressed


@pytest.mark.parametrize(
    "params", [SamplingParams(logit_bias={100000: 1.0}), SamplingParams(suppress_tokens=(5, 99999))]
)
def test_token_ids_outside_the_vocabulary_are_refused(loaded, params):
    with pytest.raises(InputError, match="outside the vocabulary"):
        Engine(loaded.model, loaded.tokenizer).open([1, 2, 3], params)
