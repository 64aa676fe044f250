"""backends/cpu_rope.py: on the CPU, rotary embeddings take their cosines and sines from a table shared across layers,
with mx.fast.rope's bits for every variant it takes (dtypes, partial rotation, scales, explicit frequencies, yarn's
factor, LongRoPE on both sides of its threshold), mx.fast.rope itself for the rest, the same greedy tokens, equal
frequencies made one array, and a bounded table."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_core.backends import cpu_rope
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.models.rope import LongRoPE, RoPE, initialize_rope

pytestmark = pytest.mark.skipif(not cpu_rope.applies(), reason="on the CPU only")

LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + i / 32 for i in range(16)],
    "long_factor": [2.0 + i / 16 for i in range(16)],
    "original_max_position_embeddings": 64,
    "factor": 4.0,
}


def _pair(make):
    """(a module as built, the same module swapped)"""
    plain, swapped = make(), make()
    swapped.__class__ = cpu_rope.SWAPS[type(swapped)]
    return plain, swapped


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: RoPE(64, 10000.0),
        lambda: RoPE(32, 500000.0, scale=0.25),  # (partial: 32 of 64 dims rotated)
        lambda: initialize_rope(64, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
        lambda: initialize_rope(64, 10000.0, False, {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
        lambda: LongRoPE(32, 10000.0, False, LONGROPE),
    ],
    ids=["default", "partial-scaled", "llama3", "yarn", "longrope"],
)  # fmt: skip
@pytest.mark.parametrize("length,offset", [(1, 0), (1, 37), (5, 62), (1, 900), (9, 0)])
def test_the_table_gives_mx_fast_ropes_bits(dtype, make, length, offset):
    plain, swapped = _pair(make)
    x = mx.random.normal((2, 3, length, 64), key=mx.random.key(offset)).astype(dtype)
    assert mx.array_equal(swapped(x, offset), plain(x, offset)).item()
    assert mx.array_equal(swapped(x[0], offset), plain(x[0], offset)).item()  # (three dimensions)


@pytest.mark.parametrize("offset", [mx.array(5), mx.array([3, 70])])
def test_offset_arrays_and_traditional_rotation_keep_mx_fast_rope(offset):
    x = mx.random.normal((2, 3, 1, 64), key=mx.random.key(1))
    plain, swapped = _pair(lambda: RoPE(64, 10000.0))
    before = list(cpu_rope._table)
    assert mx.array_equal(swapped(x, offset), plain(x, offset)).item()
    assert list(cpu_rope._table) == before  # (not from the table)
    plain, swapped = _pair(lambda: RoPE(64, 10000.0, traditional=True))
    assert mx.array_equal(swapped(x, 4), plain(x, 4)).item()
    assert list(cpu_rope._table) == before


def test_the_table_stays_bounded_and_a_steps_layers_share_an_entry():
    rope = cpu_rope.SharedAnglesRoPE(64, 10000.0)
    x = mx.random.normal((1, 2, 1, 64), key=mx.random.key(2))
    for offset in range(3 * cpu_rope.TABLE_ENTRIES):
        rope(x, offset)
    assert len(cpu_rope._table) == cpu_rope.TABLE_ENTRIES
    other = cpu_rope.SharedAnglesRoPE(64, 10000.0)  # (another layer, the same step)
    before = dict(cpu_rope._table)
    other(x, 3 * cpu_rope.TABLE_ENTRIES - 1)
    assert dict(cpu_rope._table) == before


def test_prepare_swaps_and_shares_equal_frequencies_and_unprepare_restores():
    model, config = build_random_model("tiny", dtype="float32", seed=3)
    ropes = [m for _, m in model.named_modules() if isinstance(m, RoPE)]
    assert ropes and all(type(m) is cpu_rope.SharedAnglesRoPE for m in ropes)  # (prepare_model took the swap)
    assert cpu_rope.unprepare(model) == len(ropes) and all(type(m) is RoPE for m in ropes)
    for m in ropes:
        m._periods = 1.0 / (10000.0 ** (mx.arange(0, m.dims, 2, dtype=mx.float32) / m.dims))  # (an array each)
    assert len({id(m._periods) for m in ropes}) == len(ropes)
    assert cpu_rope.prepare(model) == len(ropes)
    assert len({id(m._periods) for m in ropes}) == 1


def test_greedy_tokens_are_mx_fast_ropes():
    from test_cpu_float32_layers import PROMPTS, _greedy

    model, config = build_random_model("tiny", dtype="float32", seed=5)
    swapped = _greedy(model, config, PROMPTS)
    assert cpu_rope.unprepare(model) > 0
    assert _greedy(model, config, PROMPTS) == swapped
