"""Where the 4-bit batch kernel's time goes (kernels/qmm.py, CUDA only): the kernel timed beside variants with one part
taken out, on Llama-3-8B's decode-batch products.

    python benchmarks/qmm_ablate.py                       # every variant, the four fused 8B shapes, 16/32/64 rows
    python benchmarks/qmm_ablate.py --rows 32 --variants full no_mma

A variant's results are wrong by design (only "full" is the kernel; its largest difference from MLX's product is
printed): each one removes a part and keeps the rest, so the time it saves bounds what that part costs:
  no_weights   the packed weights are not read (each warp makes its words from the group index)
  no_scales    the scales and biases are not read (constants)
  no_mma       no tensor-core product (the fragments are still built and folded into one accumulator)
  no_x         x is neither staged into shared memory nor reordered (the buffers keep what they hold)
  no_dequant   the nibbles go to the product as they are (no weight made q s + b)
  l2_weights   every block reads the first 64 rows' weights and scales (from L2 after the first: HBM's latency and
               bandwidth out of the way, the loads' count kept)
  no_prep      the block's pass over each staged chunk (x's reorder, and the barrier after it) left out; x is
               still staged
  d2           half a chunk of K staged at any row count, so a warp loads 2 groups of weights ahead instead of 4 (as
               past 32 rows): what the depth of the weight prefetch is worth
Candidates must give the kernel's products: their largest difference from MLX's is printed too.
  warps16      16 warps (256 weight rows) a block share one staged chunk of x, one block an SM: the kernel's own
               source, launched wider (8 warps against 4 won and is the kernel: archive/2026-12-05-h200-session-26/)
  warps4       the kernel's source at 4 warps a block, as before 8 won: at groups of 32 past 32 rows (--group-size 32
               --rows 64), where 8 warps take one block an SM (registers above 128), 4 took three
  two_blocks   the kernel with its registers capped for two blocks an SM at every row count: groups of 32 past 32 rows
               run one block an SM (qmm.MIN_BLOCKS_WIDE_G32), which the kernel needed before it made its weights in
               16 bits (it spilled at 128 registers; now 122, no spill, on sm_90)
Groups of 32 and 128 with --group-size (MLX's quantization of the same random weights).
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

from mlxcel_core.backends.cuda.kernels import matvec_config, qmm  # noqa: E402
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


def _prep_pass() -> str:
    """The block's pass that reorders each staged chunk of x, with the barrier after it."""
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
            "mlxcel_qmm_mma<T>(tot[nt], a, b);",
            "tot[nt][0] += __uint_as_float((a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1]) & 0x3fffffffu);",
        )
    ],
    "no_x": [
        ("p < M * PR; p += blockDim.x", "p < 0; p += blockDim.x"),
        ("i < min(CG, gend - g0) * NT * 8; i += blockDim.x", "i < 0; i += blockDim.x"),
    ],
    "l2_weights": [
        ("const int r0 = min(n0 + g, N - 1);", "const int r0 = min(n0 + g, N - 1) & 63;"),
        ("const int r1 = min(n0 + g + 8, N - 1);", "const int r1 = min(n0 + g + 8, N - 1) & 63;"),
    ],
    "d2": [("constexpr int CK = NT > 4 ? CHUNK_K / 2 : CHUNK_K;", "constexpr int CK = CHUNK_K / 2;")],
    "no_prep": [(_prep_pass(), "")],
    "no_dequant": [
        (
            f"mlxcel_qmm_dequant2<T, S>(mlxcel_qmm_pair4<T>({v}), s{r}, c{r}, ps[{r}], ps[{r + 2}])",
            f"mlxcel_qmm_pair4<T>({v})",
        )
        for v, r in [("v0", 0), ("v1", 1), ("v0 >> 4", 0), ("v1 >> 4", 1)]
    ],
    "warps16": [],  # (the kernel's source, launched with WARPS_OF's warps)
    "warps4": [],
    "two_blocks": [],  # (the kernel's source, its registers capped for BLOCKS_OF's blocks an SM at every row count)
}
# Candidates launched with other than qmm.WARPS warps a block (the kernel's own source)
WARPS_OF = {"warps16": 16, "warps4": 4}
# Candidates of the kernel's source and warps with their registers capped for this many blocks an SM at every launch
BLOCKS_OF = {"two_blocks": 2}


