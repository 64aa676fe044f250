"""4-bit quantized matrix-vector product for decode (a few rows of x) as one CUDA kernel (``mx.fast.cuda_kernel``).

    y = quantized_matvec(x, w, scales, biases, group_size=64, bits=4)   # == x @ dequantize(w).T

Same contract as ``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` in MLX's affine
mode: x [..., K] (float16, bfloat16 or float32), w [N, K/8] uint32 with element j of a word in bits [4j, 4j+4)
(what ``mx.quantize(..., bits=4)`` packs), scales and biases [N, K/group_size]; weight (n, k) is
q * scales[n, k // group_size] + biases[n, k // group_size]. y [..., N] has MLX's result dtype
(``mx.result_type(x, scales)``: x's dtype in a model). The kernel runs where `supports` says so: MLX on CUDA,
bits 4, group size 32/64/128, K a multiple of 32, at most MAX_ROWS rows of x; anything else (and every call on
CPU or Metal) is ``mx.quantized_matmul`` itself, so the result there is MLX's, bit for bit.

Kernel ("mlxcel_qmv"): one thread block of WARPS x 32 threads per ROWS consecutive output rows. Lane l of warp v
takes 32-element chunks of K at k = (v * 32 + l) * 32 + i * WARPS * 1024, i.e. one 16-byte load (a uint4: 4 words,
32 nibbles) per weight row per chunk, the warp's 32 loads contiguous along K (coalesced 512 bytes), UNROLL chunks'
loads issued before any is used. A chunk lies inside one quantization group, so per chunk and row the lane reads
one scale and one bias and uses
    sum_k x_k (q_k s + b) = s * sum_k x_k q_k + b * sum_k x_k,
where sum_k x_k is shared by all ROWS rows. Dequantization costs one LOP3 per two nibbles: (word & 0x000F000F) |
0x64006400 is the fp16 pair (1024 + q_0, 1024 + q_4); (word & 0x00F000F0) | 0x54005400 is (64 + q_1, 64 + q_5)
(0x5400 is 64.0, whose mantissa unit is 1/16, so a nibble in bits 4-7 reads as q); word >> 8 gives nibbles 2,6
and 3,7 the same way. The pairs are widened to float32 and multiplied with x in float32; the constant offsets
(1024 for even nibbles, 64 for odd ones) are removed once per chunk, sum x (O + q) - (1024 sum_even x + 64
sum_odd x) (exact in real arithmetic; in float32 it costs a few ulps of 1024 |x| per chunk, far below the output's
fp16/bf16 rounding). A float32 output (x or scales float32) instead subtracts the offset from each weight, exactly,
before the multiply: float32 models get float32 accuracy. All of x's rows (M <= MAX_ROWS) are handled by the same launch, reusing each loaded word M
times. Accumulation is float32 throughout; a warp-shuffle reduction, then one shared-memory sum across the WARPS
warps, then one write per output.

The kernel is compiled (NVRTC, by MLX) once per (dtypes, M, group size, ROWS, WARPS, UNROLL) -- the five ints
travel packed in one template argument, CFG, as MLX converts and formats every template argument on every call;
N and K are runtime values. Its name carries a hash of the source, because MLX caches compiled kernels on disk by name
(MLX_PTX_CACHE_DIR, default /tmp/mlx/<version>/ptx): an edited source must not load a stale binary.

Validated by tests/mlxcel_core/kernels/test_qmv.py (the kernel tests are skipped without CUDA); timed by
benchmarks/qmv.py.
"""

from __future__ import annotations

import functools
import hashlib

import mlx.core as mx

from ..kv.cuda_paged_attention import cuda_kernel_available

MAX_ROWS = 8  # rows of x one launch handles (decode batch); more rows go to mx.quantized_matmul
GROUP_SIZES = (32, 64, 128)
BITS = 4
CHUNK = 32  # elements of K per lane per chunk (one uint4 of packed weights)
FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)

