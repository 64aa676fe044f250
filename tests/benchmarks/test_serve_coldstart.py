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


def test_mlx_jit_modules_counts_the_sources_mlx_wrote_since_the_run_began(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from serve_coldstart import mlx_jit_modules

    folder = tmp_path / "kernels" / "mlx-0.32.4" / "sm_90-NVIDIA_H200"
    folder.mkdir(parents=True)
    written = {"old_gather_float32.cu": 100.0, "Cf4IBroadcastADf4OMultiplyCB_VV_f4f4_1.cu": 1000.0}
    written |= {"Bf4ISigmoidAC_V_f4_2.cu": 1004.5, "gather_float32_int32.cu": 1010.0, "x.ptx": 1011.0}
    for name, mtime in written.items():
        (folder / name).write_text("source")
        os.utime(folder / name, (mtime, mtime))
    assert mlx_jit_modules(tmp_path, 999.0) == (
        "MLX's JIT: 3 modules compiled (2 fused elementwise, 1 others), written over 10.0 s"
    )
    assert mlx_jit_modules(tmp_path, 999.0, names=True).splitlines()[1:] == [
        "  +  4.5 s Bf4ISigmoidAC_V_f4_2",
        "  +  5.5 s gather_float32_int32",
    ]
    assert mlx_jit_modules(tmp_path, 2000.0) == ""
    assert mlx_jit_modules(tmp_path / "elsewhere", 0.0) == ""
