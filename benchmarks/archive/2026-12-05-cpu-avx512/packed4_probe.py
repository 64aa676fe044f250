import time
import mlxcel_core
import mlx.core as mx, mlx.nn as nn
from mlxcel_core import cpu_blas
from mlxcel_core.backends import cpu_float32
for bits, gs, n, k in ((4, 32, 1536, 576), (4, 64, 1536, 576), (8, 32, 49152, 576), (4, 32, 576, 1536)):
    mx.random.seed(0)
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=gs, bits=bits)
    h = nn.Module(); h.layer = layer; cpu_float32.prepare(h)
    x = mx.random.normal((4, k)); mx.eval(x)
    res = {}
    for on in (0, 1, 0, 1):
        cpu_blas.set_rows_wide(on)
        mx.eval(layer(x))
        reps = 200 if n < 10000 else 20
        t0 = time.perf_counter()
        for _ in range(reps): y = layer(x); mx.eval(y)
        res.setdefault(on, []).append((time.perf_counter() - t0) / reps); res[("y", on)] = y
    print(bits, gs, n, k, "equal", mx.array_equal(res[("y", 0)], res[("y", 1)]).item(), "avx2 %.1f us, avx512 %.1f us" % (min(res[0]) * 1e6, min(res[1]) * 1e6))
