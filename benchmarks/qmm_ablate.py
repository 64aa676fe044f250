"""Where the 4-bit batch kernel's time goes (kernels/qmm.py, CUDA only): the kernel timed beside variants with one part
taken out, on Llama-3-8B's decode-batch products.

    python benchmarks/qmm_ablate.py                       # every variant, the four fused 8B shapes, 16/32/64 rows
    python benchmarks/qmm_ablate.py --rows 32 --variants full no_mma

A variant's results are wrong by design (only "full" is the kernel; its largest difference from MLX's product is
printed): each one removes a part and keeps the rest, so the time it saves bounds what that part costs:
  no_weights   the packed weights are not read (each warp makes its words from the group index)
  no_scales    the scales and biases are not read (constants)
  no_mma       no tensor-core product (the fragments are still built and folded into one accumulator)
  no_x         x is neither staged into shared memory nor summed (the buffers keep what they hold)
  no_epilogue  each group's products are added unscaled (no scale, no bias term)
  l2_weights   every block reads the first 64 rows' weights and scales (from L2 after the first: HBM's latency and
               bandwidth out of the way, the loads' count kept)
  no_prep      the block's pass over each staged chunk (x's group sums and reorder, and the barrier after it) left
               out; x is still staged
  d2           half a chunk of K staged at any row count, so a warp loads 2 groups of weights ahead instead of 4 (as
               past 32 rows): what the depth of the weight prefetch is worth
Beside them, candidates: whole kernels of another design, which must give MLX's product (their largest difference
from it is printed too):
  xprep        x reordered and summed over each group once a product, by MLX ops before the launch (counted in its
               time), instead of by every block after staging each chunk: the blocks stage x (rows split among the
               warps, no division a piece) and its sums with cp.async, and a chunk takes one barrier fewer
  xprep_kernel the same, x prepared by one small kernel (the block's pass on its own: the same sums bit for bit, so
               its product should equal full's exactly)
Timing as benchmarks/qmv.py's: calls one after another on one stream (no CUDA graphs), over enough copies of the
weights that each call reads them from HBM; GB/s counts the packed weights + scales + biases once a call.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # calls run one after another, as in a model (see qmv.py)

import mlx.core as mx  # noqa: E402
from qmv import GROUP_SIZE, L2_BYTES, make_weights, max_rel_diff, mlx_qmm, time_calls, weight_bytes  # noqa: E402

from mlxcel_core.backends.cuda.kernels import qmm  # noqa: E402
from mlxcel_core.backends.cuda.kernels.cubin_cache import cuda_kernel  # noqa: E402
from mlxcel_core.backends.cuda.kernels.qmm_source import HEADER, SOURCE  # noqa: E402

SHAPES = [  # (name, N, K): Llama-3-8B's decode-batch products as the fused layers run them
    ("q/k/v fused", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate/up fused", 28672, 4096),
    ("down_proj", 4096, 14336),
]
_FETCH_WORDS = """        mlxcel_qmm_words<WORDS>(q0, w0 + gg * (G / 8) + t * WORDS);
        mlxcel_qmm_words<WORDS>(q1, w1 + gg * (G / 8) + t * WORDS);
"""
_FETCH_SCALES = """        sc[0] = static_cast<float>(scales[size_t(r0) * NG + gg]);
        sc[1] = static_cast<float>(scales[size_t(r1) * NG + gg]);
        sc[2] = static_cast<float>(biases[size_t(r0) * NG + gg]);
        sc[3] = static_cast<float>(biases[size_t(r1) * NG + gg]);
"""
_SCALE_SUMS = "mlxcel_qmm_scale_sums<NT>(tot, acc, xsum[c & 1][gi - g0], ps[0], ps[1], ps[2], ps[3], t);"


def _stage_x() -> str:
    """The body of the kernel's stage() that copies x's chunk, after its first line."""
    start = SOURCE.index("        const int row_pieces = min(CG, gend - g0) * (G / 4);")
    return SOURCE[start : SOURCE.index('        asm volatile("cp.async.commit_group;', start)]


def _prep_pass() -> str:
    """The block's pass that sums and reorders each staged chunk of x, with the barrier after it."""
    start = SOURCE.index("        {  // once for the block's warps")
    end_text = "            __syncthreads();\n        }\n"
    return SOURCE[start : SOURCE.index(end_text, start) + len(end_text)]


