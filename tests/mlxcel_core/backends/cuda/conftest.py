"""The CUDA wing's tests build models as the CUDA backend sees them: MLX's quantized classes, not the portable
backend's CPU float32 swap (backends/cpu_float32.py), which CPU runs of these tests would otherwise get at build."""

from __future__ import annotations

import pytest

from mlxcel_core.backends import cpu_float32


@pytest.fixture(autouse=True)
def _no_cpu_float32_swap(monkeypatch):
    monkeypatch.setattr(cpu_float32, "applies", lambda: False)
