"""Host cost of one `mx.fast.precompiled_cuda_kernel` launch against the size of the cubin it is given (CUDA only).

    python benchmarks/precompiled_call_cost.py

A chain of 80 launches of one small elementwise kernel, evaluated once, repeated; the same chain in `mx.compile`.
Cubins: the kernel alone, the kernel beside 64 KiB of unused device constants (our decode kernels' cubins are
50-90 KB). Prints µs per launch for each.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from mlxcel_core.backends.cuda.kernels.cubin_cache import compile_cubin, gpu_architecture  # noqa: E402

SOURCE = """
#include <cuda_bf16.h>
{pad}
extern "C" __global__ void {name}(const float* x, float* y, int n) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * 1.0001f + {touch};
}}
"""
CHAIN, REPEATS = 80, 60


def cubin(name: str, pad_bytes: int) -> bytes:
    pad = f"__device__ unsigned char pad_{name}[{pad_bytes}] = {{1}};" if pad_bytes else ""
    touch = f"(float)pad_{name}[i % {pad_bytes}]" if pad_bytes else "0.0f"
    return compile_cubin(SOURCE.format(pad=pad, name=name, touch=touch), name, gpu_architecture())


def chain(name: str, source, x: mx.array) -> mx.array:
    for _ in range(CHAIN):
        x = mx.fast.precompiled_cuda_kernel(
            name=name,
            compiled_source=source,
            inputs=[x],
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
            scalars=[x.size],
            grid=(x.size, 1, 1),
            threadgroup=(256, 1, 1),
        )[0]
    return x


def per_launch_us(fn, x: mx.array) -> float:
    mx.eval(fn(x))
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        mx.eval(fn(x))
    mx.synchronize()
    return (time.perf_counter() - start) / (REPEATS * CHAIN) * 1e6


def main() -> int:
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("precompiled_call_cost.py needs MLX's CUDA backend", file=sys.stderr)
        return 1
    x = mx.ones((2048,), mx.float32)
    small, large = cubin("k_small", 0), cubin("k_large", 65536)
    print(f"cubin sizes: small {len(small)} B, large {len(large)} B")
    mx.eval(chain("k_small", small, x), chain("k_large", large, x))  # both modules loaded
    if len(sys.argv) > 1:  # a directory to keep the cubins in (to read their sections elsewhere)
        Path(sys.argv[1], "k_small.cubin").write_bytes(small)
        Path(sys.argv[1], "k_large.cubin").write_bytes(large)
    cases = {"small cubin": lambda a: chain("k_small", small, a), "large cubin": lambda a: chain("k_large", large, a)}
    for label, fn in cases.items():
        eager = per_launch_us(fn, x)
        compiled = per_launch_us(mx.compile(fn), x)
        print(f"{label:28s} op by op {eager:6.2f} us/launch   compiled {compiled:6.2f} us/launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
