/* cblas_sgemm for MLX's CPU library: OpenBLAS's sgemm, a fixed number of rows of the product at a time.
 *
 * Loaded with RTLD_GLOBAL before MLX (mlxcel_core/cpu_blas.py says why and how). Every call is turned into row-major
 * form and computed `tile` rows at a time, the last tile padded with zero rows: OpenBLAS picks other kernels for other
 * row counts, so without tiles a row of a product would round differently alone than in a batch.
 * `mlxcel_blas_init` hands over OpenBLAS's prefixed sgemm (scipy-openblas32's scipy_cblas_sgemm) and the tile that
 * cpu_blas.py checked; until then, and if it is never called, a plain loop computes the product (correct, slow).
 * With `own` set, every product goes to blas_rows.c instead, where the CPU has AVX2 and FMA: it computes x @ w.T, and
 * the other forms are copied into that form first (each thread's scratch), so a product's bits do not depend on how
 * its operands lie in memory (a first prefill chunk's own keys and the same keys gathered from the paged blocks). */
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111 };
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                        int);
static sgemm_t blas;
static int tile = 16;
static int own_rows;

int mlxcel_rows_available(void);
int mlxcel_rows_threads(void);
void mlxcel_rows(int m, int n, const float *a, int lda, const float *b, int ldb, int k, float alpha, float beta,
                 float *c, int ldc);
int mlxcel_packed_product(int m, int n, const float *a, int lda, const float *b, int ldb, int k, float alpha,
                          float beta, float *c, int ldc);

/* returns the threads blas_rows.c computes x @ w.T on, 0 where OpenBLAS's tiles compute it */
int mlxcel_blas_init(void *fn, int rows, int own) {
  blas = (sgemm_t)fn;
  if (rows > 0) tile = rows;
  own_rows = own && mlxcel_rows_available();
  return own_rows ? mlxcel_rows_threads() : 0;
}

static float at(const float *x, int trans, int ld, int r, int c) {
  return trans == NO_TRANS ? x[(size_t)r * ld + c] : x[(size_t)c * ld + r];
}

/* row-major C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C without a BLAS (before init) */
static void plain(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                  float beta, float *c, int ldc) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float sum = 0.0f;
      for (int p = 0; p < k; p++) sum += at(a, ta, lda, i, p) * at(b, tb, ldb, p, j);
      float *out = c + (size_t)i * ldc + j;
      *out = alpha * sum + (beta == 0.0f ? 0.0f : beta * *out);
    }
}

/* the thread's scratch of at least `count` floats (NULL if it cannot grow) */
static float *scratch(int which, size_t count) {
  static __thread float *buffers[2];
  static __thread size_t sizes[2];
  if (sizes[which] < count) {
    float *grown = realloc(buffers[which], count * sizeof(float));
    if (grown == NULL) return NULL;
    buffers[which] = grown;
    sizes[which] = count;
  }
  return buffers[which];
}

/* op(A) as rows of k (A[M,K]) and op(B) as rows of k (B^T[N,K]), then blas_rows.c; 0 if the scratch failed */
static int rows(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                float beta, float *c, int ldc) {
  if (ta != NO_TRANS) {
    float *copy = scratch(0, (size_t)m * k);
    if (copy == NULL) return 0;
    for (int p = 0; p < k; p++)
      for (int i = 0; i < m; i++) copy[(size_t)i * k + p] = a[(size_t)p * lda + i];
    a = copy, lda = k;
  }
  if (tb == NO_TRANS) {
    float *copy = scratch(1, (size_t)n * k);
    if (copy == NULL) return 0;
    for (int p = 0; p < k; p++)
      for (int j = 0; j < n; j++) copy[(size_t)j * k + p] = b[(size_t)p * ldb + j];
    b = copy, ldb = k;
  }
  /* (a weight registered with its packed values, blas_packed.c, is read from them: the same bits) */
  if (!mlxcel_packed_product(m, n, a, lda, b, ldb, k, alpha, beta, c, ldc))
    mlxcel_rows(m, n, a, lda, b, ldb, k, alpha, beta, c, ldc);
  return 1;
}

static void product(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                  float beta, float *c, int ldc) {
  if (own_rows && rows(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  if (blas == NULL) {
    plain(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  int full = m - m % tile;
  for (int i = 0; i < full; i += tile)
    blas(ROW_MAJOR, ta, tb, tile, n, k, alpha, ta == NO_TRANS ? a + (size_t)i * lda : a + i, lda, b, ldb, beta,
         c + (size_t)i * ldc, ldc);
  int rest = m - full;
  if (rest == 0) return;
  float *pa = calloc((size_t)tile * k, sizeof(float)), *pc = calloc((size_t)tile * n, sizeof(float));
  if (pa == NULL || pc == NULL) {
    free(pa);
    free(pc);
    plain(ta, tb, rest, n, k, alpha, ta == NO_TRANS ? a + (size_t)full * lda : a + full, lda, b, ldb, beta,
          c + (size_t)full * ldc, ldc);
    return;
  }
  for (int r = 0; r < rest; r++) {
    for (int p = 0; p < k; p++) pa[(size_t)r * k + p] = at(a, ta, lda, full + r, p);
    if (beta != 0.0f) memcpy(pc + (size_t)r * n, c + (size_t)(full + r) * ldc, (size_t)n * sizeof(float));
  }
  blas(ROW_MAJOR, NO_TRANS, tb, tile, n, k, alpha, pa, k, b, ldb, beta, pc, n);
  for (int r = 0; r < rest; r++) memcpy(c + (size_t)(full + r) * ldc, pc + (size_t)r * n, (size_t)n * sizeof(float));
  free(pa);
  free(pc);
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (order == COL_MAJOR) /* C^T = op(B)^T op(A)^T in row-major form */
    product(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
  else
    product(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
