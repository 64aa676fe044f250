"""benchmarks/qmm_ab.py: the two 4-bit batch kernels side by side needs CUDA; elsewhere it says so and exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "qmm_ab.py"


@pytest.mark.skipif(getattr(mx, "cuda", None) is not None and mx.cuda.is_available(), reason="runs on a CPU")
def test_without_cuda_it_says_so_and_exits():
    done = subprocess.run([sys.executable, str(SCRIPT), "--m", "9"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "needs MLX's CUDA backend and a CUDA device" in done.stderr
