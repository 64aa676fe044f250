"""The experiment MLXCEL_QMM_W16 (settings.py; issue 42): the 4-bit batch kernel (kernels/qmm.py) with each weight
made whole in 16 bits before the tensor-core product.

The kernel (kernels/qmm_source.py) multiplies the raw nibbles q, then scales each group's float32 sums: s * (q . x) +
b * sum(x), which needs x's sums over every group (the block's pass over each staged chunk) and a scaling of the
accumulators a group. Here each pair of nibbles becomes q s + b in x's 16-bit type (one fused multiply-add, one
rounding, as a prompt's products read their dequantized weights: fast_linear.prompt_product) and the accumulators run
across all groups: no group sums, no per-group scaling. benchmarks/qmm_ablate.py times it as the `w16` candidate
(benchmarks/RESULTS.md, "Issue 42 experiments").

The text is the kernel's with the edits below, each of which must find its place: an edit of the kernel that moves
one fails here at import, not on the GPU."""

from __future__ import annotations

from .qmm_source import HEADER, SOURCE

# A pair of nibbles q (two exact 16-bit values, mlxcel_qmm_pair4) made q s + b, with s and b each a pair of one value
# (mlxcel_qmm_splat: a float in both halves, once a group).
W16_HEADER = r"""
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_qmm_splat(float v) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        __half2 h = __float2half2_rn(v);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    __nv_bfloat162 h = __float2bfloat162_rn(v);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_qmm_w16(uint32_t q, uint32_t s, uint32_t b) {
    if constexpr (mlxcel_qmv_same<T, __half>::value) {
        __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&q), *reinterpret_cast<const __half2*>(&s),
                            *reinterpret_cast<const __half2*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    } else {
        __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&q),
                                   *reinterpret_cast<const __nv_bfloat162*>(&s),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
        return *reinterpret_cast<uint32_t*>(&r);
    }
}
"""

EDITS = [  # (the kernel's text, its replacement)
    ("                float sum = 0.0f;\n", ""),  # (the block's pass keeps its reorder, loses its sums)
    (
        "                    sum += mlxcel_qmm_sum2<T>(lo.x) + mlxcel_qmm_sum2<T>(lo.y) + mlxcel_qmm_sum2<T>(hi.x)\n"
        "                           + mlxcel_qmm_sum2<T>(hi.y);\n",
        "",
    ),
    ("                xsum[c & 1][gc][m] = sum;\n", ""),
    (
        "                if (gi + D < gend) {\n",
        "                const uint32_t s0 = mlxcel_qmm_splat<T>(ps[0]), s1 = mlxcel_qmm_splat<T>(ps[1]);\n"
        "                const uint32_t c0 = mlxcel_qmm_splat<T>(ps[2]), c1 = mlxcel_qmm_splat<T>(ps[3]);\n"
        "                if (gi + D < gend) {\n",
    ),
    (
        "                float acc[NT][4];\n"
        "#pragma unroll\n"
        "                for (int nt = 0; nt < NT; ++nt) {\n"
        "                    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;\n"
        "                }\n",
        "                float (&acc)[NT][4] = tot;  // (one set of accumulators across the groups)\n",
    ),
    (
        "                    const uint32_t a[4] = {mlxcel_qmm_pair4<T>(v0), mlxcel_qmm_pair4<T>(v1),\n"
        "                                           mlxcel_qmm_pair4<T>(v0 >> 4), mlxcel_qmm_pair4<T>(v1 >> 4)};\n",
        "                    const uint32_t a[4] = {\n"
        "                        mlxcel_qmm_w16<T>(mlxcel_qmm_pair4<T>(v0), s0, c0),\n"
        "                        mlxcel_qmm_w16<T>(mlxcel_qmm_pair4<T>(v1), s1, c1),\n"
        "                        mlxcel_qmm_w16<T>(mlxcel_qmm_pair4<T>(v0 >> 4), s0, c0),\n"
        "                        mlxcel_qmm_w16<T>(mlxcel_qmm_pair4<T>(v1 >> 4), s1, c1)};\n",
    ),
    ("mlxcel_qmm_scale_sums<NT>(tot, acc, xsum[c & 1][gi - g0], ps[0], ps[1], ps[2], ps[3], t);", ""),
]


def _edited(text: str) -> str:
    for old, new in EDITS:
        if text.count(old) != 1:
            raise RuntimeError(f"kernels/qmm_w16.py: the 4-bit batch kernel no longer has {old.strip()[:60]!r} once")
        text = text.replace(old, new)
    return text


W16_SOURCE = _edited(SOURCE)
W16_FULL_HEADER = HEADER + W16_HEADER
