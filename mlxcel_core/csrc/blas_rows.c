/* Row-major C[M,N] = alpha A[M,K] B[N,K]^T + beta C (x @ w.T: every linear layer's product; blas_tiles.c copies
 * the other forms into this one) with AVX2 and FMA, without OpenBLAS and without tiles.
 *
 * Each element of C is one dot product computed the same way wherever its row is: eight lanes accumulate k = 0, 8,
 * 16, ... (lane l takes k = l mod 8) with fused multiply-adds in order, the lanes are summed in a fixed tree, then the
 * k % 8 tail is added one fused multiply-add at a time. The blocking (4 rows x 3 columns, 4 x 8 where the CPU has
 * AVX-512, 1 row x 8, and their edges) and the threads (whole column blocks each) only decide which elements are
 * computed together, never how one is, so a row's result is the same alone or in a batch of any size by
 * construction. Nothing is packed: a decode step streams each weight from memory once, where OpenBLAS copies it into
 * its panel format at every call. */
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "blas_rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <math.h>

#define LD(p_) _mm256_loadu_ps(p_)
#define FMA(x_, w_, c_) c_ = _mm256_fmadd_ps(x_, w_, c_)
#define Z _mm256_setzero_ps()
#define ARGS const float *a, int lda, const float *b, int ldb, int k, float alpha, float beta, float *c, int ldc
#define FINISH(mr, nr, ...)                                                                                           \
  {                                                                                                                   \
    __m256 acc[] = {__VA_ARGS__};                                                                                     \
    finish(acc, mr, nr, a, lda, b, ldb, p, k, alpha, beta, c, ldc);                                                   \
  }
#define COLUMN_BLOCK 24 /* columns a thread takes at a time: 24 rows of w (55 KB at k = 576) stay in L2 */
#define PARALLEL_WORK 200000L /* m n k below which one thread computes the product */

/* c[i][j] = alpha (lanes of acc[i][j] summed, then the tail k = p..k-1) + beta c[i][j] */
TARGET static void finish(const __m256 *acc, int mr, int nr, const float *a, int lda, const float *b, int ldb, int p,
                          int k, float alpha, float beta, float *c, int ldc) {
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float s = lanes_sum(acc[i * nr + j]);
      for (int q = p; q < k; q++) s = fmaf(a[(size_t)i * lda + q], b[(size_t)j * ldb + q], s);
      store_sum(c + (size_t)i * ldc + j, s, alpha, beta);
    }
}

TARGET static void rows4_cols3(ARGS) {
  __m256 c00 = Z, c01 = Z, c02 = Z, c10 = Z, c11 = Z, c12 = Z, c20 = Z, c21 = Z, c22 = Z, c30 = Z, c31 = Z, c32 = Z;
  const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda, *b1 = b + ldb, *b2 = b1 + ldb;
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    __m256 w0 = LD(b + p), w1 = LD(b1 + p), w2 = LD(b2 + p), x;
    x = LD(a + p), FMA(x, w0, c00), FMA(x, w1, c01), FMA(x, w2, c02);
    x = LD(a1 + p), FMA(x, w0, c10), FMA(x, w1, c11), FMA(x, w2, c12);
    x = LD(a2 + p), FMA(x, w0, c20), FMA(x, w1, c21), FMA(x, w2, c22);
    x = LD(a3 + p), FMA(x, w0, c30), FMA(x, w1, c31), FMA(x, w2, c32);
  }
  FINISH(4, 3, c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32)
}

TARGET static void rows4_cols1(ARGS) {
  __m256 c0 = Z, c1 = Z, c2 = Z, c3 = Z;
  const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda;
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    __m256 w = LD(b + p);
    FMA(LD(a + p), w, c0), FMA(LD(a1 + p), w, c1), FMA(LD(a2 + p), w, c2), FMA(LD(a3 + p), w, c3);
  }
  FINISH(4, 1, c0, c1, c2, c3)
}

TARGET static void rows1_cols8(ARGS) {
  __m256 c0 = Z, c1 = Z, c2 = Z, c3 = Z, c4 = Z, c5 = Z, c6 = Z, c7 = Z;
  const float *b1 = b + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb, *b4 = b3 + ldb, *b5 = b4 + ldb, *b6 = b5 + ldb;
  const float *b7 = b6 + ldb;
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    __m256 x = LD(a + p);
    FMA(x, LD(b + p), c0), FMA(x, LD(b1 + p), c1), FMA(x, LD(b2 + p), c2), FMA(x, LD(b3 + p), c3);
    FMA(x, LD(b4 + p), c4), FMA(x, LD(b5 + p), c5), FMA(x, LD(b6 + p), c6), FMA(x, LD(b7 + p), c7);
  }
  FINISH(1, 8, c0, c1, c2, c3, c4, c5, c6, c7)
}

TARGET static void rows1_cols1(ARGS) {
  __m256 c0 = Z;
  int p = 0;
  for (; p + 8 <= k; p += 8) FMA(LD(a + p), LD(b + p), c0);
  FINISH(1, 1, c0)
}

