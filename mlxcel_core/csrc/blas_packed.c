/* x @ w.T for a float32 weight w that is a quantized layer's dequantization (backends/cpu_float32.py), computed from
 * the layer's packed 4- or 8-bit values instead of w: a decode step reads half a byte or one byte a weight, not four.
 *
 * A registration ties w's address to a copy of the packed values, scales and biases (float32), after checking that
 * every weight dequantized here, q s + b rounded after the product and again after the sum (as MLX's multiply and add
 * compute it), equals w's value bit for bit. A product whose weight operand is a registered w (row-major, rows of k)
 * then takes each weight from that copy and otherwise computes exactly as blas_rows.c: eight lanes accumulate
 * k = 0, 8, 16, ... with fused multiply-adds in order and are summed in blas_rows.c's fixed tree (k is a whole number
 * of groups, so of 8). Its results are blas_rows.c's bits on w, whichever of the two computes a product. Blocks of 4
 * and 8 rows run on AVX-512 where blas_rows.c's do (mlxcel_rows_wide), two weight rows a register, with the same bits.
 *
 * The table is read under a read lock by every product and written under the write lock at registration and removal,
 * so a weight dropped while another thread computes waits for that product. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_WEIGHTS 4096
#define PACKED_MAX_ROWS 8 /* products of more rows read w itself (the dequantization costs more than it saves) */

typedef struct {
  const float *w; /* the registered float32 weight (NULL: a free slot) */
  int n, k, group, bits;
  uint8_t *q;              /* n rows of k * bits / 8 bytes, MLX's packing (value j at bits [j bits, (j + 1) bits)) */
  float *scales, *biases;  /* n rows of k / group */
} packed_t;

static packed_t table[MAX_WEIGHTS];
static int used; /* slots 0..used-1 have been taken at some point: a lookup reads no further */
static pthread_rwlock_t lock = PTHREAD_RWLOCK_INITIALIZER;
static long hits;

int mlxcel_rows_threads(void);
int mlxcel_rows_available(void);

long mlxcel_packed_hits(void) { return __atomic_load_n(&hits, __ATOMIC_RELAXED); }

#include "blas_rows.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* eight packed values from `at` (4 bits: one little-endian word; 8 bits: eight bytes), as float32 */
TARGET static inline __m256 values8(const uint8_t *at, int bits) {
  if (bits == 4) {
    uint32_t word;
    memcpy(&word, at, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), _mm256_set1_epi32(15)));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}

/* q s + b: two roundings (compiled with -ffp-contract=off), as MLX's multiply and add */
#define DEQ(q_, s_, b_) _mm256_add_ps(_mm256_mul_ps(q_, s_), b_)

/* eight weights k = p..p+7 of row r, as float32 (p a multiple of 8) */
TARGET static inline __m256 weights8(const packed_t *e, int r, int p) {
  const size_t g = (size_t)r * (e->k / e->group) + p / e->group;
  const __m256 q = values8(e->q + ((size_t)r * e->k + p) * e->bits / 8, e->bits);
  return DEQ(q, _mm256_set1_ps(e->scales[g]), _mm256_set1_ps(e->biases[g]));
}

/* rows i0..i0+mr-1 (mr <= 4) against weight rows j..j+nr-1 (nr <= 2) */
TARGET static void block(const packed_t *e, int row0, int mr, int nr, int i0, int j, const float *a, int lda,
                         float alpha, float beta, float *c, int ldc) {
  __m256 acc[4][2];
  for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int p = 0; p < e->k; p += 8) {
    __m256 w0 = weights8(e, row0 + j, p), w1 = nr > 1 ? weights8(e, row0 + j + 1, p) : w0;
    for (int i = 0; i < mr; i++) {
      __m256 x = _mm256_loadu_ps(a + (size_t)(i0 + i) * lda + p);
      acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int jj = 0; jj < nr; jj++) store_sum(c + (size_t)(i0 + i) * ldc + j + jj, lanes_sum(acc[i][jj]), alpha, beta);
}

/* A decode step's weights come from L3 or memory, and the hardware's prefetcher follows the short streams of a block
 * of rows (a row of k = 576 4-bit values is 288 bytes) too late: the kernels ask for the next block's bytes ahead, a
 * line every `step` bytes of `count` from `at`. */
