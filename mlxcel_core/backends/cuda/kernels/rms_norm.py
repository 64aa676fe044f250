"""A model's final RMSNorm as one launch of our own kernel, while a decode step is recorded for a CUDA graph
(backends/cuda/graph_decode.py): a replayed graph holds only our cached kernels, and MLX's norm would be missing from
it.

    make_final_norm_recordable(model)   # the CUDA backend's prepare step: the final norm becomes a RecordableRMSNorm
    with final_norm_as_kernel():
        h = model.model(...)             # its final norm is `rms_norm(h, weight, eps)` here, MLX's norm elsewhere

The arithmetic is MLX's CUDA RMSNorm's: float32 sum of squares over the row, r = rsqrt(mean + eps), the output
T(x * r) times the weight (in float, rounded to T). On the H200 (benchmarks/graph_replay.py, 1B 4-bit, bf16 rows of
2048) the LM head read the same logits, bit for bit, from this launch as from MLX's norm.
"""

from __future__ import annotations

import contextlib
import contextvars

import mlx.core as mx
import mlx.nn as nn

THREADS = 1024
SOURCE = """
    __shared__ float part[32];
    const int row = blockIdx.x;
    const T* xr = x + static_cast<long long>(row) * N;
    T* yr = y + static_cast<long long>(row) * N;
    float s = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) { const float v = static_cast<float>(xr[i]); s += v * v; }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0) part[0] = t;
    }
    __syncthreads();
    const float r = rsqrtf(part[0] / N + EPS);
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * r);
        yr[i] = static_cast<T>(static_cast<float>(normed) * static_cast<float>(w[i]));
    }
"""
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

_as_kernel: contextvars.ContextVar[bool] = contextvars.ContextVar("mlxcel_final_norm_as_kernel", default=False)
_kernels: dict[float, object] = {}


@contextlib.contextmanager
def final_norm_as_kernel():
    """Within: a RecordableRMSNorm runs this kernel (graph_decode.py records a step's launches in it)."""
    token = _as_kernel.set(True)
    try:
        yield
    finally:
        _as_kernel.reset(token)


def _kernel(eps: float):
    """One kernel per epsilon (a literal in its source, as the qmv kernels' norm epsilon is)."""
    if eps not in _kernels:
        from .cubin_cache import cuda_kernel

        source = f"    constexpr float EPS = {float(eps)!r}f;\n" + SOURCE
        _kernels[eps] = cuda_kernel(
            name=f"mlxcel_rms_norm_{abs(hash(float(eps))) % 10**8}",
            input_names=["x", "w"],
            output_names=["y"],
            source=source,
        )
    return _kernels[eps]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    n = x.shape[-1]
    rows = x.size // n
    (y,) = _kernel(eps)(
        inputs=[x, weight],
        template=[("T", x.dtype), ("N", n)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return y


class RecordableRMSNorm(nn.RMSNorm):
    """nn.RMSNorm that is this kernel while a step is recorded for a CUDA graph (final_norm_as_kernel) and its input
    is one the kernel takes; MLX's norm otherwise. Same parameters as nn.RMSNorm: make_final_norm_recordable swaps a
    built model's final norm to this class in place."""

    def __call__(self, x: mx.array) -> mx.array:
        if (
            _as_kernel.get()
            and getattr(mx, "cuda", None)
            and mx.cuda.is_available()
            and x.dtype in DTYPES
            and self.weight.dtype == x.dtype
            and self.weight.shape == (x.shape[-1],)
        ):
            return rms_norm(x, self.weight, self.eps)
        return super().__call__(x)


def make_final_norm_recordable(model: nn.Module) -> None:
    """Swap the final norm of `model` (a TransformerLM's: `model.model.norm`) to RecordableRMSNorm, in place, where it
    is exactly an nn.RMSNorm; any other norm (Gemma's (1 + weight) RMSNorm, a subclass) keeps its own call. The
    parameters are the norm's own, unchanged."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if type(norm) is nn.RMSNorm:
        norm.__class__ = RecordableRMSNorm
