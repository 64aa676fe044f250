"""The backend seam: one backend a process, the portable one wherever the CUDA wing does not serve, and a process
on the portable backend imports no CUDA module (a Mac or CPU user never loads the CUDA wing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel_core import backends
from mlxcel_core.backends.base import Backend

ROOT = Path(__file__).resolve().parents[3]

# Decode with the engine on the tiny random model, then list the CUDA wing's modules this process imported.
SCRIPT = """
import sys
from mlxcel_core import backends
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.loading.shapes import build_random_model
from mlxcel_core.sampling import SamplingParams
from tiny_models import build_tokenizer

class Tok:
    backend = build_tokenizer()
    vocab_size = backend.get_vocab_size()
    eos_token_ids = {2}
    def decode(self, ids): return self.backend.decode(ids)
    def encode(self, text, add_special_tokens=False): return self.backend.encode(text).ids

model, _ = build_random_model("tiny", dtype="float32", seed=0)
engine = Engine(model, Tok(), EngineConfig(max_batch_size=2, storage="paged"))
for prompt in ([5, 6, 7], [8, 9]):
    engine.open(prompt, SamplingParams(max_tokens=4, suppress_tokens=(2,)))
while engine.has_work():
    assert all(out.error is None for out in engine.step())
print("backend=" + type(backends.current()).__name__)
print("modules=" + ",".join(sorted(m for m in sys.modules if m.startswith("mlxcel_core.backends.cuda"))))
"""


def _run(env_cuda: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_CUDA"}
    if env_cuda is not None:
        env["MLXCEL_CUDA"] = env_cuda
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return said["backend"], said["modules"]


def test_the_kill_switch_gives_the_portable_backend_and_no_cuda_module():
    name, modules = _run("0")
    assert name == "Backend" and modules == ""


@pytest.mark.skipif(backends.cuda_available(), reason="a CPU or Metal machine: no CUDA device")
def test_without_a_cuda_device_no_cuda_module_is_imported():
    name, modules = _run(None)
    assert name == "Backend" and modules == ""


@pytest.mark.skipif(not backends.cuda_available(), reason="needs MLX on a CUDA device")
def test_a_cuda_device_gets_the_cuda_wing():
    name, modules = _run(None)
    assert name == "CudaBackend" and "mlxcel_core.backends.cuda.kernels" in modules.split(",")


def test_use_swaps_the_process_backend():
    mine = Backend()
    previous = backends.use(mine)
    try:
        assert backends.current() is mine
    finally:
        backends.use(previous)


def test_the_portable_greedy_readout_marks_nan_rows():
    logits = mx.array([[0.0, 3.0, 3.0], [float("nan"), 1.0, 0.0]])
    tokens, readout = Backend().greedy_tokens(logits)
    assert tokens.tolist()[0] == 1 and readout.tolist() == [1, -1]
