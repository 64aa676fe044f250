"""The GGUF modules' in-process checks compute on the CPU device, also on a machine with a GPU.

They check GGUF decoding against ggml's and transformers' float32 values and against the same file decoded to F32.
On the CPU, MLX computes a quantized product of float32 activations in float32 (as exact as the dense product). On
CUDA, MLX's quantized kernels round a float32 activation to the scales' dtype (float16 for GGUF there, as llama.cpp's
CUDA matmuls take their inputs): relative errors near 2e-4 a product, measured on the H200 in
benchmarks/archive/2026-12-02-h200-suite/. That is a property of the GPU's kernels, not of the file's decoding, so
these checks run where the decoding alone decides the values. GGUF files on the GPU are still exercised there by the
CLI tests (their subprocesses compute on the default device) and benchmarks/gguf_speed.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _gguf_checks_on_the_cpu(request):
    if not request.module.__name__.rpartition(".")[2].startswith("test_gguf_") or mx.default_device() == mx.cpu:
        yield
        return
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)
