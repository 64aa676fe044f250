import sys, ctypes, time
import mlxcel_core, mlx.core as mx
from mlxcel_core import cpu_blas
tiles = ctypes.CDLL(str(cpu_blas._library()), mode=ctypes.RTLD_GLOBAL)
openblas = ctypes.CDLL(str(cpu_blas._openblas()))
tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
with mx.stream(mx.cpu):
    w, x = mx.random.normal((1536, 576)), mx.random.normal((512, 576))
    x1 = mx.random.normal((1, 576)); mx.eval(w, x, x1)
    for rows in (16, 8, 16, 8):
        tiles.mlxcel_blas_init(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p), rows)
        t = time.perf_counter()
        for _ in range(5): mx.eval(x @ w.T)
        t512 = (time.perf_counter() - t) / 5
        t = time.perf_counter()
        for _ in range(50): mx.eval(x1 @ w.T)
        print(rows, f"512 rows {t512*1e3:.1f} ms, 1 row {(time.perf_counter()-t)/50*1e3:.2f} ms")
