"""Compile checks of our CUDA kernel sources as MLX's CUDA custom_kernel (mlx/backend/cuda/custom_kernel.cpp,
build_kernel) assembles them, with nvcc for sm_90: a source compiles and spills no registers. Where nvcc is installed
(skipped without); nothing runs. MLX's default header (mlx/backend/cuda/device/utils.cuh) is not installed with a CPU
build of MLX, so STAND_IN_HEADER gives what the kernels use of it."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

from mlxcel_core.backends.cuda.kernels.cubin_cache import (
    CUDA_TYPES,  # MLX's dtype_to_cuda_type, as the cubin cache writes it
)

STAND_IN_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
#define inf cuda::std::numeric_limits<float>::infinity()
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


def nvcc() -> str | None:
    return shutil.which("nvcc")


needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="needs nvcc (compile check only; nothing runs)")


def kernel_file(name: str, params: list[str], template: dict, source: str, header: str = "") -> str:
    """A translation unit as build_kernel writes it: parameters ("const T* x", ...), the template's constants, the
    body. Template values that are dtypes become `using` aliases, the rest constexpr ints (bools as ints)."""
    consts = [
        f"  using {k} = {CUDA_TYPES[v]};" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {int(v)};"
        for k, v in template.items()
    ]
    return (
        STAND_IN_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        f"__global__ void custom_kernel_{name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n\n"
        + source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )


def compile_sm90(tmp_path, text: str) -> str:
    """nvcc -Xptxas -v of `text`; fails the test unless it compiles without spills; returns ptxas' report."""
    src = tmp_path / "kernel.cu"
    src.write_text(text)
    run = subprocess.run(
        [
            nvcc(),
            "-std=c++17",
            "-arch=sm_90",
            "-cubin",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp_path / "kernel.cubin"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "0 bytes spill stores" in run.stderr, run.stderr[-2000:]
    return run.stderr
