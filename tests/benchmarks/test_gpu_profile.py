"""benchmarks/gpu_profile.py without a GPU: the busy time as the union of kernel intervals, each
kernel's own share of it, which leaves out the time a kernel launched early (programmatic dependent launch) spends
inside the one before it, and --batch's steps of every row."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_profile  # noqa: E402


def test_own_times_split_the_busy_time_by_kernel():
    kernels = [
        ("attention", 0, 100_000),  # (name, start ns, duration ns)
        ("o_proj", 5_000, 98_000),  # launched early: waits inside attention, runs its last 3 us alone
        ("norm", 20_000, 1_000),  # wholly inside attention's interval
        ("mlp", 110_000, 20_000),  # after a 7 us gap
        ("attention", 130_000, 10_000),
    ]
    own = gpu_profile.own_us(kernels)
    assert own == {"attention": 110.0, "o_proj": 3.0, "norm": 0.0, "mlp": 20.0}
    assert sum(own.values()) == 133.0  # the union of the intervals: 0-103, 110-140 us


def test_order_of_the_records_does_not_matter():
    kernels = [("b", 50_000, 100_000), ("a", 0, 100_000)]
    assert gpu_profile.own_us(kernels) == gpu_profile.own_us(list(reversed(kernels))) == {"a": 100.0, "b": 50.0}


def test_batch_steps_run_every_row_from_the_second_step():
    """--batch's steps: every prompt prefilled in the first step, then warm + count steps in which all rows decode
    (the serving defaults would start the last rows after the first had ended: no step of the whole batch)."""
    from mlxcel_core.loading.shapes import build_random_model

    model, config = build_random_model("tiny", bits=4, seed=0)
    steps = list(gpu_profile.mlxcel_steps(model, config["vocab_size"], 12, 64, 2, 3))
    assert len(steps) == 5 and all(len(outs) == 12 for outs in steps)
    assert all(len({out.seq_id for out in outs}) == 12 for outs in steps)
