/* What blas_rows.c and blas_packed.c share, so that an element of x @ w.T has the same bits from either: the AVX2
 * and AVX-512 targets, the fixed tree that sums a dot product's eight lanes, and how a sum is stored (alpha s +
 * beta c). */
#ifndef MLXCEL_BLAS_ROWS_H
#define MLXCEL_BLAS_ROWS_H
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))
/* the AVX-512 blocks (blas_rows.c, blas_packed.c): two rows a register, each half an AVX2 register's lanes */
#define TARGET512 __attribute__((target("avx512f,avx512dq,avx2,fma")))

/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
TARGET static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

TARGET static inline void store_sum(float *out, float s, float alpha, float beta) {
  *out = alpha * s + (beta == 0.0f ? 0.0f : beta * *out);
}
#endif
#endif
