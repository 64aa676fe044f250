import time, mlx.core as mx
x = mx.random.normal((1, 1, 576)); mx.eval(x)
def chain(kind, n=1000):
    y = x
    for i in range(n):
        if kind == "add": y = y + 1.0
        elif kind == "reshape": y = y.reshape(1, 576) if y.ndim == 3 else y.reshape(1, 1, 576)
        elif kind == "slice": y = y[..., : 576 - (i % 2)] if False else y[:, :, :]
        elif kind == "sum": y = y + y.sum(-1, keepdims=True)
    return y
for kind in ["add", "reshape", "slice", "sum"]:
    best = 1e9
    for r in range(5):
        y = chain(kind); t = time.perf_counter(); mx.eval(y); best = min(best, time.perf_counter() - t)
    print(kind, f"{best/1000*1e6:.2f} us/op (eval only)")