VARIANTS = {  # name: (text of the kernel, its replacement), ...
    "full": [],
    "no_weights": [
        (
            _FETCH_WORDS,
            "        for (int i = 0; i < WORDS; ++i) {\n"
            "            q0[i] = 0x12345679u * (gg + i + r0);\n"
            "            q1[i] = q0[i] ^ 0x5a5a5a5au;\n"
            "        }\n",
        )
    ],
    "no_scales": [(_FETCH_SCALES, "        sc[0] = sc[1] = 0.01f * gg; sc[2] = sc[3] = 0.5f;\n")],
    "no_mma": [
        (
            "mlxcel_qmm_mma<T>(acc[nt], a, b);",
            "acc[nt][0] += __uint_as_float((a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1]) & 0x3fffffffu);",
        )
    ],
    "no_x": [
        ("p < M * row_pieces; p += blockDim.x", "p < 0; p += blockDim.x"),
        ("i < min(CG, gend - g0) * NT * 8; i += blockDim.x", "i < 0; i += blockDim.x"),
    ],
    "l2_weights": [
        ("const int r0 = min(n0 + g, N - 1);", "const int r0 = min(n0 + g, N - 1) & 63;"),
        ("const int r1 = min(n0 + g + 8, N - 1);", "const int r1 = min(n0 + g + 8, N - 1) & 63;"),
    ],
    "d2": [("constexpr int CK = NT > 4 ? CHUNK_K / 2 : CHUNK_K;", "constexpr int CK = CHUNK_K / 2;")],
    "no_prep": [(_prep_pass(), "")],
    "no_epilogue": [
        (
            _SCALE_SUMS,
            "for (int nt = 0; nt < NT; ++nt) { for (int i = 0; i < 4; ++i) { tot[nt][i] += acc[nt][i] * ps[0]; } }",
        )
    ],
}


_STAGE_X_AND_SUMS = """        const int cg = min(CG, gend - g0);
        const int row_pieces = cg * (G / 4);
        for (int m = warp; m < M; m += blockDim.x >> 5) {  // a warp's rows, its lanes' 8-byte pieces
            const T* src = x + size_t(m) * K + size_t(g0) * G;
            T* dst = &xsh[c & 1][m][0];
            for (int j = lane; j < row_pieces; j += 32) {
                if (whole) {
                    mlxcel_qmm_cp8(dst + 4 * j, src + 4 * j);
                } else {
                    dst[4 * j] = src[4 * j]; dst[4 * j + 1] = src[4 * j + 1];
                    dst[4 * j + 2] = src[4 * j + 2]; dst[4 * j + 3] = src[4 * j + 3];
                }
            }
        }
        for (int i = threadIdx.x; i < M * cg; i += blockDim.x) {
            const int m = i / cg;
            mlxcel_qmm_cp4(&xsum[c & 1][i - m * cg][m], xs + size_t(m) * NG + g0 + (i - m * cg));
        }
"""
_ZERO_ROWS = """        xsh[b][M + r / RS][r % RS] = T(0.0f);
    }
"""
_ZERO_SUMS = """    for (int i = threadIdx.x; i < 2 * CG * (NT * 8 - M); i += blockDim.x) {  // and their sums
        const int b = i / (CG * (NT * 8 - M));
        const int r = i - b * (CG * (NT * 8 - M));
        xsum[b][r / (NT * 8 - M)][M + r % (NT * 8 - M)] = 0.0f;
    }
"""
_CP4 = r"""
// 4 bytes global -> shared, asynchronously (as mlxcel_qmm_cp8).
__device__ __forceinline__ void mlxcel_qmm_cp4(void* dst, const void* src) {
    unsigned at;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(at) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(at), "l"(src) : "memory");
}
"""


