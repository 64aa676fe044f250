import time
import mlxcel_core
import mlx.core as mx
def bench(name, make, n=400):
    best = 1e9
    for r in range(3):
        outs = []
        t0 = time.perf_counter()
        for i in range(n):
            outs.append(make(i))
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        best = min(best, (t2 - t1) / n)
    print(f"{name:40s} eval {best*1e6:6.2f} us/op")
x = mx.random.normal((1, 9, 1, 64)); C = mx.random.normal((1, 1, 1, 64)); mx.eval(x, C)
h = mx.random.normal((1, 1, 576)); w = mx.random.normal((576,)); mx.eval(h, w)
K = mx.zeros((1, 3, 256, 64)); kn = mx.random.normal((1, 3, 1, 64)); mx.eval(K, kn)
idx = mx.array([1, 0, 3, 2] * 16); mx.eval(idx)
q = mx.random.normal((1, 3, 3, 64)); kk = mx.random.normal((1, 3, 70, 64)); mx.eval(q, kk)
bench("multiply same shape [1,9,1,64]", lambda i: x * x)
bench("multiply broadcast [1,1,1,64]", lambda i: x * C)
bench("add [1,1,576]", lambda i: h + h)
bench("reshape (view)", lambda i: x.reshape(1, 1, 9, 64))
bench("transpose (view)", lambda i: x.transpose(0, 2, 1, 3))
bench("take axis -1 (gather)", lambda i: mx.take(x, idx, axis=-1))
bench("slice_update KV [1,3,256,64]", lambda i: mx.slice_update(K, kn, mx.array([0, 0, i % 256, 0]), axes=(0, 1, 2, 3)) if False else None)
bench("softmax [1,3,3,70]", lambda i: mx.softmax(q @ kk.swapaxes(-1, -2), axis=-1))
bench("matmul [1,3,3,64]x[1,3,64,70]", lambda i: q @ kk.swapaxes(-1, -2))
bench("sum axis -1 [1,1,576]", lambda i: mx.sum(h * h, axis=-1, keepdims=True))
bench("rms_norm fast [1,1,576]", lambda i: mx.fast.rms_norm(h, w, 1e-5))
bench("sigmoid [1,1,1536]", lambda i: mx.sigmoid(mx.ones((1, 1, 1536))))