static inline void prefetch_lines(const char *at, int count, int step) {
  for (int o = 0; o < count; o += step) _mm_prefetch(at + o, _MM_HINT_T0);
}

/* the scales and biases of rows r..r+count-1 (a later block), asked for at the start of a block */
static inline void prefetch_scales(const packed_t *e, int r, int count) {
  if (r + count > e->n) return;
  const int groups = e->k / e->group;
  prefetch_lines((const char *)(e->scales + (size_t)r * groups), 4 * count * groups, 64);
  prefetch_lines((const char *)(e->biases + (size_t)r * groups), 4 * count * groups, 64);
}

/* byte `at` of rows r..r+count-1 (a later block), asked for by a block at its group starting at `at` where that group
 * holds a line's start */
static inline void prefetch_rows(const packed_t *e, int r, int count, int at) {
  const int row_bytes = e->k * e->bits / 8;
  if (r + count > e->n || at % 64 >= e->group * e->bits / 8) return;
  prefetch_lines((const char *)e->q + (size_t)r * row_bytes + at, count * row_bytes, row_bytes);
}

/* one row against weight rows j..j+3, a group at a time (BITS a constant: the compiler drops the other width), while
 * the next four rows' bytes are fetched a slice a group */
#define ROW_COLS4(BITS)                                                                                                \
  TARGET static void row_cols4_##BITS(const packed_t *e, int r, const float *a, float alpha, float beta, float *c) {   \
    const int groups = e->k / e->group, row_bytes = e->k * BITS / 8;                                                   \
    const uint8_t *q0 = e->q + (size_t)r * row_bytes, *q1 = q0 + row_bytes, *q2 = q1 + row_bytes,                      \
                  *q3 = q2 + row_bytes;                                                                                \
    const float *s = e->scales + (size_t)r * groups, *b = e->biases + (size_t)r * groups;                              \
    prefetch_scales(e, r + 4, 4);                                                                                      \
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                                                        \
    for (int g = 0, p = 0; g < groups; g++) {                                                                          \
      prefetch_rows(e, r + 4, 4, p * BITS / 8);                                                                        \
      const __m256 s0 = _mm256_set1_ps(s[g]), s1 = _mm256_set1_ps(s[groups + g]);                                      \
      const __m256 s2 = _mm256_set1_ps(s[2 * groups + g]), s3 = _mm256_set1_ps(s[3 * groups + g]);                     \
      const __m256 b0 = _mm256_set1_ps(b[g]), b1 = _mm256_set1_ps(b[groups + g]);                                      \
      const __m256 b2 = _mm256_set1_ps(b[2 * groups + g]), b3 = _mm256_set1_ps(b[3 * groups + g]);                     \
      for (int end = p + e->group; p < end; p += 8) {                                                                  \
        const __m256 x = _mm256_loadu_ps(a + p);                                                                       \
        const size_t at = (size_t)p * BITS / 8;                                                                        \
        c0 = _mm256_fmadd_ps(x, DEQ(values8(q0 + at, BITS), s0, b0), c0);                                              \
        c1 = _mm256_fmadd_ps(x, DEQ(values8(q1 + at, BITS), s1, b1), c1);                                              \
        c2 = _mm256_fmadd_ps(x, DEQ(values8(q2 + at, BITS), s2, b2), c2);                                              \
        c3 = _mm256_fmadd_ps(x, DEQ(values8(q3 + at, BITS), s3, b3), c3);                                              \
      }                                                                                                                \
    }                                                                                                                  \
    store_sum(c, lanes_sum(c0), alpha, beta), store_sum(c + 1, lanes_sum(c1), alpha, beta);                            \
    store_sum(c + 2, lanes_sum(c2), alpha, beta), store_sum(c + 3, lanes_sum(c3), alpha, beta);                        \
  }
ROW_COLS4(4)
ROW_COLS4(8)

