# One product x @ w.T (one row) from the packed values and from the float32 copy: 40 4-bit 1536x576
# layers and 4 8-bit 49152x576 ones (the output head), tied then untied. Run from the repository root:
# PYTHONPATH=. python benchmarks/archive/2026-12-05-cpu-packed/product_probe.py
import time
import mlxcel_core
from mlxcel_core import cpu_blas
import mlx.core as mx, mlx.nn as nn
from mlxcel_core.backends import cpu_float32
class M(nn.Module):
    def __init__(s, bits, n, k):
        super().__init__()
        s.layers = [nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=bits) for _ in range(40)]
print(cpu_blas.status())
for bits, n, k in [(4, 1536, 576), (8, 49152, 576)]:
    m = M(bits, n, k); cpu_float32.prepare(m)
    x = mx.random.normal((1, k)); mx.eval(x)
    L = m.layers if n < 10000 else m.layers[:4]
    def run():
        t = time.perf_counter(); ys = [l(x) for l in L]; mx.eval(ys); return (time.perf_counter() - t) / len(L)
    for _ in range(2): run()
    h=cpu_blas.packed_products(); tp = min(run() for _ in range(5)); print("hits", cpu_blas.packed_products()-h, [l.float32.packed for l in L][:3])
    for l in L: cpu_blas.unregister_packed(l.float32.weight)
    tf = min(run() for _ in range(5))
    w = n * k
    print(f"bits {bits} {n}x{k}: packed {tp*1e6:.0f} us ({w/tp/1e9:.2f} Gw/s), float32 {tf*1e6:.0f} us ({w*4/tf/1e9:.1f} GB/s)")
