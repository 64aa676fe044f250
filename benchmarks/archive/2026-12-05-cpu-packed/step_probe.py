import time
import mlxcel_core
import mlx.core as mx
from mlxcel_core.loading.load import load_model
from mlxcel_core.cache import make_cache
lm = load_model(None, log=lambda s: None)
model = lm.model
cache = make_cache(len(model.model.layers))
tok = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
y = model(tok, cache=cache); mx.eval(y)
t_build = t_eval = 0.0
n = 40
nxt = mx.argmax(y[:, -1:], axis=-1)
for i in range(n):
    t0 = time.perf_counter()
    y = model(nxt, cache=cache)
    nxt = mx.argmax(y[:, -1:], axis=-1)
    t1 = time.perf_counter()
    mx.eval(nxt)
    t2 = time.perf_counter()
    t_build += t1 - t0; t_eval += t2 - t1
print(f"build {t_build/n*1e3:.2f} ms, eval {t_eval/n*1e3:.2f} ms per token")