/* rows i..i+3 against weight rows j, j+1 (r = row0 + j), a group at a time */
#define ROWS4_COLS2(BITS)                                                                                              \
  TARGET static void rows4_cols2_##BITS(const packed_t *e, int r, const float *a, int lda, float alpha, float beta,    \
                                        float *c, int ldc) {                                                           \
    const int groups = e->k / e->group, row_bytes = e->k * BITS / 8;                                                   \
    const uint8_t *q0 = e->q + (size_t)r * row_bytes, *q1 = q0 + row_bytes;                                            \
    const float *s = e->scales + (size_t)r * groups, *b = e->biases + (size_t)r * groups;                              \
    const float *a1 = a + lda, *a2 = a1 + lda, *a3 = a2 + lda;                                                         \
    prefetch_scales(e, r + 4, 2);                                                                                      \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;     \
    for (int g = 0, p = 0; g < groups; g++) {                                                                          \
      prefetch_rows(e, r + 4, 2, p * BITS / 8);                                                                        \
      const __m256 s0 = _mm256_set1_ps(s[g]), s1 = _mm256_set1_ps(s[groups + g]);                                      \
      const __m256 b0 = _mm256_set1_ps(b[g]), b1 = _mm256_set1_ps(b[groups + g]);                                      \
      for (int end = p + e->group; p < end; p += 8) {                                                                  \
        const size_t at = (size_t)p * BITS / 8;                                                                        \
        const __m256 w0 = DEQ(values8(q0 + at, BITS), s0, b0), w1 = DEQ(values8(q1 + at, BITS), s1, b1);               \
        __m256 x = _mm256_loadu_ps(a + p);                                                                             \
        c00 = _mm256_fmadd_ps(x, w0, c00), c01 = _mm256_fmadd_ps(x, w1, c01);                                          \
        x = _mm256_loadu_ps(a1 + p);                                                                                   \
        c10 = _mm256_fmadd_ps(x, w0, c10), c11 = _mm256_fmadd_ps(x, w1, c11);                                          \
        x = _mm256_loadu_ps(a2 + p);                                                                                   \
        c20 = _mm256_fmadd_ps(x, w0, c20), c21 = _mm256_fmadd_ps(x, w1, c21);                                          \
        x = _mm256_loadu_ps(a3 + p);                                                                                   \
        c30 = _mm256_fmadd_ps(x, w0, c30), c31 = _mm256_fmadd_ps(x, w1, c31);                                          \
      }                                                                                                                \
    }                                                                                                                  \
    store_sum(c, lanes_sum(c00), alpha, beta), store_sum(c + 1, lanes_sum(c01), alpha, beta);                          \
    c += ldc, store_sum(c, lanes_sum(c10), alpha, beta), store_sum(c + 1, lanes_sum(c11), alpha, beta);                \
    c += ldc, store_sum(c, lanes_sum(c20), alpha, beta), store_sum(c + 1, lanes_sum(c21), alpha, beta);                \
    c += ldc, store_sum(c, lanes_sum(c30), alpha, beta), store_sum(c + 1, lanes_sum(c31), alpha, beta);                \
  }
ROWS4_COLS2(4)
ROWS4_COLS2(8)

/* rows4_cols2 on AVX-512, for 4 or 8 rows of x: weight rows j and j + 1 made in one register (lanes 0-7 and 8-15),
 * each half what weights8 gives for its row, against each x row broadcast to both halves; each half accumulates as
 * rows4_cols2's registers do (the same loads, roundings and fused multiply-adds in the same order), so the bits are the
 * same. Eight rows make each weight once for all of them (a decode batch of 8: two blocks of 4 make it twice). */

/* eight packed values of row a at `a_at` and eight of row b at `b_at`, as float32 in the low and high halves */
TARGET512 static inline __m512 values16(const uint8_t *a_at, const uint8_t *b_at, int bits) {
  if (bits == 4) {
    uint32_t wa, wb;
    memcpy(&wa, a_at, 4), memcpy(&wb, b_at, 4);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i v = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)wa), 0xFF00, (int)wb);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(v, shifts), _mm512_set1_epi32(15)));
  }
  uint64_t ba, bb;
  memcpy(&ba, a_at, 8), memcpy(&bb, b_at, 8);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)bb, (long long)ba)));
}