_PREP = r"""
    // One thread a (row, group) of x: the group's 8-value runs reordered x0 x4 x1 x5 x2 x6 x3 x7 into xp, and their
    // float32 sum into xs, in the order and arithmetic of the block's pass in kernels/qmm_source.py.
    int M = 1;
    for (int d = 0; d < x_ndim - 1; ++d) {
        M *= x_shape[d];
    }
    const int K = x_shape[x_ndim - 1];
    const int NG = K / G;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= M * NG) {
        return;
    }
    const int m = i / NG;
    const size_t at = size_t(m) * K + size_t(i - m * NG) * G;
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x + at);
    uint16_t* out = reinterpret_cast<uint16_t*>(xp + at);
    float sum = 0.0f;
    for (int j = 0; j < G; j += 8) {
        const uint32_t lox = row[j] | (uint32_t(row[j + 1]) << 16), loy = row[j + 2] | (uint32_t(row[j + 3]) << 16);
        const uint32_t hix = row[j + 4] | (uint32_t(row[j + 5]) << 16), hiy = row[j + 6] | (uint32_t(row[j + 7]) << 16);
        sum += mlxcel_qmm_sum2<T>(lox) + mlxcel_qmm_sum2<T>(loy) + mlxcel_qmm_sum2<T>(hix) + mlxcel_qmm_sum2<T>(hiy);
        const uint32_t r[4] = {__byte_perm(lox, hix, 0x5410), __byte_perm(lox, hix, 0x7632),
                               __byte_perm(loy, hiy, 0x5410), __byte_perm(loy, hiy, 0x7632)};
        for (int k = 0; k < 4; ++k) {
            out[j + 2 * k] = uint16_t(r[k] & 0xFFFFu);
            out[j + 2 * k + 1] = uint16_t(r[k] >> 16);
        }
    }
    xs[size_t(m) * NG + (i - m * NG)] = sum;
"""


