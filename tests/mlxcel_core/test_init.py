"""Importing mlxcel_core keeps float32 matmuls float32 on CUDA (MLX_ENABLE_TF32=0) unless the user chose."""

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
