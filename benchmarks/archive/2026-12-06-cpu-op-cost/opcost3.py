import time, mlx.core as mx
x = mx.random.normal((1, 1, 576)); mx.eval(x)
def run(s):
    best = 1e9
    for r in range(5):
        with mx.stream(s):
            y = x
            for i in range(1000): y = y + 1.0
            t = time.perf_counter(); mx.eval(y); best = min(best, time.perf_counter() - t)
    return best / 1000 * 1e6
print("default", run(mx.default_stream(mx.cpu)))
print("unsafe", run(mx.new_thread_unsafe_stream(mx.cpu)))
print("new", run(mx.new_stream(mx.cpu)))
