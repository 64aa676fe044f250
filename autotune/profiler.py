"""A profiler whose choice noise cannot fool: validate, warm up, adapt the rep count, interleave, guard.

For one cell (one shape) and its candidate tactics:

1. Validate: the default runs once and gives the reference output; every other candidate runs once and
   its output is checked against it. A candidate that raises or disagrees is dropped and reported.
2. Warm up each candidate: at least `warmup` runs *and* at least `warmup_ms` of runs (compilation and
   caches settle here). Its cost estimate is the median of the later half of its warmup samples.
3. Adaptive rep count: one round (every candidate once) costs the sum of the estimates, so
   reps = clamp(ceil(sample_ms / round cost), min_reps, max_reps) keeps the cell within its budget.
4. Round-robin sampling: each round runs every candidate once, in an order rotated every round, so
   drift (clocks, heat, other load) hits all of them alike. Each rep is run, then synchronized, then
   timed; a candidate that raises while sampled is dropped.
5. Score: the median. Spread: 1.4826 x MAD / median (a robust relative standard deviation).
6. Choose: the candidates whose median is within lead x (1 + spread_lead + spread_i) of the fastest
   ("lead") are statistically tied with it; if the default is among them it stays. Otherwise the tied
   candidates are tried nearest-to-the-default first (in candidate order; the earlier on equal distance)
   and the first whose improvement over the default exceeds
   max(min_improvement, spread_default + spread_candidate) wins. If none does, the default stays.

The clock and the synchronization are injected, so tests drive it with a fake clock and fake ops.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normally distributed samples


@dataclass(frozen=True)
class ProfileSettings:
    warmup: int = 3  # at least this many warmup runs per candidate ...
    warmup_ms: float = 40.0  # ... and at least this much warmup time per candidate
    min_reps: int = 5
    max_reps: int = 1000
    sample_ms: float = 250.0  # time budget for the sampling rounds of one cell
    min_improvement: float = 0.02  # never switch away from the default for less than this

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting (the CLI turns it into a usage error)."""
        if self.warmup < 1:
            raise ValueError(f"--warmup must be >= 1, got {self.warmup}")
        if not self.warmup_ms >= 0:
            raise ValueError(f"--warmup-ms must be >= 0, got {self.warmup_ms}")
        if self.min_reps < 1:
            raise ValueError(f"--min-reps must be >= 1, got {self.min_reps}")
        if self.max_reps < self.min_reps:
            raise ValueError(f"--max-reps ({self.max_reps}) must be >= --min-reps ({self.min_reps})")
        if not self.sample_ms > 0:
            raise ValueError(f"--sample-ms must be > 0, got {self.sample_ms}")
        if not 0 <= self.min_improvement < 1:
            raise ValueError(f"--min-improvement must be in [0, 1), got {self.min_improvement}")

    def describe(self) -> str:
        return (
            f"warmup>={self.warmup} ({self.warmup_ms:g}ms) reps {self.min_reps}..{self.max_reps} "
            f"({self.sample_ms:g}ms budget) min_improvement={self.min_improvement:.3f} (+ measured spread)"
        )


@dataclass(frozen=True)
class Candidate:
    """One tactic: `run()` launches the op with it and returns its output (lazy arrays are fine)."""

    label: str
    run: Callable[[], Any]
    params: dict = field(default_factory=dict)


@dataclass
class Measurement:
    label: str
    samples: list[float]  # seconds per rep
    median: float
    spread: float  # 1.4826 x MAD / median

    @property
    def median_us(self) -> float:
        return self.median * 1e6


@dataclass
class ProfileResult:
    default: str  # the default's label
    selected: Optional[str]  # None: no usable measurement (the default itself failed)
    measurements: dict[str, Measurement]  # candidates that survived, by label
    dropped: list[tuple[str, str]]  # (label, reason)
    reps: int = 0
    required_improvement: float = 0.0  # the guard the selected (or the best challenger) had to beat
    candidates: list[str] = field(default_factory=list)  # all labels, in candidate order

    @property
    def usable(self) -> bool:
        return self.selected is not None

    @property
    def best(self) -> Optional[Measurement]:
        return self.measurements.get(self.selected) if self.selected else None

    @property
    def default_measurement(self) -> Optional[Measurement]:
        return self.measurements.get(self.default)

    @property
    def speedup(self) -> float:
        best, default = self.best, self.default_measurement
        if best is None or default is None or best.median <= 0:
            return 1.0
        return default.median / best.median


def median_and_spread(samples: Sequence[float]) -> tuple[float, float]:
    """(median, 1.4826 x MAD / median); the spread is 0 for a zero median."""
    med = statistics.median(samples)
    mad = statistics.median(abs(s - med) for s in samples)
    return med, (MAD_TO_SIGMA * mad / med) if med > 0 else 0.0


def choose_reps(round_cost_s: float, settings: ProfileSettings) -> int:
    """clamp(ceil(sample budget / cost of one round), min_reps, max_reps)."""
    if round_cost_s <= 0:
        return settings.max_reps
    reps = math.ceil(settings.sample_ms / 1000.0 / round_cost_s)
    return max(settings.min_reps, min(settings.max_reps, reps))


