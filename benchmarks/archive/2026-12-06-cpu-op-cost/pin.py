import os, sys, time
import mlxcel_core
import mlx.core as mx
from mlxcel_core.loading.load import load_model
from mlxcel_core.cache import make_cache
lm = load_model(None, log=lambda s: None)
model = lm.model
def tids():
    return sorted(int(t) for t in os.listdir("/proc/self/task"))
def cputime(t):
    f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
def run(n=64):
    cache = make_cache(len(model.model.layers))
    y = model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]), cache=cache)
    nxt = mx.argmax(y[:, -1:], axis=-1); mx.eval(nxt)
    t0 = time.perf_counter()
    for i in range(n):
        y = model(nxt, cache=cache); nxt = mx.argmax(y[:, -1:], axis=-1); mx.async_eval(nxt)
    mx.eval(nxt)
    return n / (time.perf_counter() - t0)
run(8)
before = {t: cputime(t) for t in tids()}
run(32)
after = {t: cputime(t) for t in tids()}
busy = sorted(((after[t] - before.get(t, 0)), t) for t in after)
print("threads (ticks, tid):", busy, "main", os.getpid())
main = os.getpid()
others = [t for c, t in busy if t != main and c > 0]
mode = sys.argv[1]
def pin(t, cpus): os.sched_setaffinity(t, cpus)
if mode == "main0": pin(main, {0})
elif mode == "pair":  # main and the busiest other thread (MLX's worker?) on core 0, the rest on core 1
    pin(main, {0}); w = max(others, key=lambda t: after[t] - before[t]); pin(w, {0})
    for t in others:
        if t != w: pin(t, {1})
elif mode == "pairlow":  # main with the second-busiest other thread on core 0, the busiest on core 1
    pin(main, {0}); srt = sorted(others, key=lambda t: after[t] - before[t]); w, o = srt[-2], srt[-1]
    pin(w, {0}); pin(o, {1})
    for t in others:
        if t not in (w, o): pin(t, {1})
elif mode == "pair2":  # main on 0, the busiest other on 0, no pin for the rest
    pin(main, {0}); w = max(others, key=lambda t: after[t] - before[t]); pin(w, {0})
for r in range(3):
    print(mode, f"{run():.2f} tok/s")
