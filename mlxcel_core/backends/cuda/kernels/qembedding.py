"""Token-embedding lookups for a decode step's few ids as one CUDA launch: 4-bit (``nn.QuantizedEmbedding``) and
16-bit (``nn.Embedding``).

    rows = quantized_embedding(ids, weight, scales, biases, group_size)   # == mx.dequantize(weight[ids], ...)
    rows = embedding(ids, weight)                                         # == weight[ids], bf16/fp16

As MLX ops the lookup is three gathers (the packed words, the scales, the biases) and a dequantize: four launches a
decode step. On the H200 a 1B 4-bit step's gathers take 64.5 us together, 16 us a gather (benchmarks/RESULTS.md;
this kernel: 2.7 us), where the whole lookup reads a few kilobytes. The kernel reads each row's id
once: one thread per packed word (8 values), with MLX's dequantize arithmetic (``scale * q + bias`` in the scales'
dtype, mlx/backend/cuda/quantized/affine_quantize.cu), so its rows are MLX's bit for bit.

Runs where `kernel_runs` says so: MLX on CUDA computing on the GPU by default, 4-bit affine weights with biases, group
size 32/64/128, at most MAX_IDS ids; anything else is MLX's own call (kernels/fast_linear.py's FastQuantizedEmbedding
decides). An id outside [0, vocabulary) is clamped into it (MLX's gather does not check either; the kernel must not
read outside the table).

The 16-bit lookup is a copy of each id's row, 16 bytes a thread. MLX's own is a gather, a launch too, but one a CUDA
graph of our kernels cannot hold (backends/cuda/graph_decode.py replays only cached kernels): with this kernel a
bf16 model's decode step can be replayed. It runs where `half_kernel_runs` says so (a bf16/fp16 table whose width is a
multiple of 8, at most MAX_IDS ids, MLX on CUDA), for the same `FastEmbedding` layers kernels/hmv.py serves.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..paged_attention import cuda_kernel_available
from .cubin_cache import cuda_kernel
from .qmm import MAX_ROWS as MAX_IDS  # a decode step's rows (batches past 8 too); a longer prompt's lookup stays MLX's
from .qmv import FLOAT_TYPES, GROUP_SIZES

THREADS = 256


def _lookup(pieces: str, body: str) -> str:
    """A lookup kernel's source: thread j of block row r takes piece j (of `pieces` a table row) of row ids[r], the id
    clamped into the table (`id`), then `body`."""
    return (
        r"""
    const int r = blockIdx.y;
    const int j = blockIdx.x * TPB + threadIdx.x;
    const int pieces = """
        + pieces
        + r""";
    if (j >= pieces) {
        return;
    }
    const long long vocab = w_shape[0];
    long long id = static_cast<long long>(ids[r]);
    id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
"""
        + body
    )


_SOURCE = _lookup(
    "w_shape[1]  /* packed words: 8 values each */",
    r"""    const int words = pieces;
    const int groups = words * 8 / GS;
    const uint32_t word = w[id * words + j];
    const T scale = scales[id * groups + j * 8 / GS];
    const T bias = biases[id * groups + j * 8 / GS];
    T* o = out + (size_t(r) * words + j) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = scale * static_cast<T>(static_cast<int>((word >> (4 * i)) & 0xf)) + bias;
    }
""",
)


_HALF_SOURCE = _lookup(
    "w_shape[1] / 8  /* 16-byte chunks: 8 16-bit values each */",
    r"""    const int chunks = pieces;
    const size_t src = (size_t(id) * chunks + j) * 8;
    const size_t dst = (size_t(r) * chunks + j) * 8;
    if (((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(out)) & 15) == 0) {
        *reinterpret_cast<uint4*>(out + dst) = *reinterpret_cast<const uint4*>(w + src);
    } else {  // a table that is a view at an odd offset: the same copy, a value at a time
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            out[dst + i] = w[src + i];
        }
    }
""",
)
HALF_TYPES = (mx.bfloat16, mx.float16)


@functools.cache
def _half_kernel():
    return cuda_kernel(name="mlxcel_embedding", input_names=["ids", "w"], output_names=["out"], source=_HALF_SOURCE)


@functools.cache
def _kernel():
    return cuda_kernel(
        name="mlxcel_qembedding",
        input_names=["ids", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def shape_supported(ids_shape, ids_dtype, w_shape, w_dtype, scales_dtype, group_size: int, bits: int) -> bool:
    """Whether the kernel handles these operands (shapes and dtypes; `kernel_runs` adds the backend)."""
    size = math.prod(ids_shape)
    return (
        bits == 4
        and group_size in GROUP_SIZES
        and w_dtype == mx.uint32
        and len(w_shape) == 2
        and (w_shape[1] * 8) % group_size == 0
        and scales_dtype in FLOAT_TYPES
        and ids_dtype in (mx.int32, mx.uint32)
        and 1 <= size <= MAX_IDS
    )


def kernel_runs(ids: mx.array, layer) -> bool:
    """Whether `layer(ids)` (a 4-bit nn.QuantizedEmbedding) can be this launch here."""
    biases = layer.get("biases")
    return (
        biases is not None
        and getattr(layer, "mode", "affine") == "affine"
        and cuda_kernel_available()
        and mx.default_device() == mx.gpu
        and shape_supported(
            ids.shape,
            ids.dtype,
            layer["weight"].shape,
            layer["weight"].dtype,
            layer["scales"].dtype,
            layer.group_size,
            layer.bits,
        )
    )


def quantized_embedding(
    ids: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int
) -> mx.array:
    """Rows [*ids.shape, K] of a 4-bit table (weight [V, K/8] uint32, scales and biases [V, K/group_size]) in the
    scales' dtype; the caller checked `shape_supported` and that the kernel can run."""
    words = weight.shape[1]
    (out,) = _kernel()(
        inputs=[ids, weight, scales, biases],
        template=[("T", scales.dtype), ("GS", group_size), ("TPB", THREADS)],
        grid=(-(-words // THREADS) * THREADS, ids.size, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*ids.shape, words * 8)],
        output_dtypes=[scales.dtype],
    )
    return out


def half_shape_supported(ids_shape, ids_dtype, w_shape, w_dtype) -> bool:
    """Whether the 16-bit lookup handles these operands (`half_kernel_runs` adds the backend)."""
    size = math.prod(ids_shape)
    return (
        w_dtype in HALF_TYPES
        and len(w_shape) == 2
        and w_shape[1] % 8 == 0
        and ids_dtype in (mx.int32, mx.uint32)
        and 1 <= size <= MAX_IDS
    )


def half_kernel_runs(ids: mx.array, layer) -> bool:
    """Whether `layer(ids)` (a 16-bit nn.Embedding) can be this launch here."""
    weight = layer["weight"]
    return (
        cuda_kernel_available()
        and mx.default_device() == mx.gpu
        and half_shape_supported(ids.shape, ids.dtype, weight.shape, weight.dtype)
    )


def embedding(ids: mx.array, weight: mx.array) -> mx.array:
    """Rows [*ids.shape, K] of a 16-bit table [V, K]; the caller checked `half_shape_supported` and the backend."""
    chunks = weight.shape[1] // 8
    (out,) = _half_kernel()(
        inputs=[ids, weight],
        template=[("TPB", THREADS)],
        grid=(-(-chunks // THREADS) * THREADS, ids.size, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*ids.shape, weight.shape[1])],
        output_dtypes=[weight.dtype],
    )
    return out