_HEADER = r"""
// mx.result_type for {float16, bfloat16, float32}: the same type, else float32.
template <typename A, typename B>
struct mlxcel_qmv_result {
    using type = float;
};
template <typename A>
struct mlxcel_qmv_result<A, A> {
    using type = A;
};
template <typename A, typename B>
struct mlxcel_qmv_same {
    static constexpr bool value = false;
};
template <typename A>
struct mlxcel_qmv_same<A, A> {
    static constexpr bool value = true;
};
template <typename P>
struct mlxcel_qmv_pointee;
template <typename A>
struct mlxcel_qmv_pointee<A*> {
    using type = A;
};

// 16 bytes of packed weights (32 nibbles), streamed: read once, so marked evict-first.
__device__ __forceinline__ uint4 mlxcel_qmv_load_w(const uint32_t* p, bool vec) {
    if (vec) {
        return __ldcs(reinterpret_cast<const uint4*>(p));
    }
    return make_uint4(p[0], p[1], p[2], p[3]);
}

__device__ __forceinline__ uint32_t mlxcel_qmv_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Nibbles 0 and 4 of v (bits 0-3 and 16-19) as the floats (1024 + q0, 1024 + q4).
__device__ __forceinline__ float2 mlxcel_qmv_even(uint32_t v) {
    const uint32_t h = (v & 0x000F000Fu) | 0x64006400u;
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Nibbles 1 and 5 of v (bits 4-7 and 20-23) as the floats (64 + q1, 64 + q5).
__device__ __forceinline__ float2 mlxcel_qmv_odd(uint32_t v) {
    const uint32_t h = (v & 0x00F000F0u) | 0x54005400u;
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Eight consecutive activations as float; 16-byte loads when the row is aligned.
template <typename T>
__device__ __forceinline__ void mlxcel_qmv_load_x(const T* p, float* out, bool vec) {
    alignas(16) T t[8];
    if (vec) {
#pragma unroll
        for (int j = 0; j < int(8 * sizeof(T) / 16); ++j) {
            reinterpret_cast<uint4*>(t)[j] = reinterpret_cast<const uint4*>(p)[j];
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            t[j] = p[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = static_cast<float>(t[j]);
    }
}
"""

