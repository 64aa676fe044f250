import sys, ctypes
import mlxcel_core, mlx.core as mx
from mlxcel_core import cpu_blas
tiles = ctypes.CDLL(str(cpu_blas._library()), mode=ctypes.RTLD_GLOBAL)
openblas = ctypes.CDLL(str(cpu_blas._openblas()))
tiles.mlxcel_blas_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
for rows in [int(r) for r in sys.argv[1:]]:
    tiles.mlxcel_blas_init(ctypes.cast(openblas.scipy_cblas_sgemm, ctypes.c_void_p), rows)
    with mx.stream(mx.cpu):
        mx.random.seed(0)
        w, x = mx.random.normal((1536, 576)), mx.random.normal((40, 576))
        alone = [(x[i : i + 1] @ w.T)[0] for i in range(40)]
        bad = {}
        for m in (2, 15, 16, 17, 33, 40):
            together = x[:m] @ w.T
            b = [i for i in range(m) if not mx.array_equal(together[i], alone[i]).item()]
            if b: bad[m] = b
        print(rows, bad or "invariant")
