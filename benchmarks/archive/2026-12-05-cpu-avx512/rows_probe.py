import time
import mlxcel_core
import mlx.core as mx
from mlxcel_core import cpu_blas
print(cpu_blas.status(), cpu_blas.rows_wide())
for m, n, k in ((64, 1536, 576), (256, 1536, 576), (64, 576, 1536), (37, 100, 64), (13, 29, 577), (256, 49152, 576)):
    x = mx.random.normal((m, k)); w = mx.random.normal((n, k)); mx.eval(x, w)
    res = {}
    for on in (0, 1, 0, 1):
        cpu_blas.set_rows_wide(on)
        y = x @ w.T; mx.eval(y)
        reps = max(3, int(2e9 / (2 * m * n * k)))
        t0 = time.perf_counter()
        for _ in range(reps): y = x @ w.T; mx.eval(y)
        dt = (time.perf_counter() - t0) / reps
        res.setdefault(on, []).append(dt); res[("y", on)] = y
    g = 2 * m * n * k / 1e9
    print(m, n, k, "equal", mx.array_equal(res[("y", 0)], res[("y", 1)]).item(), "avx2 %.1f GFLOP/s, avx512 %.1f GFLOP/s" % (g / min(res[0]), g / min(res[1])))
