"""Exact tests for the sampling filters, their order, SamplingParams validation and RowSampler."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.errors import InputError
from mlxcel_core.sampling import (
    RowSampler,
    SamplingParams,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    filtered_logits,
)

INF = float("inf")


def logp(*rows):
    """Logits whose softmax is the given probabilities (one list per row)."""
    return mx.array([[math.log(p) for p in row] for row in rows], dtype=mx.float32)


def np32(a) -> np.ndarray:
    return np.array(a, dtype=np.float32)


def assert_kept(result: mx.array, logits: mx.array, keep):
    """`keep` (bool array) entries are bit-for-bit the input logits, the rest are exactly -inf."""
    keep = np.array(keep, dtype=bool)
    expected = np.where(keep, np32(logits), np.float32(-INF))
    assert result.shape == logits.shape
    np.testing.assert_array_equal(np32(result), expected)


# ---------------------------------------------------------------- temperature


def test_temperature_divides_every_logit():
    logits = mx.array([[2.0, -1.0, 0.5], [-4.0, 8.0, 0.0]])
    np.testing.assert_array_equal(np32(apply_temperature(logits, 0.5)), [[4.0, -2.0, 1.0], [-8.0, 16.0, 0.0]])
    np.testing.assert_array_equal(np32(apply_temperature(logits, 2.0)), [[1.0, -0.5, 0.25], [-2.0, 4.0, 0.0]])


# ---------------------------------------------------------------- top-k


def test_top_k_1d_keeps_k_largest():
    logits = mx.array([3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0])
    assert_kept(apply_top_k(logits, 3), logits, [0, 0, 0, 0, 1, 1, 0, 1])
    assert_kept(apply_top_k(logits, 1), logits, [0, 0, 0, 0, 0, 1, 0, 0])


def test_top_k_batched_rows_differ():
    logits = mx.array([[5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 9.0, -3.0, 8.5, 2.0]])
    assert_kept(apply_top_k(logits, 2), logits, [[1, 1, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 0, 1, 0]])


def test_top_k_ties_at_boundary_kept_by_position():
    logits = mx.array([1.0, 2.0, 2.0, 2.0, 0.0])
    assert_kept(apply_top_k(logits, 2), logits, [0, 1, 1, 0, 0])


@pytest.mark.parametrize("k", [0, 5, 6, 100])
def test_top_k_zero_or_at_least_vocab_is_noop(k):
    logits = mx.array([[0.5, -2.0, 3.0, -INF, 1.0], [1.0, 1.0, 0.0, 2.0, -1.0]])
    np.testing.assert_array_equal(np32(apply_top_k(logits, k)), np32(logits))


# ---------------------------------------------------------------- top-p

TOP_P_PROBS = [0.0625, 0.5, 0.125, 0.0625, 0.25]  # unsorted on purpose: by rank, indices 1, 4, 2, 0|3


def test_top_p_softmax_of_fixture_is_exact():
    # The boundary tests below rely on these probabilities (and their cumulative sums) being exact.
    assert np32(mx.softmax(logp(TOP_P_PROBS), axis=-1)).tolist() == [TOP_P_PROBS]


@pytest.mark.parametrize(
    "p, keep",
    [
        (0.3, [0, 1, 0, 0, 0]),
        (0.5, [0, 1, 0, 0, 0]),  # token 1 alone reaches exactly 0.5: nothing else needed
        (0.51, [0, 1, 0, 0, 1]),
        (0.75, [0, 1, 0, 0, 1]),  # 0.5 + 0.25 reaches exactly 0.75: token 4 kept, token 2 dropped
        (0.76, [0, 1, 1, 0, 1]),
        (0.875, [0, 1, 1, 0, 1]),  # exactly reached by token 2; the 0.0625 pair is dropped
    ],
)
def test_top_p_boundary_keeps_the_token_that_reaches_p(p, keep):
    logits = logp(TOP_P_PROBS)
    assert_kept(apply_top_p(logits, p), logits, [keep])


def test_top_p_batched_rows_differ():
    logits = logp([0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1])
    assert_kept(apply_top_p(logits, 0.6), logits, [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]])


def test_top_p_one_is_noop():
    logits = mx.array([[0.5, -2.0, 3.0, -INF], [1.0, 1.0, 0.0, 2.0]])
    np.testing.assert_array_equal(np32(apply_top_p(logits, 1.0)), np32(logits))


# ---------------------------------------------------------------- min-p


def test_min_p_is_relative_to_top_token():
    # Row 0: top 0.5 -> threshold 0.15 keeps 0.2 (although 0.2 < min_p) and drops 0.05.
    # Row 1: same probabilities shifted by +3 in logit space and reordered -> same decision per token.
    # Row 2: flat row, top 0.3 -> threshold 0.09: nothing dropped (an absolute 0.3 would drop 3 tokens).
    logits = logp([0.5, 0.25, 0.2, 0.05], [0.05, 0.2, 0.25, 0.5], [0.3, 0.25, 0.25, 0.2])
    logits = logits + mx.array([[0.0], [3.0], [0.0]])
    assert_kept(apply_min_p(logits, 0.3), logits, [[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1]])
    # threshold 0.225 with top 0.5 drops 0.2; with top 0.3 (threshold 0.135) still keeps everything
    assert_kept(apply_min_p(logits, 0.45), logits, [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])


def test_min_p_zero_noop_and_one_keeps_only_max():
    logits = logp([0.5, 0.25, 0.2, 0.05], [0.1, 0.2, 0.3, 0.4])
    np.testing.assert_array_equal(np32(apply_min_p(logits, 0.0)), np32(logits))
    assert_kept(apply_min_p(logits, 1.0), logits, [[1, 0, 0, 0], [0, 0, 0, 1]])


# ---------------------------------------------------------------- filtered_logits order


def reverse_order(logits, p: SamplingParams):
    x = apply_min_p(logits.astype(mx.float32), p.min_p)
    x = apply_top_p(x, p.top_p)
    x = apply_top_k(x, p.top_k)
    return apply_temperature(x, p.temperature)


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        # temperature before top-p: at T=0.1 token 0 has ~all the mass, so top-p 0.7 keeps it alone
        # (at T=1 the probabilities are .665/.245/.090 and top-p would keep tokens 0 and 1).
        ([2.0, 1.0, 0.0], SamplingParams(temperature=0.1, top_p=0.7), [20.0, -INF, -INF]),
        # top-k before top-p: after top-2 the probabilities renormalise to .533/.467, so top-p 0.5 keeps
        # token 0 only (over all three tokens, .4/.35/.25, top-p 0.5 would keep tokens 0 and 1).
        (
            [math.log(0.4), math.log(0.35), math.log(0.25)],
            SamplingParams(temperature=1.0, top_k=2, top_p=0.5),
            [math.log(0.4), -INF, -INF],
        ),
        # top-p before min-p: top-p 0.8 over .4/.35/.15/.1 keeps 3 tokens, then min-p 0.3 (threshold .12)
        # drops only the last one (min-p first would renormalise to .444/.389/.167 and top-p would drop .167).
        (
            [math.log(0.4), math.log(0.35), math.log(0.15), math.log(0.1)],
            SamplingParams(temperature=1.0, top_p=0.8, min_p=0.3),
            [math.log(0.4), math.log(0.35), math.log(0.15), -INF],
        ),
    ],
)
def test_filtered_logits_order_matters(logits, params, expected):
    logits = mx.array([logits], dtype=mx.float32)
    got = np32(filtered_logits(logits, params))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(np32([expected])))
    np.testing.assert_allclose(got, np32([expected]), rtol=1e-6)
    # the case discriminates: applying the filters in the reverse order keeps a different set
    assert not np.array_equal(np.isinf(np32(reverse_order(logits, params))), np.isinf(got))


def test_filtered_logits_returns_float32():
    logits = mx.array([[1.0, 2.0, 3.0]], dtype=mx.float16)
    out = filtered_logits(logits, SamplingParams(temperature=2.0))
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np32(out), [[0.5, 1.0, 1.5]])


# ---------------------------------------------------------------- SamplingParams validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.01),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=2.5),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.0001),
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(stop=("",)),
        dict(stop=("ok", "")),
    ],
)
def test_sampling_params_rejects(kwargs):
    with pytest.raises(InputError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_boundaries():
    p = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, max_tokens=1, stop=("x",))
    assert p.greedy
    assert not SamplingParams(temperature=1e-3, top_p=1e-6, min_p=0.0).greedy


# ---------------------------------------------------------------- RowSampler


def draws(sampler, logits, n):
    return [sampler(logits).item() for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = mx.array([[0.1, 3.0, 2.0, -1.0], [5.0, 1.0, 7.0, 6.9]])
    assert RowSampler(SamplingParams())(logits).tolist() == [1, 2]


def test_same_seed_same_sequence_different_seed_different():
    flat = mx.zeros((1, 1000))
    params = dict(temperature=1.0)
    a = draws(RowSampler(SamplingParams(seed=1234, **params)), flat, 50)
    b = draws(RowSampler(SamplingParams(seed=1234, **params)), flat, 50)
    c = draws(RowSampler(SamplingParams(seed=4321, **params)), flat, 50)
    assert a == b
    assert len(set(a)) > 40  # the stream advances: 50 draws over 1000 tokens are mostly distinct
    assert a != c
    assert sum(x == y for x, y in zip(a, c)) < 5  # collisions per position are ~1/1000


def test_frequencies_match_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    sampler = RowSampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount(draws(sampler, logp(probs), n), minlength=4)
    assert counts.sum() == n
    for p, c in zip(probs, counts):
        # Each frequency is Binomial(n, p)/n with sigma = sqrt(p(1-p)/n) (0.0047 for p=.1, 0.0077 for
        # p=.4). A 4.5-sigma band is crossed by a correct sampler with prob ~7e-6 per token, while a
        # temperature or normalisation bug (e.g. ignoring the distribution: 0.25 each) is >= 10 sigma off.
        tol = 4.5 * math.sqrt(p * (1 - p) / n)
        assert abs(c / n - p) < tol, (p, c / n, tol)


def test_top_k_1_with_temperature_always_argmax():
    logits = mx.array([[0.0, 1.0, 0.9, 0.8], [2.0, 1.99, 1.98, -1.0]])
    sampler = RowSampler(SamplingParams(temperature=5.0, top_k=1, seed=7))
    for _ in range(30):
        assert sampler(logits).tolist() == [1, 0]
