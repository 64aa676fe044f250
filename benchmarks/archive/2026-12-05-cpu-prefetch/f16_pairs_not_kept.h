static uint32_t *g_pairs[4096];
static int g_which;
__attribute__((target("avx2,fma,f16c"))) static inline void sb16(uint32_t p, float *s, float *b) {
  __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)p));
  *s = _mm_cvtss_f32(v); *b = _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1));
}
__attribute__((target("avx2,fma,f16c"))) static void row_cols4_h(const packed_t *e, int r, const float *a, float alpha, float beta, float *c) {
  const int BITS = 4;
  const int groups = e->k / e->group, row_bytes = e->k * BITS / 8;
  const uint8_t *q0 = e->q + (size_t)r * row_bytes, *q1 = q0 + row_bytes, *q2 = q1 + row_bytes, *q3 = q2 + row_bytes;
  const uint32_t *sb = g_pairs[g_which] + (size_t)r * groups;
  const int ahead = r + 8 <= e->n, group_bytes = e->group * BITS / 8;
  if (ahead) prefetch_lines((const char *)(sb + 4 * groups), 16 * groups, 64);
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  for (int g = 0, p = 0; g < groups; g++) {
    if (ahead && (p * BITS / 8) % 64 < group_bytes)
      prefetch_lines((const char *)q3 + row_bytes + p * BITS / 8, 4 * row_bytes, row_bytes);
    float fs0, fb0, fs1, fb1, fs2, fb2, fs3, fb3;
    sb16(sb[g], &fs0, &fb0); sb16(sb[groups + g], &fs1, &fb1); sb16(sb[2 * groups + g], &fs2, &fb2); sb16(sb[3 * groups + g], &fs3, &fb3);
    const __m256 s0 = _mm256_set1_ps(fs0), s1 = _mm256_set1_ps(fs1), s2 = _mm256_set1_ps(fs2), s3 = _mm256_set1_ps(fs3);
    const __m256 b0 = _mm256_set1_ps(fb0), b1 = _mm256_set1_ps(fb1), b2 = _mm256_set1_ps(fb2), b3 = _mm256_set1_ps(fb3);
    for (int end = p + e->group; p < end; p += 8) {
      const __m256 x = _mm256_loadu_ps(a + p);
      const size_t at = (size_t)p * BITS / 8;
      c0 = _mm256_fmadd_ps(x, DEQ(values8(q0 + at, BITS), s0, b0), c0);
      c1 = _mm256_fmadd_ps(x, DEQ(values8(q1 + at, BITS), s1, b1), c1);
      c2 = _mm256_fmadd_ps(x, DEQ(values8(q2 + at, BITS), s2, b2), c2);
      c3 = _mm256_fmadd_ps(x, DEQ(values8(q3 + at, BITS), s3, b3), c3);
    }
  }
  store_sum(c, lanes_sum(c0), alpha, beta), store_sum(c + 1, lanes_sum(c1), alpha, beta);
  store_sum(c + 2, lanes_sum(c2), alpha, beta), store_sum(c + 3, lanes_sum(c3), alpha, beta);
}
