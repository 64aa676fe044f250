"""GGUF files on CUDA. There a file computes in its half dtype (loading/gguf.py `gpu_dtype`: scales, norms and
activations float16 here), as MLX's own checkpoints do; MLX's quantized kernels compute in the scales' dtype anyway
(a float32 activation is rounded to it: about 2e-4 a product, benchmarks/archive/2026-12-02-h200-suite/). The file's
decoding is checked on the CPU (tests/mlxcel_core/loading); here the GPU's logits of a Q4_0 file stay within half
precision's rounding of the CPU's float32 ones, and its greedy CLI run completes."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import mlx.core as mx
import numpy as np
import pytest
from family_checks import SPECIAL
from gguf_convert import convert
from mlx.utils import tree_flatten
from parity import prompt_ids
from tiny_models import save_tiny_llama

from mlxcel_core.loading import load_model

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-cuda")
    hf = save_tiny_llama(root / "hf", hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    return convert(hf, root / "tiny-q4_0.gguf", "llama", qtype=gguf.GGMLQuantizationType.Q4_0)


def _logits(path, device) -> tuple[np.ndarray, set]:
    """The logits of a 12-token prompt on `device`, and the float dtypes of the model's parameters there."""
    previous = mx.default_device()
    mx.set_default_device(device)
    try:
        model = load_model(str(path), log=lambda m: None).model
        floats = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
        return np.array(model(mx.array([prompt_ids(12)])).astype(mx.float32))[0], floats
    finally:
        mx.set_default_device(previous)


def test_gpu_logits_are_the_cpus_within_float16_rounding(q4_0_file):
    (gpu, gpu_dtypes), (cpu, cpu_dtypes) = _logits(q4_0_file, mx.gpu), _logits(q4_0_file, mx.cpu)
    assert gpu_dtypes == {mx.float16} and cpu_dtypes == {mx.float32}
    rel = np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu)
    assert rel <= 1e-2, rel


def test_generate_runs_the_file_on_the_gpu(q4_0_file):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "generate", "-m", str(q4_0_file), "-p", "hello", "-n", "8"]
        + ["--no-chat-template", "--json", *[arg for t in SPECIAL for arg in ("--suppress-token", str(t))]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 8
