import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (the repository root)
import mlxcel_core
import mlx.core as mx
from mlxcel_core import cpu_blas
print(cpu_blas.status())
H, I, KV, L, V = 576, 1536, 192, 30, 49152
layers = [[mx.random.normal(s) * 0.02 for s in [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]] for _ in range(L)]
head = mx.random.normal((V, H)) * 0.02
mx.eval(layers, head)
def step(x):
    for q, k, v, o, g, u, d in layers:
        a = x @ q.T; b = x @ k.T; c = x @ v.T
        x = x + (a + 0 * (b.sum() + c.sum())) @ o.T
        x = x + ((x @ g.T) * (x @ u.T)) @ d.T
    return x @ head.T
x = mx.random.normal((1, H)); mx.eval(x)
for rows in (1, 4):
    x = mx.random.normal((rows, H)); mx.eval(x)
    mx.eval(step(x))
    ts = []
    for _ in range(10):
        t = time.perf_counter(); mx.eval(step(x)); ts.append(time.perf_counter() - t)
    ts.sort(); print(f"rows {rows}: {ts[len(ts)//2]*1e3:.1f} ms a step (products + a few adds), {4*(sum(w.size for l in layers for w in l)+head.size)/1e6:.0f} MB of weights")
x = mx.random.normal((1, H)); mx.eval(x)
for _ in range(3):
    t0 = time.perf_counter(); y = step(x); t1 = time.perf_counter(); mx.async_eval(y); t2 = time.perf_counter(); mx.eval(y); t3 = time.perf_counter()
    print(f"build {1e3*(t1-t0):.2f} ms, async_eval call {1e3*(t2-t1):.2f} ms, then wait {1e3*(t3-t2):.2f} ms")