_SOURCE = r"""
    // One int template argument carries the launch configuration (fewer arguments: less host time per call).
    constexpr int M = CFG & 15;  // rows of x
    constexpr int GS = (CFG >> 4) & 255;  // group size
    constexpr int ROWS = (CFG >> 12) & 15;  // output rows per block
    constexpr int WARPS = (CFG >> 16) & 15;  // warps per block (splitting K)
    constexpr int UNROLL = (CFG >> 20) & 15;  // chunks per lane whose loads are in flight together
    using OUT = typename mlxcel_qmv_result<T, S>::type;  // mx.result_type(x, scales)
    // A float32 output removes the offsets per element (exact): per chunk, their cancellation costs ~1e-5 of
    // |x| @ |W|.T, below fp16/bf16 rounding but 100x float32's.
    constexpr bool EXACT = mlxcel_qmv_same<OUT, float>::value;
    static_assert(mlxcel_qmv_same<OUT, typename mlxcel_qmv_pointee<decltype(/*OUT0*/)>::type>::value,
                  "output dtype must be mx.result_type(x, scales)");
    constexpr int CHUNK = 32;
    constexpr int STRIDE = WARPS * 32 * CHUNK;  // K covered by one round of the block's lanes
    const int N = w_shape[0];
    const int K = w_shape[1] * 8;  // x is M rows of K (any leading shape: only its data is read)
    const int KW = K / 8;  // packed words per weight row
    const int G = K / GS;  // groups per weight row
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
/*ROWS_OF_BLOCK*/

    const bool w_vec = (reinterpret_cast<size_t>(w) & 15) == 0;  // rows are K/2 bytes apart: 16-byte multiples
    const bool x_vec = (reinterpret_cast<size_t>(x) & 15) == 0;

    const uint32_t* w_row[ROWS];
    const S* s_row[ROWS];
    const S* b_row[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
/*ROW_MAP*/
        w_row[r] = w + n * KW;
        s_row[r] = scales + n * G;
        b_row[r] = biases + n * G;
    }

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[r][m] = 0.0f;
        }
    }

    for (int k0 = (wid * 32 + lane) * CHUNK; k0 < K; k0 += UNROLL * STRIDE) {
        // Every load of the UNROLL chunks first (weights, scales, biases), then the arithmetic.
        uint4 q[UNROLL][ROWS];
        float s[UNROLL][ROWS];
        float b[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (k < K) {
                    q[u][r] = mlxcel_qmv_load_w(w_row[r] + k / 8, w_vec);
                    s[u][r] = static_cast<float>(s_row[r][k / GS]);
                    b[u][r] = static_cast<float>(b_row[r][k / GS]);
                } else {
                    q[u][r] = make_uint4(0u, 0u, 0u, 0u);
                    s[u][r] = 0.0f;
                    b[u][r] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * STRIDE;
            if (k < K) {
                float part[ROWS][M];  // sum over the chunk of x * (offset + q)
                float xs[M];  // sum of x over the chunk
                float xo[M];  // sum of x * offset over the chunk
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    xs[m] = 0.0f;
                    xo[m] = 0.0f;
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        part[r][m] = 0.0f;
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // word i of the uint4: elements k + 8i .. k + 8i + 7
                    float xv[M][8];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        mlxcel_qmv_load_x(x + size_t(m) * K + k + 8 * i, xv[m], x_vec);
                        const float se = (xv[m][0] + xv[m][2]) + (xv[m][4] + xv[m][6]);
                        const float so = (xv[m][1] + xv[m][3]) + (xv[m][5] + xv[m][7]);
                        xs[m] += se + so;
                        if (!EXACT) {
                            xo[m] = fmaf(1024.0f, se, fmaf(64.0f, so, xo[m]));
                        }
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        const uint32_t word = mlxcel_qmv_word(q[u][r], i);
                        const uint32_t w8 = word >> 8;
                        float2 v04 = mlxcel_qmv_even(word);  // elements 0, 4 (offset 1024)
                        float2 v15 = mlxcel_qmv_odd(word);  // elements 1, 5 (offset 64)
                        float2 v26 = mlxcel_qmv_even(w8);  // elements 2, 6 (offset 1024)
                        float2 v37 = mlxcel_qmv_odd(w8);  // elements 3, 7 (offset 64)
                        if (EXACT) {  // (O + q) - O is exact in float32
                            v04 = make_float2(v04.x - 1024.0f, v04.y - 1024.0f);
                            v15 = make_float2(v15.x - 64.0f, v15.y - 64.0f);
                            v26 = make_float2(v26.x - 1024.0f, v26.y - 1024.0f);
                            v37 = make_float2(v37.x - 64.0f, v37.y - 64.0f);
                        }
#pragma unroll
                        for (int m = 0; m < M; ++m) {
                            float p = part[r][m];
                            p = fmaf(xv[m][0], v04.x, p);
                            p = fmaf(xv[m][1], v15.x, p);
                            p = fmaf(xv[m][2], v26.x, p);
                            p = fmaf(xv[m][3], v37.x, p);
                            p = fmaf(xv[m][4], v04.y, p);
                            p = fmaf(xv[m][5], v15.y, p);
                            p = fmaf(xv[m][6], v26.y, p);
                            p = fmaf(xv[m][7], v37.y, p);
                            part[r][m] = p;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        acc[r][m] = fmaf(s[u][r], part[r][m] - xo[m], fmaf(b[u][r], xs[m], acc[r][m]));
                    }
                }
            }
        }
    }

    // Sum over the warp's lanes, then over the block's warps; one write per (row of x, output).
    __shared__ float red[WARPS][ROWS * M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, o);
            }
            if (lane == 0) {
                red[wid][r * M + m] = v;
            }
        }
    }
    __syncthreads();
/*EPILOGUE*/
"""