def prepared_x(x: mx.array, group_size: int) -> tuple[mx.array, mx.array]:
    """xprep's inputs by MLX ops: x's rows with each 8 values x0..x7 reordered x0 x4 x1 x5 x2 x6 x3 x7 (as the
    block's pass leaves them), [rows, K], and each row's float32 sum over each group, [rows, K / group_size]."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    reordered = rows.reshape(-1, k // 8, 2, 4).swapaxes(-1, -2).reshape(-1, k)
    sums = rows.astype(mx.float32).reshape(rows.shape[0], -1, group_size).sum(axis=-1)
    return reordered, sums


@functools.cache
def _prep_kernel():
    return cuda_kernel(
        name=f"mlxcel_qmm_prep_{hashlib.sha256((HEADER + _PREP).encode()).hexdigest()[:8]}",
        input_names=["x"],
        output_names=["xp", "xs"],
        source=_PREP,
        header=HEADER,
    )


def prepared_x_kernel(x: mx.array, group_size: int) -> tuple[mx.array, mx.array]:
    """prepared_x's two arrays from one launch of _PREP (the block's pass as its own small kernel, the same sums bit
    for bit)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    threads = rows.shape[0] * (k // group_size)
    return _prep_kernel()(
        inputs=[rows],
        template=[("T", x.dtype), ("G", group_size)],
        grid=(-(-threads // 128) * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[rows.shape, (rows.shape[0], k // group_size)],
        output_dtypes=[x.dtype, mx.float32],
    )


_XPREP = [(_stage_x(), _STAGE_X_AND_SUMS), (_ZERO_ROWS, _ZERO_ROWS + _ZERO_SUMS), (_prep_pass(), "")]
CANDIDATES = {  # name: (edits of the kernel, header added, extra inputs, how x is prepared)
    "xprep": (_XPREP, _CP4, ["xs"], prepared_x),
    "xprep_kernel": (_XPREP, _CP4, ["xs"], prepared_x_kernel),
}


def candidate_source(name: str) -> tuple[str, str]:
    """(header, body) of a candidate kernel."""
    edits, header = CANDIDATES[name][:2]
    source = SOURCE
    for old, new in edits:
        if old not in source:
            raise SystemExit(f"candidate {name}: the kernel no longer has {old.strip()[:60]!r}: update qmm_ablate.py")
        source = source.replace(old, new)
    return HEADER + header, source


def candidate(name: str):
    """The candidate's x @ W.T: qmm.launch_args' launch, blocks an SM and partial sums as kernels/qmm.py's
    quantized_matmul makes them (repeated here: the candidate takes other inputs), x prepared as the candidate says."""
    header, source = candidate_source(name)
    extra, prepare = CANDIDATES[name][2:]
    tag = hashlib.sha256((header + source).encode()).hexdigest()[:8]

    @functools.cache
    def kernel(min_blocks: int):
        return cuda_kernel(
            name=f"mlxcel_qmm_candidate_{name}_{tag}",
            input_names=["x", "w", "scales", "biases", *extra],
            output_names=["partial"],
            source=source,
            header=header,
            launch_bounds=(qmm.WARPS * 32, min_blocks),
        )

    def fn(x, w, scales, biases):
        n, k = w.shape[0], w.shape[1] * 8
        rows = x.size // k
        args = qmm.launch_args(x.shape, x.dtype, scales.dtype, n, k, GROUP_SIZE)
        reordered, sums = prepare(x, GROUP_SIZE)
        narrow = rows <= qmm.NARROW_ROWS or GROUP_SIZE > 32
        own = kernel(qmm.MIN_BLOCKS if narrow else qmm.MIN_BLOCKS_WIDE_G32)
        partial = own(inputs=[reordered.reshape(x.shape), w, scales, biases, sums], **args)[0]
        y = partial[0] if partial.shape[0] == 1 else partial.sum(axis=0)
        return y.astype(mx.result_type(x.dtype, scales.dtype)).reshape(*x.shape[:-1], n)

    return fn


def variant_source(name: str) -> str:
    source = SOURCE
    for old, new in VARIANTS[name]:
        if old not in source:
            raise SystemExit(f"variant {name}: the kernel no longer has {old.strip()[:60]!r}: update qmm_ablate.py")
        source = source.replace(old, new)
    return source


def product(name: str):
    """The variant's x @ W.T: kernels/qmm.py's own launch and partial sums, its kernel built from the variant's
    source."""
    source = variant_source(name)
    tag = hashlib.sha256((HEADER + source).encode()).hexdigest()[:8]

    @functools.cache
    def kernel(min_blocks: int = qmm.MIN_BLOCKS):
        return cuda_kernel(
            name=f"mlxcel_qmm_ablate_{name}_{tag}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["partial"],
            source=source,
            header=HEADER,
            launch_bounds=(qmm.WARPS * 32, min_blocks),
        )

    def fn(x, w, scales, biases):
        own, qmm._kernel = qmm._kernel, kernel  # (the call builds its lazy op with the kernel it finds)
        try:
            return qmm.quantized_matmul(x, w, scales, biases, GROUP_SIZE)
        finally:
            qmm._kernel = own

    return fn


def _cuda() -> bool:
    return mx.cuda.is_available() if hasattr(mx, "cuda") else False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    names = [*VARIANTS, *CANDIDATES]
    p.add_argument("--variants", nargs="+", default=names, choices=names, help="variants and candidates")
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if not _cuda():
        print("qmm_ablate.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 1
    print(f"{'shape':<14} {'rows':>4} " + " ".join(f"{v:>17}" for v in a.variants))
    for shape, n, k in (s for s in SHAPES if s[0] in a.shapes):
        probe = make_weights(n, k, mx.bfloat16, 1)
        copies = max(2, math.ceil(3 * L2_BYTES / weight_bytes(*probe[0])))
        weights = probe + make_weights(n, k, mx.bfloat16, copies - 1, seed=1)
        gbytes = weight_bytes(*weights[0]) / 1e9
        for rows in a.rows:
            x = (mx.random.normal((rows, k), key=mx.random.key(rows)) * 0.5).astype(mx.bfloat16)
            cells, base, diffs, full = [], None, [], product("full")(x, *weights[0])
            for v in a.variants:
                fn = candidate(v) if v in CANDIDATES else product(v)
                if v == "full" or v in CANDIDATES:  # (the kernels that must give MLX's product)
                    y = fn(x, *weights[0])
                    same = "" if v == "full" else f" ({'=' if mx.array_equal(y, full).item() else '!='} full)"
                    diffs.append(f"{v} {max_rel_diff(y, mlx_qmm(x, *weights[0])):.2e}{same}")
                seconds, _ = time_calls(fn, x, weights, a.calls, a.reps)
                base = seconds if v == "full" else base
                ratio = f" {seconds / base:.2f}x" if base and v != "full" else ""
                cells.append(f"{seconds * 1e6:7.1f}us {gbytes / seconds:5.0f}GB/s{ratio}")
            print(f"{shape:<14} {rows:>4} " + " | ".join(cells))
            if diffs:
                print(f"{'':<14} {'':>4} vs MLX, max rel diff: " + ", ".join(diffs))
        del weights, probe
    return 0


if __name__ == "__main__":
    sys.exit(main())
