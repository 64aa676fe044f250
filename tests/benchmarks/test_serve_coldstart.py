"""benchmarks/serve_coldstart.py, run as a script on a tiny random model: a real `mlxcel serve` per run, its ready
time and two requests, then (--burst) two bursts of clients at once, first against second; nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_coldstart.py"
NUMBER = r"([\d.]+)"


def test_a_warm_run_with_bursts_reports_both_and_their_ratio(tmp_path):
    argv = [sys.executable, str(SCRIPT), "--model-shape", "tiny", "--dtype", "float32", "--runs", "warm"]
    argv += ["--max-tokens", "4", "--burst", "5", "--max-batch-size", "4"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^warm +ready +[\d.]+ s \(warm-up [\d.]+ s", done.stdout, re.M), done.stdout
    found = re.search(
        rf"burst of 5: first TTFT p50 {NUMBER} ms, p99 {NUMBER} ms, {NUMBER} tok/s \| second TTFT p50 {NUMBER} ms, "
        rf"p99 {NUMBER} ms, {NUMBER} tok/s \| first / second: TTFT p50 {NUMBER}x, tok/s {NUMBER}x",
        done.stdout,
    )
    assert found, done.stdout
    p50, p99, rate, p50b, p99b, rateb, ttft_ratio, rate_ratio = (float(g) for g in found.groups())
    assert 0 < p50 <= p99 and 0 < p50b <= p99b and rate > 0 and rateb > 0
    assert abs(ttft_ratio - p50 / p50b) < 0.01 + 0.01 * ttft_ratio  # (printed to 2 places from 1-place figures)
    assert abs(rate_ratio - rate / rateb) < 0.01 + 0.01 * rate_ratio
    assert not list(tmp_path.glob("mlxcel-coldstart-*"))  # (the model and the kernel cache are deleted)