# The block's weight rows: ROWS consecutive rows (plain and qkv), or ROWS / 2 rows of the gate half and the same rows
# of the up half (swiglu: the weight is [gate; up], N = 2 * NOUT). A block's rows past the end read the last row and
# write nothing.
_ROWS_CONSECUTIVE = """    const int n0 = blockIdx.x * ROWS;"""
_ROW_MAP_CONSECUTIVE = """        const size_t n = size_t(min(n0 + r, N - 1));"""
_ROWS_GATE_UP = """    constexpr int HALF = ROWS / 2;
    static_assert(ROWS % 2 == 0, "swiglu blocks take rows in gate/up pairs");
    const int NOUT = N / 2;
    const int n0 = blockIdx.x * HALF;  // first output (gate/up row pair) of this block"""
_ROW_MAP_GATE_UP = """        const int j = min(n0 + r % HALF, NOUT - 1);
        const size_t n = size_t(r < HALF ? j : NOUT + j);"""

# One output per weight row: the block's sums, then WRITE stores t, weight row n's output for row m of x.
_EPILOGUE_ROWS = """    for (int i = threadIdx.x; i < ROWS * M; i += WARPS * 32) {
        const int r = i / M;
        const int m = i % M;
        const int n = n0 + r;
        if (n < N) {
            float t = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                t += red[v][i];
            }
/*WRITE*/
        }
    }"""
# y [M, N].
_EPILOGUE_PLAIN = _EPILOGUE_ROWS.replace("/*WRITE*/", "            y[size_t(m) * N + n] = static_cast<OUT>(t);")
# Weight rows [0, NQ) -> q_out [M, NQ], [NQ, NQ + NK) -> k_out [M, NK], the rest -> v_out [M, NK].
_EPILOGUE_QKV = _EPILOGUE_ROWS.replace("/*WRITE*/", """            const OUT o = static_cast<OUT>(t);
            if (n < NQ) {
                q_out[size_t(m) * NQ + n] = o;
            } else if (n < NQ + NK) {
                k_out[size_t(m) * NK + (n - NQ)] = o;
            } else {
                v_out[size_t(m) * NK + (n - NQ - NK)] = o;
            }""")

# y [M, N] = residual + x @ w.T: the product rounded to OUT first, as the separate matvec returns it, then the add
# in float32 and one rounding to OUT, as a separate add computes it.
_EPILOGUE_RESIDUAL = _EPILOGUE_ROWS.replace("/*WRITE*/", """            const size_t o = size_t(m) * N + n;
            y[o] = static_cast<OUT>(static_cast<float>(static_cast<OUT>(t)) + static_cast<float>(residual[o]));""")

# y [M, NOUT] = silu(gate) * up. gate and up are first rounded to OUT, as two separate matvecs would return them,
# then silu(g) * u = g * sigmoid(g) * u in float32 and one rounding (the unfused path rounds after every op).
_EPILOGUE_SWIGLU = """    for (int i = threadIdx.x; i < HALF * M; i += WARPS * 32) {
        const int r = i / M;
        const int m = i % M;
        const int j = n0 + r;
        if (j < NOUT) {
            float g = 0.0f;
            float u = 0.0f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                g += red[v][r * M + m];
                u += red[v][(r + HALF) * M + m];
            }
            g = static_cast<float>(static_cast<OUT>(g));
            u = static_cast<float>(static_cast<OUT>(u));
            y[size_t(m) * NOUT + j] = static_cast<OUT>(g / (1.0f + expf(-g)) * u);
        }
    }"""

# mode -> (inputs after x, w, scales, biases; output names, block rows, row map, epilogue)
MODES = {
    "plain": ((), ("y",), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_PLAIN),
    "qkv": ((), ("q_out", "k_out", "v_out"), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_QKV),
    "swiglu": ((), ("y",), _ROWS_GATE_UP, _ROW_MAP_GATE_UP, _EPILOGUE_SWIGLU),
    "residual": (("residual",), ("y",), _ROWS_CONSECUTIVE, _ROW_MAP_CONSECUTIVE, _EPILOGUE_RESIDUAL),
}


