/* One-row packed 4-bit products (blas_packed.c's row_cols4_4, or KERNEL) over enough distinct weights (~96 MB) that
 * they come from L3 as a decode step's do; checks the first product's bits against row_cols4_4.
 * cc -O2 -ffp-contract=off -fopenmp packed_harness.c -o harness -lm && ./harness N K REPS THREADS
 * (N x K: 576 576, 1536 576, 576 1536 for SmolLM2's layers) */
#include "../../../mlxcel_core/csrc/blas_rows.c"
#include "../../../mlxcel_core/csrc/blas_packed.c"
#include <stdio.h>
#include <time.h>
#define STR_(x) #x
#define STR(x) STR_(x)
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef KERNEL
#define KERNEL row_cols4_4
#endif
TARGET static void cols(const packed_t *e, int j0, int j1, const float *a, float *c) {
  for (int j = j0; j < j1; j += 4) KERNEL(e, j, a, 1.0f, 0.0f, c + j);
}
int main(int argc, char**argv){
  int n = atoi(argv[1]), k = atoi(argv[2]), reps = atoi(argv[3]), th = atoi(argv[4]);
  int group = 32, bits = 4, groups = k/group;
  int nw = (int)(96e6 / (n * (double)k * 0.75)) + 1;
  packed_t *es = malloc(sizeof(packed_t) * nw);
  for (int w = 0; w < nw; w++) {
    packed_t e = {0, n, k, group, bits, malloc((size_t)n*k/2), malloc((size_t)n*groups*4), malloc((size_t)n*groups*4)};
    for (size_t i=0;i<(size_t)n*k/2;i++) e.q[i]=rand();
    for (size_t i=0;i<(size_t)n*groups;i++){e.scales[i]=(rand()%1000)/7919.0f; e.biases[i]=-(rand()%1000)/3119.0f;}
    es[w] = e;
  }
  float *a = malloc(k*4), *c = malloc(n*4), *c2 = malloc(n*4);
  for(int i=0;i<k;i++) a[i]=(rand()%2000-1000)/1000.0f;
  for (int j = 0; j < n; j += 4) row_cols4_4(&es[0], j, a, 1.0f, 0.0f, c2 + j);
  double best=1e9;
  for(int r=0;r<reps;r++){ double t0=now();
    for (int w = 0; w < nw; w++) {
    int blocks = (n + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(th)
    for (int t = 0; t < blocks; t++) cols(&es[w], t * 32, t * 32 + 32 < n ? t * 32 + 32 : n, a, c);
    if (w == 0 && memcmp(c, c2, n * 4)) { printf("MISMATCH\n"); return 1; }
    }
   double dt=(now()-t0)/nw; if(dt<best)best=dt;}
  printf("%s %d thr %d x %d (x%d weights): %.1f us a product, %.2f GB/s\n", STR(KERNEL), th, n, k, nw, best*1e6, n*k*0.75/best/1e9);
}
