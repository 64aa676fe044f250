import time
import mlxcel_core
import mlx.core as mx
H, I, KV, L, V = 576, 1536, 192, 30, 49152
layers = [[mx.random.normal(s) * 0.02 for s in [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]] for _ in range(L)]
fused = [[mx.concatenate([q, k, v]), o, mx.concatenate([g, u]), d] for q, k, v, o, g, u, d in layers]
mx.eval(layers, fused)
def step(x):
    for q, k, v, o, g, u, d in layers:
        a = x @ q.T; b = x @ k.T; c = x @ v.T
        x = x + (a + (b.sum() + c.sum()) * 0) @ o.T
        x = x + (mx.sigmoid(x @ g.T) * (x @ u.T)) @ d.T
    return x
def fstep(x):
    for qkv, o, gu, d in fused:
        y = x @ qkv.T; a, b, c = y[:, :H], y[:, H:H+KV], y[:, H+KV:]
        x = x + (a + (b.sum() + c.sum()) * 0) @ o.T
        z = x @ gu.T
        x = x + (mx.sigmoid(z[:, :I]) * z[:, I:]) @ d.T
    return x
x = mx.random.normal((1, H)); mx.eval(x)
print("same bits:", mx.array_equal(step(x), fstep(x)).item())
for name, f in [("separate", step), ("fused", fstep)] * 2:
    mx.eval(f(x)); ts = []
    for _ in range(15):
        t = time.perf_counter(); mx.eval(f(x)); ts.append(time.perf_counter() - t)
    ts.sort(); print(name, f"{ts[7]*1e3:.2f} ms")