def kernel_source(mode: str = "plain") -> str:
    """The kernel body for `mode`: plain y = x @ w.T; qkv the same split into three outputs by weight row ranges
    (template ints NQ, NK); swiglu silu(x @ gate.T) * (x @ up.T) for w = [gate; up]; residual y = residual +
    x @ w.T (residual [M, N], of the output's dtype)."""
    _, outputs, block_rows, row_map, epilogue = MODES[mode]
    return (_SOURCE.replace("/*OUT0*/", outputs[0]).replace("/*ROWS_OF_BLOCK*/", block_rows)
            .replace("/*ROW_MAP*/", row_map).replace("/*EPILOGUE*/", epilogue))

def kernel_name(mode: str = "plain") -> str:
    """Carries a hash of the source: MLX caches compiled kernels on disk by name."""
    digest = hashlib.sha256(f"{_HEADER}{kernel_source(mode)}".encode()).hexdigest()[:8]
    return f"mlxcel_qmv_{digest}" if mode == "plain" else f"mlxcel_qmv_{mode}_{digest}"


KERNEL_NAME = kernel_name()


@functools.cache
def _kernel(mode: str = "plain"):
    return mx.fast.cuda_kernel(
        name=kernel_name(mode),
        input_names=["x", "w", "scales", "biases", *MODES[mode][0]],
        output_names=list(MODES[mode][1]),
        source=kernel_source(mode),
        header=_HEADER,
    )


def rows_of(x_shape) -> int:
    """Rows of x (every leading dimension): what one launch multiplies by the weight."""
    rows = 1
    for d in x_shape[:-1]:
        rows *= d
    return rows