/* The 4 x 3 block's work on AVX-512, 4 rows x 8 columns: a register holds rows i and i + 1 (lanes 0-7 and 8-15)
 * against one column, each half accumulating exactly as an AVX2 register does for its row (the same lanes, fused
 * multiply-adds in the same order), so every element has the AVX2 kernel's bits. The columns are broadcast from memory
 * (a load, not a shuffle) and a pair of rows is made once a step for all eight columns. */

TARGET512 static inline __m512 two_rows(const float *r0, const float *r1) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(r0)), _mm256_loadu_ps(r1), 1);
}

TARGET512 static void rows4_cols8_wide(ARGS) {
  __m512 acc[2][8];
#pragma GCC unroll 16
  for (int h = 0; h < 2; h++)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[h][j] = _mm512_setzero_ps();
  const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda;
  int p = 0;
  for (; p + 8 <= k; p += 8) {
    const __m512 x01 = two_rows(a + p, a1 + p), x23 = two_rows(a2 + p, a3 + p);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      const __m512 w = _mm512_broadcast_f32x8(_mm256_loadu_ps(b + (size_t)j * ldb + p));
      acc[0][j] = _mm512_fmadd_ps(x01, w, acc[0][j]);
      acc[1][j] = _mm512_fmadd_ps(x23, w, acc[1][j]);
    }
  }
  __m256 halves[32]; /* [row i][column j], as `finish` reads them */
  for (int h = 0; h < 2; h++)
    for (int j = 0; j < 8; j++) {
      halves[(2 * h) * 8 + j] = _mm512_castps512_ps256(acc[h][j]);
      halves[(2 * h + 1) * 8 + j] = _mm512_extractf32x8_ps(acc[h][j], 1);
    }
  finish(halves, 4, 8, a, lda, b, ldb, p, k, alpha, beta, c, ldc);
}

int mlxcel_rows_wide_available(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

/* whether blocks of rows run on AVX-512 (here rows4_cols8_wide; blas_packed.c's wide blocks): -1 until the first
 * product asks the CPU */
static int wide = -1;

void mlxcel_rows_set_wide(int on) { __atomic_store_n(&wide, on && mlxcel_rows_wide_available(), __ATOMIC_RELAXED); }

int mlxcel_rows_wide(void) {
  int w = __atomic_load_n(&wide, __ATOMIC_RELAXED);
  if (w < 0) __atomic_store_n(&wide, w = mlxcel_rows_wide_available(), __ATOMIC_RELAXED);
  return w;
}

/* columns n0..n1 of every row */
TARGET static void column_block(int m, int n0, int n1, ARGS) {
#define AT(kernel, i, j)                                                                                              \
  kernel(a + (size_t)(i) * lda, lda, b + (size_t)(j) * ldb, ldb, k, alpha, beta, c + (size_t)(i) * ldc + (j), ldc)
  int i = 0;
  const int eights = mlxcel_rows_wide();
  for (; i + 4 <= m; i += 4) {
    int j = n0;
    if (eights)
      for (; j + 8 <= n1; j += 8) AT(rows4_cols8_wide, i, j);
    for (; j + 3 <= n1; j += 3) AT(rows4_cols3, i, j);
    for (; j < n1; j++) AT(rows4_cols1, i, j);
  }
  for (; i < m; i++) {
    int j = n0;
    for (; j + 8 <= n1; j += 8) AT(rows1_cols8, i, j);
    for (; j < n1; j++) AT(rows1_cols1, i, j);
  }
#undef AT
}

static int rows_threads; /* 0: OpenMP's own count (OMP_NUM_THREADS, else the cores) */

void mlxcel_rows_set_threads(int n) { rows_threads = n; }

int mlxcel_rows_threads(void) {
#ifdef _OPENMP
  return rows_threads > 0 ? rows_threads : omp_get_max_threads();
#else
  return 1;
#endif
}

int mlxcel_rows_available(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void mlxcel_rows(int m, int n, ARGS) {
  int blocks = (n + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static) num_threads(mlxcel_rows_threads()) if ((long)m * n * k > PARALLEL_WORK)
  for (int t = 0; t < blocks; t++) {
    int n0 = t * COLUMN_BLOCK, n1 = n0 + COLUMN_BLOCK < n ? n0 + COLUMN_BLOCK : n;
    column_block(m, n0, n1, a, lda, b, ldb, k, alpha, beta, c, ldc);
  }
}

#else /* not x86-64: OpenBLAS's tiles compute every product */
int mlxcel_rows_available(void) { return 0; }
int mlxcel_rows_threads(void) { return 0; }
void mlxcel_rows_set_threads(int n) {}
int mlxcel_rows_wide_available(void) { return 0; }
int mlxcel_rows_wide(void) { return 0; }
void mlxcel_rows_set_wide(int on) {}
void mlxcel_rows(int m, int n, const float *a, int lda, const float *b, int ldb, int k, float alpha, float beta,
                 float *c, int ldc) {}
#endif