def select(
    default: str, order: Sequence[str], measurements: dict[str, Measurement], min_improvement: float
) -> tuple[str, float]:
    """(selected label, required improvement of the challenger that was judged) per the module's rules."""
    ref = measurements[default]
    lead = min(measurements.values(), key=lambda m: (m.median, order.index(m.label)))
    tied = [m for m in measurements.values() if m.median <= lead.median * (1 + lead.spread + m.spread)]
    home = order.index(default)
    required = max(min_improvement, ref.spread + lead.spread)
    if any(m.label == default for m in tied):
        return default, required
    for m in sorted(tied, key=lambda m: (abs(order.index(m.label) - home), order.index(m.label))):
        need = max(min_improvement, ref.spread + m.spread)
        improvement = (ref.median - m.median) / ref.median if ref.median > 0 else 0.0
        if improvement > need:
            return m.label, need
    return default, required


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _validated(candidates, default: str, validate, sync, result: ProfileResult) -> list[Candidate]:
    """Step 1: the candidates whose output agrees with the default's (the default first among them); none when the
    default itself fails. The others go to `result.dropped` with the reason."""
    by_label = {c.label: c for c in candidates}
    try:
        reference = by_label[default].run()
        sync(reference)
    except Exception as exc:  # without a working default there is nothing to compare with
        result.dropped.append((default, _first_line(exc)))
        return []
    alive: list[Candidate] = []
    for cand in candidates:
        if cand.label == default:
            alive.append(cand)
            continue
        try:
            out = cand.run()
            sync(out)
            reason = validate(out, reference) if validate else None
        except Exception as exc:
            reason = _first_line(exc)
        if reason is None:
            alive.append(cand)
        else:
            result.dropped.append((cand.label, reason))
    return alive


def _warm_costs(alive: list[Candidate], timed, settings: ProfileSettings, result: ProfileResult) -> dict[str, float]:
    """Step 2: each candidate warmed up; its cost estimate is the median of the later half of its warmup samples.
    A candidate that raises leaves `alive` for `result.dropped`."""
    costs: dict[str, float] = {}
    for cand in list(alive):
        samples: list[float] = []
        spent = 0.0
        try:
            while len(samples) < settings.warmup or spent * 1000.0 < settings.warmup_ms:
                dt = timed(cand)
                samples.append(dt)
                spent += dt
        except Exception as exc:
            alive.remove(cand)
            result.dropped.append((cand.label, _first_line(exc)))
            continue
        costs[cand.label] = statistics.median(samples[len(samples) // 2 :])
    return costs


def _round_robin(alive: list[Candidate], timed, reps: int, result: ProfileResult) -> dict[str, list[float]]:
    """Step 4: `reps` rounds, every surviving candidate once a round, the order rotated each round."""
    samples_by: dict[str, list[float]] = {c.label: [] for c in alive}
    for r in range(reps):
        if not alive:
            break
        shift = r % len(alive)
        for cand in alive[shift:] + alive[:shift]:
            if cand.label not in samples_by:
                continue
            try:
                samples_by[cand.label].append(timed(cand))
            except Exception as exc:
                del samples_by[cand.label]
                result.dropped.append((cand.label, _first_line(exc)))
        alive = [c for c in alive if c.label in samples_by]
    return samples_by


def profile(
    candidates: Sequence[Candidate],
    default: str,
    settings: ProfileSettings = ProfileSettings(),
    *,
    validate: Optional[Callable[[Any, Any], Optional[str]]] = None,
    sync: Callable[[Any], None] = lambda out: None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Optional[Callable[[str], None]] = None,
) -> ProfileResult:
    """Profile `candidates` (one of them labelled `default`) for one cell; see the module docstring.

    `validate(output, reference)` returns None when `output` is acceptable, else a one-line reason.
    `sync(output)` blocks until the output is computed (mx.eval for MLX). `progress(phase)` is called
    as phases begin ("validate", "warmup", "sample")."""
    order = [c.label for c in candidates]
    if default not in order:
        raise ValueError(f"default {default!r} is not among the candidates {order}")
    if len(set(order)) != len(order):
        raise ValueError(f"candidate labels must be unique, got {order}")
    result = ProfileResult(default=default, selected=None, measurements={}, dropped=[], candidates=order)
    note = progress or (lambda phase: None)

    def timed(cand: Candidate) -> float:
        start = clock()
        sync(cand.run())
        return clock() - start

    note("validate")
    alive = _validated(candidates, default, validate, sync, result)
    note("warmup")
    costs = _warm_costs(alive, timed, settings, result)
    if default not in costs:
        return result
    result.reps = choose_reps(sum(costs.values()), settings)  # 3. the rep count for the whole round
    note("sample")
    samples_by = _round_robin(alive, timed, result.reps, result)
    if default not in samples_by:
        return result
    for label, samples in samples_by.items():  # 5. score
        med, spread = median_and_spread(samples)
        result.measurements[label] = Measurement(label, samples, med, spread)
    # 6. choose
    result.selected, result.required_improvement = select(default, order, result.measurements, settings.min_improvement)
    return result