def shape_supported(x_shape, x_dtype, w_shape, w_dtype, scales_shape, scales_dtype, biases_shape, biases_dtype,
                    group_size: int, bits: int) -> bool:
    """Whether the kernel handles these operands (shapes and dtypes only; `supports` adds the backend)."""
    if bits != BITS or group_size not in GROUP_SIZES or biases_shape is None:
        return False
    if len(w_shape) != 2 or w_dtype != mx.uint32 or len(x_shape) < 1:
        return False
    n, k = w_shape[0], w_shape[1] * 8
    if n < 1 or k < 1 or k % CHUNK or k % group_size or x_shape[-1] != k:
        return False
    groups = (n, k // group_size)
    if tuple(scales_shape) != groups or tuple(biases_shape) != groups:
        return False
    if x_dtype not in FLOAT_TYPES or scales_dtype not in FLOAT_TYPES or biases_dtype != scales_dtype:
        return False
    return 1 <= rows_of(x_shape) <= MAX_ROWS


def kernel_ready() -> bool:
    """MLX has a usable CUDA device and computes on it by default (the kernel runs on the GPU only)."""
    return cuda_kernel_available() and mx.default_device() == mx.gpu


def supports(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int = 64,
             bits: int = 4) -> bool:
    """True when `quantized_matvec` runs the CUDA kernel for these operands (else it is mx.quantized_matmul)."""
    if biases is None or not kernel_ready():
        return False
    return shape_supported(x.shape, x.dtype, w.shape, w.dtype, scales.shape, scales.dtype, biases.shape,
                           biases.dtype, group_size, bits)


def launch_config(n: int, k: int, m: int) -> tuple[int, int, int]:
    """(ROWS, WARPS, UNROLL) for an N x K weight and m rows of x.

    ROWS output rows per block: 8 for long rows (K > 4096) or very many of them (N > 16384), else 4. WARPS warps per
    block split K (each warp keeps at least one whole 1024-element round of K) until the grid has about 2048 warps
    (~16 per SM on an H200). UNROLL 1. This reproduces the fastest configuration benchmarks/qmv.py --sweep found on
    the H200 (an earlier build of this kernel, M=1) for 4096x4096 (4,2,1), 14336x4096 (4,1,1), 4096x14336 (8,4,1)
    and 128256x4096 (8,1,1); for 1024x4096 it found (8,2,1), 1.1x this rule's (4,4,1). UNROLL 2 never won there
    (its registers cost occupancy). Re-run the sweep after changing the kernel."""
    rows = 8 if k > 4096 or n > 16384 else 4
    blocks = -(-n // rows)
    warps = 1
    while warps < 8 and blocks * warps < 2048 and k >= warps * 2 * 32 * CHUNK:
        warps *= 2
    return rows, warps, 1


def pack_config(m: int, group_size: int, rows: int, warps: int, unroll: int) -> int:
    """The kernel's one int template argument CFG (unpacked at the top of _SOURCE)."""
    return m | group_size << 4 | rows << 12 | warps << 16 | unroll << 20


@functools.lru_cache(maxsize=4096)
def launch_args(x_shape: tuple, x_dtype, s_dtype, n: int, group_size: int, config: tuple | None = None,
                max_rows: int = MAX_ROWS, mode: str = "plain", split: tuple[int, int] | None = None) -> dict | None:
    """Everything but the inputs of one launch (cached: a decode step makes hundreds of calls with few shapes),
    or None when x does not suit the kernel (more than max_rows rows, none, or not a float type).

    n is the weight's rows. mode "qkv" takes split = (NQ, NK), n = NQ + 2 NK; "swiglu" writes n / 2 outputs."""
    m = rows_of(x_shape)
    if not 1 <= m <= max_rows or x_dtype not in FLOAT_TYPES:
        return None
    rows, warps, unroll = config or launch_config(n, x_shape[-1], m)
    out_dtype = mx.result_type(x_dtype, s_dtype)
    threads = warps * 32
    template = [("T", x_dtype), ("S", s_dtype), ("CFG", pack_config(m, group_size, rows, warps, unroll))]
    blocks = -(-n // rows)
    if mode == "qkv":
        nq, nk = split
        if nq + 2 * nk != n:
            raise ValueError(f"qkv split {split} does not add up to the weight's {n} rows")
        template += [("NQ", nq), ("NK", nk)]
        outputs = [nq, nk, nk]
    elif mode == "swiglu":
        if n % 2 or rows % 2:
            raise ValueError(f"swiglu needs an even number of weight rows and of rows per block, got {n}, {rows}")
        outputs = [n // 2]
        blocks = -(-(n // 2) // (rows // 2))  # a block reads rows / 2 gate/up row pairs
    else:
        outputs = [n]
    return dict(
        template=template,
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*x_shape[:-1], width) for width in outputs],
        output_dtypes=[out_dtype] * len(outputs),
    )


def launch(args: dict, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, mode: str = "plain",
           extra: tuple = ()):
    """Run the kernel with `launch_args`' result: y for plain, swiglu and residual (`extra` = (residual,)),
    [q, k, v] for qkv."""
    outputs = _kernel(mode)(inputs=[x, w, scales, biases, *extra], **args)
    return outputs if mode == "qkv" else outputs[0]


def cuda_quantized_matvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64,
                          config: tuple[int, int, int] | None = None) -> mx.array:
    """The kernel itself (CUDA only; the caller has checked `supports`). `config` (ROWS, WARPS, UNROLL)
    overrides `launch_config`."""
    args = launch_args(x.shape, x.dtype, scales.dtype, w.shape[0], group_size, config)
    if args is None:
        raise ValueError(f"the 4-bit matvec kernel takes 1..{MAX_ROWS} rows of float16/bfloat16/float32, "
                         f"got x of shape {x.shape} and {x.dtype}")
    return launch(args, x, w, scales, biases)


def quantized_matvec(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int = 64,
                     bits: int = 4) -> mx.array:
    """x @ dequantize(w, scales, biases).T: the CUDA kernel when `supports`, else mx.quantized_matmul."""
    if supports(x, w, scales, biases, group_size, bits):
        return cuda_quantized_matvec(x, w, scales, biases, group_size)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits)