#define ROWS_COLS2_WIDE(R, BITS)                                                                                       \
  TARGET512 static void rows##R##_cols2_wide_##BITS(const packed_t *e, int r, const float *a, int lda, float alpha,    \
                                                    float beta, float *c, int ldc) {                                   \
    const int groups = e->k / e->group, row_bytes = e->k * BITS / 8;                                                   \
    const uint8_t *q0 = e->q + (size_t)r * row_bytes, *q1 = q0 + row_bytes;                                            \
    const float *s = e->scales + (size_t)r * groups, *b = e->biases + (size_t)r * groups;                              \
    prefetch_scales(e, r + 4, 2);                                                                                      \
    __m512 acc[R];                                                                                                     \
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();                                  \
    for (int g = 0, p = 0; g < groups; g++) {                                                                          \
      prefetch_rows(e, r + 4, 2, p * BITS / 8);                                                                        \
      const __m512 s01 = _mm512_insertf32x8(_mm512_set1_ps(s[g]), _mm256_set1_ps(s[groups + g]), 1);                  \
      const __m512 b01 = _mm512_insertf32x8(_mm512_set1_ps(b[g]), _mm256_set1_ps(b[groups + g]), 1);                  \
      for (int end = p + e->group; p < end; p += 8) {                                                                  \
        const size_t at = (size_t)p * BITS / 8;                                                                        \
        const __m512 w = _mm512_add_ps(_mm512_mul_ps(values16(q0 + at, q1 + at, BITS), s01), b01);                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[i] =                                                   \
            _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(a + (size_t)i * lda + p)), w, acc[i]);              \
      }                                                                                                                \
    }                                                                                                                  \
    for (int i = 0; i < R; i++, c += ldc) {                                                                            \
      store_sum(c, lanes_sum(_mm512_castps512_ps256(acc[i])), alpha, beta);                                            \
      store_sum(c + 1, lanes_sum(_mm512_extractf32x8_ps(acc[i], 1)), alpha, beta);                                     \
    }                                                                                                                  \
  }
ROWS_COLS2_WIDE(4, 4)
ROWS_COLS2_WIDE(4, 8)
ROWS_COLS2_WIDE(8, 4)
ROWS_COLS2_WIDE(8, 8)

int mlxcel_rows_wide(void);

TARGET static void columns(const packed_t *e, int row0, int m, int j0, int j1, const float *a, int lda, float alpha,
                           float beta, float *c, int ldc) {
  const int wide = mlxcel_rows_wide();
  void (*rows4_cols2)(const packed_t *, int, const float *, int, float, float, float *, int) =
      wide ? (e->bits == 4 ? rows4_cols2_wide_4 : rows4_cols2_wide_8) : (e->bits == 4 ? rows4_cols2_4 : rows4_cols2_8);
  int i = 0;
  for (; wide && i + 8 <= m; i += 8) { /* (8 rows: each weight made once for all of them) */
    int j = j0;
    for (; j + 2 <= j1; j += 2)
      (e->bits == 4 ? rows8_cols2_wide_4 : rows8_cols2_wide_8)(e, row0 + j, a + (size_t)i * lda, lda, alpha, beta,
                                                                c + (size_t)i * ldc + j, ldc);
    if (j < j1) block(e, row0, 4, 1, i, j, a, lda, alpha, beta, c, ldc), block(e, row0, 4, 1, i + 4, j, a, lda, alpha,
                                                                                beta, c, ldc);
  }
  for (; i + 4 <= m; i += 4) {
    int j = j0;
    for (; j + 2 <= j1; j += 2)
      rows4_cols2(e, row0 + j, a + (size_t)i * lda, lda, alpha, beta, c + (size_t)i * ldc + j, ldc);
    if (j < j1) block(e, row0, 4, 1, i, j, a, lda, alpha, beta, c, ldc);
  }
  for (; i < m; i++) {
    int j = j0;
    for (; j + 4 <= j1; j += 4)
      (e->bits == 4 ? row_cols4_4 : row_cols4_8)(e, row0 + j, a + (size_t)i * lda, alpha, beta,
                                                 c + (size_t)i * ldc + j);
    for (; j < j1; j++) block(e, row0, 1, 1, i, j, a, lda, alpha, beta, c, ldc);
  }
}

