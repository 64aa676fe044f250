import sys, time, io, re
sys.path.insert(0, '/work/main')
from mlxcel_core import cpu_blas; cpu_blas.install()
import mlx.core as mx
from mlxcel_core.kv.paged_attention import paged_decode_attention as new
sys.path.insert(0, '/tmp'); from old_pa import paged_decode_attention as old
def case(B, Hq, Hkv, D, T, bs=32, vik=None):
    nb = B * (T // bs) + 2
    k = mx.random.normal((nb, bs, Hkv, D)); v = k if vik else mx.random.normal((nb, bs, Hkv, D))
    tables = mx.arange(B * (T // bs)).reshape(B, T // bs).astype(mx.int32)
    q = mx.random.normal((B, Hq, 1, D)); lens = mx.full((B,), T - 3, mx.int32)
    mx.eval(k, v, q)
    return q, k, v, tables, lens
for which, paged_decode_attention in (("old", old), ("new", new), ("old", old), ("new", new)):
  for name, args, kw in [("scaled moonlight b1", (1, 4, 1, 160, 128), dict(values_in_keys=128)), ("scaled moonlight b8", (8, 4, 1, 160, 128), dict(values_in_keys=128)), ("moonlight-like b1", (1, 16, 1, 576, 256), dict(values_in_keys=512)),
                       ("gpt-oss-like b1 sinks", (1, 64, 8, 64, 256), dict(sinks=mx.zeros((64,)))),
                       ("llama-like b8", (8, 32, 8, 128, 512), {})]:
      q, k, v, t, l = case(*args, vik=kw.get("values_in_keys"))
      out = paged_decode_attention(q, k, v, t, l, num_splits=1, **kw)
      buf = io.StringIO(); mx.export_to_dot(buf, out)
      labels = re.findall(r'label ="(\w+)", shape=rectangle', buf.getvalue())
      VIEWS = ("Reshape", "Broadcast", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsType")
      nodes = f"{len(labels)} ({len([x for x in labels if x not in VIEWS])} not views or casts)"
      mx.eval(out)
      t0 = time.perf_counter()
      for _ in range(300):
          mx.eval(paged_decode_attention(q, k, v, t, l, num_splits=1, **kw))
      dt = (time.perf_counter() - t0) / 300 * 1e6
      print(f"{which} {name}: {nodes} graph nodes, {dt:.0f} us a call (CPU)")
