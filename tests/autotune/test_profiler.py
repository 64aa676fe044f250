"""The profiler with an injected fake clock and fake ops: adaptive reps, median/MAD, the guard, ties, drops."""

from __future__ import annotations

import itertools

import pytest

from autotune.profiler import Candidate, Measurement, ProfileSettings, choose_reps, median_and_spread, profile, select


class FakeClock:
    """Time only moves when a fake op runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeOp:
    """Costs `costs` seconds per run, cycling (noise patterns); returns `output`; records each call."""

    def __init__(self, clock, label, costs, output="ok", log=None, fail_at=None):
        self.clock, self.label, self.output, self.log = clock, label, output, log
        self.costs = itertools.cycle(costs if isinstance(costs, (list, tuple)) else [costs])
        self.calls, self.fail_at = 0, fail_at

    def __call__(self):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("launch failed: too many resources requested\nsecond line")
        self.clock.now += next(self.costs)
        if self.log is not None:
            self.log.append(self.label)
        return self.output


def same_output(out, ref):
    return None if out == ref else f"output {out!r} != {ref!r}"


def run(
    ops,
    default,
    settings=ProfileSettings(warmup=3, warmup_ms=0, min_reps=5, max_reps=1000, sample_ms=50),
    clock=None,
    **kwargs,
):
    cands = [Candidate(op.label, op) for op in ops]
    return profile(cands, default, settings, validate=same_output, clock=clock or ops[0].clock, **kwargs)


MS = 1e-3


def test_median_and_spread():
    med, spread = median_and_spread([1.0, 1.1, 0.9, 1.0, 5.0])
    assert med == 1.0
    assert spread == pytest.approx(1.4826 * 0.1 / 1.0)  # MAD = median(|x - 1|) = 0.1; the outlier does not matter
    assert median_and_spread([2.0, 2.0, 2.0]) == (2.0, 0.0)


def test_adaptive_rep_count_is_clamped():
    s = ProfileSettings(min_reps=5, max_reps=100, sample_ms=250)
    assert choose_reps(1 * MS, s) == 100  # 250 would fit: clamped to max
    assert choose_reps(10 * MS, s) == 25
    assert choose_reps(9 * MS, s) == 28  # ceil(27.8)
    assert choose_reps(200 * MS, s) == 5  # 2 would fit: clamped to min


def test_rep_count_fits_the_budget_from_the_round_cost():
    clock = FakeClock()
    ops = [FakeOp(clock, "a", 1 * MS), FakeOp(clock, "b", 2 * MS), FakeOp(clock, "c", 2 * MS)]
    result = run(ops, "a")
    assert result.reps == 10  # 50 ms budget / (1 + 2 + 2) ms per round
    assert all(len(m.samples) == 10 for m in result.measurements.values())


def test_warmup_runs_count_and_time_and_cost_ignores_the_first_runs():
    clock = FakeClock()
    # Validation and the first warmup run are slow (100 ms, compiling), then 1 ms: the estimate must be
    # ~1 ms, not skewed by the slow start.
    op = FakeOp(clock, "a", [100 * MS, 100 * MS] + [1 * MS] * 10_000)
    settings = ProfileSettings(warmup=3, warmup_ms=119.5, min_reps=5, max_reps=1000, sample_ms=30)
    result = run([op], "a", settings)
    # validation 1 run; warmup until >= 3 runs and >= 119.5 ms: 100 + 20 x 1 ms -> 21 runs; then 30 reps
    assert result.reps == 30
    assert op.calls == 1 + 21 + 30


def test_warmup_at_least_n_runs_even_when_time_is_spent():
    clock = FakeClock()
    op = FakeOp(clock, "a", 50 * MS)
    result = run([op], "a", ProfileSettings(warmup=4, warmup_ms=10, min_reps=5, max_reps=5, sample_ms=1))
    assert op.calls == 1 + 4 + 5 and result.reps == 5


def test_sync_after_every_run_and_round_robin_rotation():
    clock = FakeClock()
    log, synced = [], []
    ops = [FakeOp(clock, n, 1 * MS, log=log) for n in "abc"]
    settings = ProfileSettings(warmup=1, warmup_ms=0, min_reps=4, max_reps=4, sample_ms=1)
    phases = []
    result = run(ops, "a", settings, sync=lambda out: synced.append(out), progress=phases.append)
    assert phases == ["validate", "warmup", "sample"]
    assert len(synced) == sum(op.calls for op in ops)
    rounds = [log[-12:][i : i + 3] for i in range(0, 12, 3)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]  # each round has every candidate once
    assert result.reps == 4


def test_clear_winner_is_selected():
    clock = FakeClock()
    ops = [FakeOp(clock, "s1", 1.00 * MS), FakeOp(clock, "s2", 0.80 * MS), FakeOp(clock, "s4", 0.90 * MS)]
    result = run(ops, "s1")
    assert result.selected == "s2"
    assert result.speedup == pytest.approx(1.25)
    assert result.best.median == pytest.approx(0.8 * MS)
    assert result.required_improvement == pytest.approx(0.02)  # no noise: the floor


def test_guard_keeps_the_default_under_noise():
    clock = FakeClock()
    noisy = [1.00 * MS, 1.06 * MS, 0.94 * MS, 1.03 * MS, 0.97 * MS]
    faster_but_noisy = [c * 0.96 for c in noisy]  # 4% faster: more than 2%, less than the spreads together
    ops = [FakeOp(clock, "s1", noisy), FakeOp(clock, "s2", faster_but_noisy)]
    result = run(ops, "s1")
    m1, m2 = result.measurements["s1"], result.measurements["s2"]
    assert m1.spread > 0.02 and m2.spread > 0.02
    assert result.selected == "s1"
    assert result.required_improvement == pytest.approx(m1.spread + m2.spread)
    assert result.speedup == 1.0


def test_two_percent_floor_without_noise():
    clock = FakeClock()
    result = run([FakeOp(clock, "s1", 1.00 * MS), FakeOp(clock, "s2", 0.985 * MS)], "s1")
    assert result.selected == "s1"  # 1.5% < 2%
    clock = FakeClock()
    result = run([FakeOp(clock, "s1", 1.00 * MS), FakeOp(clock, "s2", 0.97 * MS)], "s1")
    assert result.selected == "s2"  # 3% > 2%


def test_default_tied_with_the_leader_stays():
    clock = FakeClock()
    jitter = [1.0, 1.02, 0.98]
    ops = [FakeOp(clock, "s1", [c * 1.00 * MS for c in jitter]), FakeOp(clock, "s2", [c * 0.99 * MS for c in jitter])]
    assert run(ops, "s1").selected == "s1"


def test_tied_winners_prefer_the_one_nearest_the_default():
    clock = FakeClock()
    jitter = [1.0, 1.01, 0.99]
    ops = [
        FakeOp(clock, "s1", 1.00 * MS),
        FakeOp(clock, "s2", [c * 0.80 * MS for c in jitter]),
        FakeOp(clock, "s4", [c * 0.79 * MS for c in jitter]),
        FakeOp(clock, "s8", [c * 0.70 * MS for c in jitter]),
    ]
    result = run(ops, "s1")
    assert result.selected == "s8"  # clearly fastest: not tied with the others
    clock = FakeClock()
    ops = [
        FakeOp(clock, "s1", 1.00 * MS),
        FakeOp(clock, "s2", [c * 0.80 * MS for c in jitter]),
        FakeOp(clock, "s4", [c * 0.79 * MS for c in jitter]),
        FakeOp(clock, "s8", [c * 0.795 * MS for c in jitter]),
    ]
    result = run(ops, "s1")
    assert result.selected == "s2"  # s2, s4, s8 statistically tied; s2 is nearest the default


def test_equal_distance_tie_goes_to_the_earlier_candidate():
    ms = {
        "a": Measurement("a", [], 0.80, 0.01),
        "b": Measurement("b", [], 1.0, 0.0),
        "c": Measurement("c", [], 0.79, 0.01),
    }
    assert select("b", ["a", "b", "c"], ms, 0.02)[0] == "a"


def test_wrong_candidate_is_dropped_and_reported():
    clock = FakeClock()
    ops = [
        FakeOp(clock, "s1", 1.0 * MS, output="ok"),
        FakeOp(clock, "s2", 0.5 * MS, output="garbage"),
        FakeOp(clock, "s4", 0.9 * MS, output="ok"),
    ]
    result = run(ops, "s1")
    assert result.dropped == [("s2", "output 'garbage' != 'ok'")]
    assert "s2" not in result.measurements
    assert ops[1].calls == 1  # validated once, never timed
    assert result.selected == "s4"


def test_erroring_candidates_are_dropped_at_any_phase():
    clock = FakeClock()
    ops = [
        FakeOp(clock, "s1", 1.0 * MS),
        FakeOp(clock, "s2", 0.5 * MS, fail_at=1),
        FakeOp(clock, "s4", 0.5 * MS, fail_at=3),
        FakeOp(clock, "s8", 0.5 * MS, fail_at=20),
    ]
    result = run(ops, "s1")
    dropped = dict(result.dropped)
    assert set(dropped) == {"s2", "s4", "s8"}  # at validation, warmup and sampling
    assert dropped["s2"] == "RuntimeError: launch failed: too many resources requested"  # one line
    assert result.selected == "s1" and set(result.measurements) == {"s1"}


def test_failing_default_gives_no_usable_measurement():
    clock = FakeClock()
    result = run([FakeOp(clock, "s1", 1 * MS, fail_at=1), FakeOp(clock, "s2", 1 * MS)], "s1")
    assert not result.usable and result.selected is None and result.dropped[0][0] == "s1"


def test_bad_arguments():
    clock = FakeClock()
    with pytest.raises(ValueError, match="not among"):
        run([FakeOp(clock, "s1", MS)], "s2")
    with pytest.raises(ValueError, match="--max-reps"):
        ProfileSettings(min_reps=10, max_reps=5).validate()
    with pytest.raises(ValueError, match="--min-improvement"):
        ProfileSettings(min_improvement=1.5).validate()
