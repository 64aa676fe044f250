"""The prompt GEMM's memory on the CPU: a random smollm2-135m-shaped 4-bit model (bf16) prefills 256 tokens with
fast_linear's prompt path forced on (kernel_ready stands in for the GPU; the matvec kernel takes no call) and off,
twice each; printed: MLX's peak memory over the active memory before the forward.

    python benchmarks/archive/2026-12-05-h200-session-25/cpu_peak_memory.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels import fast_linear, qmv  # noqa: E402
from mlxcel_core.cache import make_cache  # noqa: E402
from mlxcel_core.loading.shapes import build_random_model  # noqa: E402

fast_linear.MIN_WEIGHT = 0
qmv.launch_args = lambda *a, **k: None
model, _ = build_random_model("smollm2-135m", bits=4, dtype="bfloat16", seed=0)
print("swapped", fast_linear.use_fast_quantized_linear(model))
prompt = mx.array([[i % 1000 for i in range(256)]])
for ready in (False, True, False, True):
    qmv.kernel_ready = lambda r=ready: r
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.time()
    mx.eval(model(prompt, make_cache(len(model.layers)), last_only=True))
    what = "prompt GEMM" if ready else "quantized_matmul"
    print(f"{what}: peak over active {(mx.get_peak_memory() - base) / 2**20:.1f} MiB, {time.time() - t:.1f} s")
