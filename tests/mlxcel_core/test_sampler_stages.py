"""The full sampler pipeline: each stage on hand-built inputs with exact expected outputs, the order of the
stages, validation of every knob, and a chi-square test of temperature + top-p sampling."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_core.errors import InputError
from mlxcel_core.processors import (
    apply_dry,
    apply_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_suppression,
    dry_penalties,
    dry_sequence_breakers,
)
from mlxcel_core.sampling import (
    RowSampler,
    SamplingParams,
    apply_top_k,
    apply_xtc,
    filtered_logits,
    sample,
)

INF = float("inf")


def logp(*rows):
    return mx.array([[math.log(p) for p in row] for row in rows], dtype=mx.float32)


def np32(a) -> np.ndarray:
    return np.array(a, dtype=np.float32)


# ---------------------------------------------------------------- 1. logit bias, suppression


def test_logit_bias_adds_to_the_listed_tokens_only():
    logits = mx.array([[0.0, 1.0, 2.0, 3.0], [4.0, -1.0, 0.5, 0.0]])
    out = apply_logit_bias(logits, {1: 2.5, 3: -1.0})
    np.testing.assert_array_equal(np32(out), [[0.0, 3.5, 2.0, 2.0], [4.0, 1.5, 0.5, -1.0]])


def test_suppression_sets_minus_infinity():
    logits = mx.array([[0.0, 1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(np32(apply_suppression(logits, [3, 1, 3])), [[0.0, -INF, 2.0, -INF]])
    np.testing.assert_array_equal(np32(apply_suppression(logits, [])), np32(logits))


# ---------------------------------------------------------------- 2. repetition penalty


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = mx.array([[2.0, -2.0, 4.0, 1.0, -1.0]])
    out = apply_repetition_penalty(logits, [0, 1, 1, 4], penalty=2.0, last_n=-1)
    np.testing.assert_array_equal(np32(out), [[1.0, -4.0, 4.0, 1.0, -2.0]])  # each seen token once, not per count


@pytest.mark.parametrize(
    "last_n, expected",
    [
        (2, [2.0, -2.0, 4.0, 0.5, -2.0]),  # the window is the last two tokens: 3 and 4
        (3, [2.0, -4.0, 4.0, 0.5, -2.0]),
        (0, [2.0, -2.0, 4.0, 1.0, -1.0]),  # 0: no token is looked at
        (-1, [1.0, -4.0, 4.0, 0.5, -2.0]),  # -1: every token
        (99, [1.0, -4.0, 4.0, 0.5, -2.0]),
    ],
)
def test_repetition_penalty_window(last_n, expected):
    logits = mx.array([[2.0, -2.0, 4.0, 1.0, -1.0]])
    np.testing.assert_array_equal(np32(apply_repetition_penalty(logits, [0, 1, 3, 4], 2.0, last_n)), [expected])


# ---------------------------------------------------------------- 3. presence / frequency


def test_presence_and_frequency_penalties_count_occurrences():
    logits = mx.zeros((1, 4))
    out = apply_presence_frequency(logits, [1, 1, 1, 2], presence=0.5, frequency=0.25)
    np.testing.assert_array_equal(np32(out), [[0.0, -1.25, -0.75, 0.0]])
    np.testing.assert_array_equal(np32(apply_presence_frequency(logits, [], 1.0, 1.0)), [[0.0] * 4])


def test_row_sampler_counts_presence_over_generated_tokens_only():
    sampler = RowSampler(SamplingParams(presence_penalty=1.0), prompt_len=2)
    out = sampler.process(mx.zeros((1, 4)), [0, 1, 1, 3])  # prompt [0, 1], generated [1, 3]
    np.testing.assert_array_equal(np32(out), [[0.0, -1.0, 0.0, -1.0]])


# ---------------------------------------------------------------- 4. DRY

A, B, C, Y = 10, 11, 12, 13


def test_dry_llama_cpp_example():
    # llama.cpp's own example: context "a b c c b c y a b c". The last three tokens "a b c" also occur at
    # the start, followed by c (repeat length 3); "b c" occurs followed by y (2); "c" followed by b (1).
    context = [A, B, C, C, B, C, Y, A, B, C]
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {}) == {C: 2.0, Y: 1.0}  # 1 * 2 ** (3 - 2), 1 * 2 ** 0
    assert dry_penalties(context, 0.5, 3.0, 1, -1, {}) == {C: 4.5, Y: 1.5, B: 0.5}
    assert dry_penalties(context, 1.0, 2.0, 4, -1, {}) == {}  # nothing repeats for longer than 3


def test_dry_penalty_last_n_limits_the_scan():
    context = [A, B, C, C, B, C, Y, A, B, C]
    assert dry_penalties(context, 1.0, 2.0, 2, 7, {}) == {Y: 1.0}  # "a b c" at the start is out of the window
    assert dry_penalties(context, 1.0, 2.0, 2, 0, {}) == {}
    assert dry_penalties(context, 0.0, 2.0, 2, -1, {}) == {}  # multiplier 0: off


def test_dry_sequence_breaker_limits_the_repeat_length():
    context = [A, B, C, Y, A, B, C]
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {}) == {Y: 2.0}  # "a b c" repeats, then y
    # y's first occurrence is not what limits the repeat: the most recent breaker (a, 3 tokens from the end) does
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {A: [()]}) == {Y: 1.0}  # only "b c" counts
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {B: [()]}) == {}  # only "c": shorter than allowed
    # a multi-token breaker "a b": only complete occurrences limit the repeat
    assert dry_penalties(context, 1.0, 2.0, 1, -1, {A: [(B,)]}) == {Y: 1.0}
    assert dry_penalties(context, 1.0, 2.0, 1, -1, {A: [(C,)]}) == {Y: 4.0}


def test_dry_never_penalizes_a_single_token_breaker():
    context = [A, B, Y, A, B]
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {}) == {Y: 1.0}
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {Y: [()]}) == {}
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {Y: [(C,)]}) == {Y: 1.0}  # head of a longer breaker: penalized
    assert dry_penalties(context, 1.0, 2.0, 2, -1, {Y: [(A,)]}) == {}  # "y a" occurred: only "b" is left after it


def test_dry_exponent_is_clamped_so_the_penalty_stays_finite():
    context = [A] * 300
    penalty = dry_penalties(context, 1.0, 2.0, 2, -1, {})[A]
    assert penalty == 2.0 ** int(88.7228391 / math.log(2.0))
    assert math.isfinite(penalty)


def test_apply_dry_subtracts_from_logits():
    logits = mx.zeros((1, 16))
    out = np32(apply_dry(logits, [A, B, C, C, B, C, Y, A, B, C], 1.0, 2.0, 2, -1, {}))
    expected = np.zeros((1, 16), np.float32)
    expected[0, C], expected[0, Y] = -2.0, -1.0
    np.testing.assert_array_equal(out, expected)


def test_dry_sequence_breakers_tokenized_like_llama_cpp():
    vocab = ["a", "b", "c", "xa", "ab", "abc!", "\n", "q\nr", "zz"]
    encode = lambda text: [vocab.index(ch) for ch in text]  # one token per character
    heads = dry_sequence_breakers(vocab, encode, ["abc", "\n"])
    assert heads == {
        0: [(1, 2)],  # "a" ends with "a": "bc" must follow
        3: [(1, 2)],  # "xa" too
        4: [(2,)],  # "ab": then "c"
        5: [()],  # "abc!" contains the whole breaker
        6: [()],  # "\n"
        7: [()],  # "q\nr"
    }


# ---------------------------------------------------------------- 9. XTC


@pytest.mark.parametrize(
    "threshold, keep",
    [
        (0.25, [0, 1, 1, 1]),  # 0.4 and 0.3 qualify: the top one goes, the least likely (0.3) stays
        (0.15, [0, 0, 1, 1]),  # 0.4, 0.3, 0.2 qualify: keep only 0.2
        (0.35, [1, 1, 1, 1]),  # one token qualifies: nothing happens
        (0.5, [1, 1, 1, 1]),
        (0.0, [0, 0, 0, 1]),  # everything qualifies: only the least likely is left
    ],
)
def test_xtc_drops_top_choices_but_the_least_likely(threshold, keep):
    logits = logp([0.4, 0.3, 0.2, 0.1])
    expected = np.where(np.array(keep, bool), np32(logits)[0], -INF)
    np.testing.assert_array_equal(np32(apply_xtc(logits, threshold, 1.0)), [expected])


def test_xtc_probability_zero_is_noop_and_probability_is_a_per_row_coin():
    logits = mx.broadcast_to(logp([0.4, 0.3, 0.2, 0.1]), (4000, 4))
    np.testing.assert_array_equal(np32(apply_xtc(logits, 0.25, 0.0, mx.random.key(0))), np32(logits))
    out = np32(apply_xtc(logits, 0.25, 0.3, mx.random.key(0)))
    applied = np.isinf(out[:, 0])
    assert set(np.isinf(out[:, 1:]).ravel()) == {False}
    # Binomial(4000, 0.3): sigma = 29 -> 6 sigma band
    assert abs(applied.sum() - 1200) < 6 * math.sqrt(4000 * 0.3 * 0.7)
    np.testing.assert_array_equal(np32(apply_xtc(logits, 0.25, 0.3, mx.random.key(0))), out)  # seeded


def test_greedy_skips_xtc():
    logits = logp([0.4, 0.3, 0.2, 0.1])
    assert RowSampler(SamplingParams(xtc_threshold=0.1, xtc_probability=1.0))(logits).item() == 0


def test_xtc_with_sampling_never_draws_the_top_choice():
    sampler = RowSampler(SamplingParams(temperature=1.0, xtc_threshold=0.25, xtc_probability=1.0, seed=0))
    draws = {sampler(logp([0.4, 0.3, 0.2, 0.1])).item() for _ in range(60)}
    assert 0 not in draws and 1 in draws


# ---------------------------------------------------------------- the order of the stages


def test_bias_comes_before_the_repetition_penalty():
    # token 0: logit 1, bias -2 -> -1, then the penalty multiplies the negative logit: -2.
    # (penalty first: 1 / 2 = 0.5, then the bias: -1.5)
    sampler = RowSampler(SamplingParams(logit_bias={0: -2.0}, repetition_penalty=2.0))
    np.testing.assert_array_equal(np32(sampler.process(mx.array([[1.0, 0.0]]), [0])), [[-2.0, 0.0]])


def test_repetition_comes_before_presence():
    # 2 / 2 - 1 = 0 (presence first: (2 - 1) / 2 = 0.5)
    sampler = RowSampler(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), prompt_len=0)
    np.testing.assert_array_equal(np32(sampler.process(mx.array([[2.0, 0.0]]), [0])), [[0.0, 0.0]])


def test_suppression_wins_over_any_bias():
    sampler = RowSampler(SamplingParams(logit_bias={1: 100.0}, suppress_tokens=(1,)))
    assert sampler(mx.array([[0.0, 1.0, 0.5]]), []).item() == 2


def test_custom_processors_run_first():
    seen = []
    double = lambda tokens, logits: (seen.append(np32(logits).tolist()), logits * 2)[1]
    sampler = RowSampler(SamplingParams(logits_processors=(double,), logit_bias={0: 1.0}))
    np.testing.assert_array_equal(np32(sampler.process(mx.array([[1.0, 3.0]]), [])), [[3.0, 6.0]])
    assert seen == [[[1.0, 3.0]]]  # saw the model's logits, before the bias


def test_min_p_comes_before_xtc():
    # top-k 2 keeps 0.5 and 0.2 (-> 0.714 / 0.286): both reach XTC's 0.25, so the top one is dropped.
    # (XTC first: only 0.5 reaches 0.25, nothing is dropped, and top-k keeps tokens 0 and 1)
    logits = logp([0.5, 0.2, 0.2, 0.1])
    params = SamplingParams(temperature=1.0, top_k=2, xtc_threshold=0.25, xtc_probability=1.0)
    out = np32(filtered_logits(logits, params, xtc_key=mx.random.key(0)))
    assert np.isinf(out).tolist() == [[True, False, True, True]]
    reverse = np32(apply_top_k(apply_xtc(logits, 0.25, 1.0), 2))
    assert np.isinf(reverse).tolist() == [[False, False, True, True]]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(repetition_penalty=0.0), "repeat-penalty"),
        (dict(repetition_penalty=-1.0), "repeat-penalty"),
        (dict(repetition_penalty=float("inf")), "repeat-penalty"),
        (dict(repeat_last_n=-2), "repeat-last-n"),
        (dict(presence_penalty=2.5), "presence-penalty"),
        (dict(frequency_penalty=-3.0), "frequency-penalty"),
        (dict(dry_multiplier=-0.1), "dry-multiplier"),
        (dict(dry_multiplier=float("nan")), "dry-multiplier"),
        (dict(dry_base=0.9), "dry-base"),
        (dict(dry_allowed_length=0), "dry-allowed-length"),
        (dict(dry_allowed_length=1.5), "dry-allowed-length"),
        (dict(dry_penalty_last_n=-2), "dry-penalty-last-n"),
        (dict(dry_sequence_breakers=("",)), "dry-sequence-breakers"),
        (dict(xtc_threshold=1.5), "xtc-threshold"),
        (dict(xtc_probability=-0.5), "xtc-probability"),
        (dict(xtc_probability=1.01), "xtc-probability"),
        (dict(suppress_tokens=(-1,)), "suppress-tokens"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
    ],
)
def test_out_of_range_knobs_are_rejected_by_name(kwargs, name):
    with pytest.raises(InputError, match=name):
        SamplingParams(**kwargs)


def test_boundaries_are_accepted():
    SamplingParams(
        repetition_penalty=1e-3,
        repeat_last_n=-1,
        presence_penalty=-2,
        frequency_penalty=2,
        dry_multiplier=0.0,
        dry_base=1.0,
        dry_allowed_length=1,
        dry_penalty_last_n=-1,
        dry_sequence_breakers=(),
        xtc_threshold=0.0,
        xtc_probability=1.0,
        logit_bias={"3": -100},
    )


# ---------------------------------------------------------------- chi-square: temperature + top-p

# Upper 1e-4 quantiles of the chi-square distribution (standard tables; Wilson-Hilferty with z = 3.719 gives
# the same to within 3%): a correct sampler exceeds them with probability 1e-4 for any seed.
CHI2_CRITICAL_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856}


def nucleus(probs, temperature, top_p):
    """The reference distribution: tempered softmax, smallest top set reaching top_p, renormalized."""
    tempered = np.exp(np.log(probs) / temperature)
    tempered /= tempered.sum()
    order = np.argsort(-tempered, kind="stable")
    keep = np.zeros(len(probs), bool)
    mass = 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i] = True
        mass += tempered[i]
    target = np.where(keep, tempered, 0.0)
    return target / target.sum()


def chi_square(counts, expected_probs):
    kept = expected_probs > 0
    expected = expected_probs[kept] * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


def test_temperature_and_top_p_sampling_match_the_target_distribution():
    probs = np.array([0.05, 0.35, 0.02, 0.25, 0.15, 0.1, 0.08])
    temperature, top_p, n = 0.7, 0.9, 20_000
    target = nucleus(probs, temperature, top_p)
    assert (target > 0).sum() == 4  # the test exercises the nucleus: three tokens are cut
    params = SamplingParams(temperature=temperature, top_p=top_p)
    rows = mx.broadcast_to(mx.array(np.log(probs)[None], mx.float32), (n, len(probs)))
    draws = np.array(sample(rows, params, mx.random.key(2024)))
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[target == 0].sum() == 0  # tokens outside the nucleus are never drawn
    statistic, dof = chi_square(counts, target)
    assert statistic < CHI2_CRITICAL_1E4[dof], (statistic, counts)
    # the test has power: against the untempered nucleus the same draws are far off
    wrong = nucleus(probs, 1.0, top_p)
    wrong_stat, wrong_dof = chi_square(counts[wrong > 0], wrong[wrong > 0])
    assert wrong_stat > 10 * CHI2_CRITICAL_1E4[wrong_dof]


def test_row_sampler_draw_many_equals_successive_draws():
    logits = mx.broadcast_to(logp([0.3, 0.3, 0.2, 0.2]), (6, 4))
    params = SamplingParams(temperature=1.0, seed=5, xtc_probability=0.5, xtc_threshold=0.25)
    one = RowSampler(params)
    singles = [one.draw(logits[i : i + 1]).item() for i in range(6)]
    many = RowSampler(params)
    tokens, keys = many.draw_many(logits)
    assert np.array(tokens).tolist() == singles
    many.advance(keys, 4)  # keep 4 draws: the stream continues from the 5th
    partial = RowSampler(params)
    for i in range(4):
        partial.draw(logits[i : i + 1])
    assert [many.draw(logits[:1]).item() for _ in range(5)] == [partial.draw(logits[:1]).item() for _ in range(5)]