/* the entry whose weight holds b's rows (row-major, rows of k), or NULL; *row0: b's first row in it */
static const packed_t *find(const float *b, int ldb, int n, int k, int *row0) {
  for (int i = 0; i < used; i++) {
    const packed_t *e = &table[i];
    if (e->w == NULL || e->k != k || ldb != k || b < e->w || b >= e->w + (size_t)e->n * k) continue;
    size_t offset = (size_t)(b - e->w);
    if (offset % k || (int)(offset / k) + n > e->n) return NULL;
    *row0 = (int)(offset / k);
    return e;
  }
  return NULL;
}

int mlxcel_packed_product(int m, int n, const float *a, int lda, const float *b, int ldb, int k, float alpha,
                          float beta, float *c, int ldc) {
  if (m > PACKED_MAX_ROWS) return 0; /* (a registration needs AVX2: an empty table has nothing to find) */
  pthread_rwlock_rdlock(&lock);
  int row0;
  const packed_t *e = find(b, ldb, n, k, &row0);
  if (e != NULL) {
    int blocks = (n + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(mlxcel_rows_threads()) if ((long)n * k > 200000L)
    for (int t = 0; t < blocks; t++) columns(e, row0, m, t * 32, t * 32 + 32 < n ? t * 32 + 32 : n, a, lda, alpha, beta,
                                             c, ldc);
    __atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED);
  }
  pthread_rwlock_unlock(&lock);
  return e != NULL;
}

/* whether every weight dequantized here equals w's value, bit for bit */
TARGET static int matches(const packed_t *e) {
  for (int r = 0; r < e->n; r++)
    for (int p = 0; p < e->k; p += 8) {
      __m256 mine = weights8(e, r, p), theirs = _mm256_loadu_ps(e->w + (size_t)r * e->k + p);
      if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_castps_si256(mine), _mm256_castps_si256(theirs))) != -1)
        return 0;
    }
  return 1;
}
#else
int mlxcel_packed_product(int m, int n, const float *a, int lda, const float *b, int ldb, int k, float alpha,
                          float beta, float *c, int ldc) {
  return 0;
}
static int matches(const packed_t *e) { return 0; }
#endif

static void release(packed_t *e) {
  free(e->q), free(e->scales), free(e->biases);
  memset(e, 0, sizeof(*e));
}

/* Ties float32 weight w [n, k] to copies of its packed values q, scales and biases; 1 if taken, 0 if not (not AVX2,
 * bits other than 4 and 8, k not whole groups of 8, no memory, a full table, or a weight that is not their
 * dequantization bit for bit). */
int mlxcel_packed_register(const float *w, int n, int k, const uint8_t *q, const float *scales, const float *biases,
                           int group, int bits) {
  if (!mlxcel_rows_available() || (bits != 4 && bits != 8) || group % 8 || k % group || n <= 0) return 0;
  packed_t e = {w, n, k, group, bits, malloc((size_t)n * k * bits / 8), malloc((size_t)n * (k / group) * 4),
                malloc((size_t)n * (k / group) * 4)};
  if (e.q == NULL || e.scales == NULL || e.biases == NULL) return release(&e), 0;
  memcpy(e.q, q, (size_t)n * k * bits / 8);
  memcpy(e.scales, scales, (size_t)n * (k / group) * 4);
  memcpy(e.biases, biases, (size_t)n * (k / group) * 4);
  if (!matches(&e)) return release(&e), 0;
  pthread_rwlock_wrlock(&lock);
  int slot = 0, free_slot = MAX_WEIGHTS;
  for (; slot < used && table[slot].w != w; slot++)
    if (table[slot].w == NULL && free_slot == MAX_WEIGHTS) free_slot = slot;
  if (slot == used) slot = free_slot < MAX_WEIGHTS ? free_slot : used; /* (a new weight: the first free slot) */
  if (slot < MAX_WEIGHTS) {
    if (table[slot].w != NULL) release(&table[slot]);
    table[slot] = e;
    if (slot >= used) used = slot + 1;
  }
  pthread_rwlock_unlock(&lock);
  if (slot == MAX_WEIGHTS) release(&e);
  return slot < MAX_WEIGHTS;
}

/* Unties w (before its memory is freed); 1 if it was registered. */
int mlxcel_packed_unregister(const float *w) {
  int found = 0;
  pthread_rwlock_wrlock(&lock);
  for (int i = 0; i < used; i++)
    if (table[i].w == w) release(&table[i]), found = 1;
  pthread_rwlock_unlock(&lock);
  return found;
}
