"""KV pool slots no row owns must not reach any output: pools filled with NaN before use give the same tokens.

A block's tail past its row's length and a padded block table's entries point at slots an earlier sequence wrote
(or, on a backend whose allocations are not zeroed, never written): attention gives them weight 0, and 0 * NaN is
NaN, so a NaN there would end an unrelated request with "NaN logits". The engine runs batched with prefix-cache hits,
prompts prefilled in chunks beside decoding rows and several splits, once on zeroed pools and once on pools whose
every fresh slot is NaN.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_drive import drive
from nan_pools import use_nan_pools
from tiny_models import save_tiny_llama

from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.kv.paged_attention import paged_decode_attention
from mlxcel_core.loading import load_model
from mlxcel_core.sampling import SamplingParams

rng = np.random.default_rng(11)
SHARED = rng.integers(3, 300, size=20).tolist()  # two full blocks of 8 and a partial one: prefix-cache hits
PROMPTS = [SHARED + rng.integers(3, 300, size=n).tolist() for n in (5, 17, 1, 40, 9, 33, 2, 64)]
ARRIVALS = [0, 0, 1, 3, 4, 4, 9, 12]
MAX_TOKENS = [12, 7, 10, 5, 16, 9, 11, 8]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # head_dim 32 so that quantized KV (group 32) applies too
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-stale"), num_attention_heads=2, num_key_value_heads=1)
    lm = load_model(str(path), log=lambda m: None)
    lm.tokenizer.eos_token_ids = set()
    return lm


def run(loaded, **config) -> dict[int, list[int]]:
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(max_batch_size=8, storage="paged", block_size=8, prefill_chunk_size=8, **config),
    )
    return drive(engine, PROMPTS, ARRIVALS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])


@pytest.mark.parametrize(
    "config", [{}, {"num_splits": 3}, {"kv_bits": 8}], ids=["one-split", "three-splits", "kv-8-bit"]
)
def test_nan_in_unowned_slots_changes_nothing(loaded, monkeypatch, config):
    expected = run(loaded, **config)
    use_nan_pools(monkeypatch)
    assert run(loaded, **config) == expected


def test_decode_attention_ignores_nan_past_each_rows_length():
    """The portable paged decode attention: rows of 3 and 10 tokens over blocks of 4, a padded table entry, NaN in
    every slot past each row's length."""
    B, Hq, Hkv, D, bs = 2, 4, 2, 8, 4
    k_pool = mx.random.normal((6, bs, Hkv, D), key=mx.random.key(0))
    v_pool = mx.random.normal((6, bs, Hkv, D), key=mx.random.key(1))
    tables = mx.array([[1, 0, 0], [2, 3, 4]])  # row 0: one block, padded with block 0
    lens = mx.array([3, 10])
    q = mx.random.normal((B, Hq, D), key=mx.random.key(2))
    expected = paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=2)
    stale = np.array(v_pool)
    stale[0] = np.nan  # the padding entry's block
    stale[1, 3:] = np.nan  # row 0's tail
    stale[4, 2:] = np.nan  # row 1's tail
    got = paged_decode_attention(q, mx.array(np.where(np.isnan(stale), np.nan, k_pool)), mx.array(stale), tables,
                                 lens, num_splits=2)  # fmt: skip
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, expected, atol=1e-6).item()
