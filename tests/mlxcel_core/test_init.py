"""Importing mlxcel_core keeps float32 matmuls float32 on CUDA (MLX_ENABLE_TF32=0) unless the user chose, and points
the CUDA driver's JIT cache into mlxcel's cache dir (CUDA_CACHE_PATH) unless the user set one; both before mlx loads."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("preset,want", [(None, "0"), ("1", "1"), ("0", "0")])
def test_tf32_default(preset, want):
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if preset is not None:
        env["MLX_ENABLE_TF32"] = preset
    code = "import mlxcel_core, os; print(os.environ['MLX_ENABLE_TF32'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == want


@pytest.mark.parametrize("preset", [None, "/somewhere/nv"])
def test_the_cuda_driver_cache_default(preset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_CACHE_PATH"}
    env["MLXCEL_CACHE_DIR"] = str(tmp_path)
    if preset is not None:
        env["CUDA_CACHE_PATH"] = preset
    code = "import mlxcel_core, os, sys; print(os.environ['CUDA_CACHE_PATH'], 'mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [preset or str(tmp_path / "kernels" / "cuda-driver"), "False"]  # set before mlx loads