def variant_source(name: str) -> str:
    source = SOURCE
    for old, new in VARIANTS[name]:
        if old not in source:
            raise SystemExit(f"variant {name}: the kernel no longer has {old.strip()[:60]!r}: update qmm_ablate.py")
        source = source.replace(old, new)
    return source


def product(name: str, group_size: int = GROUP_SIZE):
    """The variant's x @ W.T: kernels/qmm.py's own launch and partial sums, its kernel built from the variant's
    source."""
    source = variant_source(name)
    header = HEADER  # (every variant edits the body only)
    tag = hashlib.sha256((header + source).encode()).hexdigest()[:8]

    base, warps = qmm.WARPS, WARPS_OF.get(name, qmm.WARPS)  # (qmm.WARPS is the candidate's while its call runs)

    @functools.cache
    def kernel(min_blocks: int = qmm.MIN_BLOCKS):
        return cuda_kernel(
            name=f"mlxcel_qmm_ablate_{name}_{tag}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["partial"],
            source=source,
            header=header,
            launch_bounds=(warps * 32, BLOCKS_OF.get(name) or max(1, min_blocks * base // warps)),
        )

    def fn(x, w, scales, biases):
        # (the call builds its lazy op with the kernel and launch shape it finds; launch_args caches by shape)
        # (and the split rule's rows a block: its target counts blocks of the candidate's width)
        own = qmm._kernel, qmm.WARPS, qmm.ROWS_PER_BLOCK, matvec_config.QMM_ROWS_PER_BLOCK
        qmm._kernel, qmm.WARPS, qmm.ROWS_PER_BLOCK = kernel, warps, 16 * warps
        matvec_config.QMM_ROWS_PER_BLOCK = 16 * warps
        qmm.launch_args.cache_clear()
        try:
            return qmm.quantized_matmul(x, w, scales, biases, group_size)
        finally:
            qmm._kernel, qmm.WARPS, qmm.ROWS_PER_BLOCK, matvec_config.QMM_ROWS_PER_BLOCK = own
            qmm.launch_args.cache_clear()

    return fn


def _cuda() -> bool:
    return mx.cuda.is_available() if hasattr(mx, "cuda") else False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    names = list(VARIANTS)
    p.add_argument("--variants", nargs="+", default=names, choices=names)
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, choices=[32, 64, 128])
    a = p.parse_args(argv)
    if not _cuda():
        print("qmm_ablate.py needs MLX's CUDA backend and a CUDA device", file=sys.stderr)
        return 1
    print(f"group size {a.group_size}")
    print(f"{'shape':<14} {'rows':>4} " + " ".join(f"{v:>17}" for v in a.variants))
    for shape, n, k in (s for s in SHAPES if s[0] in a.shapes):
        probe = make_weights(n, k, mx.bfloat16, 1, group_size=a.group_size)
        copies = max(2, math.ceil(3 * L2_BYTES / weight_bytes(*probe[0])))
        weights = probe + make_weights(n, k, mx.bfloat16, copies - 1, seed=1, group_size=a.group_size)
        gbytes = weight_bytes(*weights[0]) / 1e9
        for rows in a.rows:
            x = (mx.random.normal((rows, k), key=mx.random.key(rows)) * 0.5).astype(mx.bfloat16)
            cells, base, diffs = [], None, []
            for v in a.variants:
                fn = product(v, a.group_size)
                if v == "full" or v in WARPS_OF or v in BLOCKS_OF:  # (candidates: MLX's product, or near)
                    diffs.append(f"{v} {max_rel_diff(fn(x, *weights[0]), mlx_qmm(x, *weights[0])):.2e}")
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
