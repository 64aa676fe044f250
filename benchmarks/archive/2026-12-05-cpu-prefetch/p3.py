# A decode token's packed products of SmolLM2-135M's shapes (30 layers + the 8-bit head, distinct weights), each
# called from Python through ctypes: PYTHONPATH=TREE python p3.py 30 (prints min and median ms over 12 tokens).
import time, ctypes, sys
import numpy as np
import mlxcel_core
import mlx.core as mx, mlx.nn as nn
from mlxcel_core.backends import cpu_float32
from mlxcel_core import cpu_blas
lib = cpu_blas._tiles
f = lib.mlxcel_packed_product
f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 30
keep = []
calls = []
mx.random.seed(0)
def add(n, k, bits):
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=bits)
    h = nn.Module(); h.layer = layer; cpu_float32.prepare(h); mx.eval(h.parameters())
    w = np.frombuffer(memoryview(h.layer.float32.weight), dtype=np.float32)
    keep.append(h)
    x = np.random.randn(k).astype(np.float32); c = np.zeros(n, np.float32)
    keep.extend([w, x, c])
    calls.append((n, k, x.ctypes.data, w.ctypes.data, c.ctypes.data))
for l in range(layers):
    for n, k in shapes: add(n, k, 4)
add(49152, 576, 8)
per = {}
tots = []
for r in range(12):
    t_all = 0
    for (n, k, xa, wa, ca) in calls:
        t0 = time.perf_counter()
        ok = f(1, n, xa, k, wa, k, k, 1.0, 0.0, ca, n)
        dt = time.perf_counter() - t0
        assert ok
        per.setdefault((n, k), []).append(dt)
        t_all += dt
    tots.append(t_all)
for key, v in per.items():
    cnt = len(v) // 5
    print(key, "%.1f us mean per call" % (np.mean(v[-cnt:]) * 1e6))
tots.sort()
print("token products: min %.2f ms, median %.2f ms" % (tots[0] * 1e3, tots[len(tots) // 2] * 1e3))
