"""What an array mask costs MLX's decode attention, and what compiling saves: 16 layers' worth of one decode step.

    python benchmarks/masked_attention.py

Per layer: write one new key/value column into a [1, Hkv, cap, D] cache buffer, then attend with one query.
  eager slice-assign + sdpa(no mask)  what cache.KVCache does: Python-int slice assignment, attend over the used
                                      columns only (MLX's fused decode kernel)
  masked / additive                   what a compiled step must do (engine/compiled_decode.py StepKV): dynamic
                                      slice_update at an array column, attend over the whole buffer through a
                                      boolean / additive mask; eager and mx.compile'd
  only_update                         the two slice_updates alone
Time: median wall time of 30 (built, evaluated and read back), after 3 warm-ups. Random bf16 data.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

LAYERS = 16
SHAPES = ((32, 8, 64, 768, 600), (32, 8, 128, 768, 600))  # q heads, kv heads, head dim, capacity, used columns


def bench(name: str, fn, reps: int = 30) -> None:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    print(f"{name:40s} {statistics.median(times) * 1e6:8.0f} us", flush=True)


def steps(cap: int):
    """The three per-step variants, each over all layers' buffers."""

    def masked(q, kn, col, keys, values, additive=False):
        outs, new_k, new_v = [], [], []
        visible = mx.arange(cap) <= col
        mask = mx.where(visible, 0.0, -mx.inf).astype(q.dtype) if additive else visible
        for k, v in zip(keys, values):
            k = mx.slice_update(k, kn, col, axes=(2,))
            v = mx.slice_update(v, kn, col, axes=(2,))
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask[None, None, None, :]))
            new_k.append(k)
            new_v.append(v)
        return outs, new_k, new_v

    def additive(q, kn, col, keys, values):
        return masked(q, kn, col, keys, values, additive=True)

    def only_update(q, kn, col, keys, values):
        return ([], [mx.slice_update(k, kn, col, axes=(2,)) for k in keys],
                [mx.slice_update(v, kn, col, axes=(2,)) for v in values])

    return {"masked": masked, "additive": additive, "only_update": only_update}


def main() -> int:
    print(f"mlx {mx.__version__}, {mx.default_device()}")
    for heads, kv_heads, dim, cap, used in SHAPES:
        print("heads", heads, kv_heads, "dim", dim, "cap", cap, "n", used)
        q = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)
        kn = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
        cache = {"k": [mx.random.normal((1, kv_heads, cap, dim)).astype(mx.bfloat16) for _ in range(LAYERS)],
                 "v": [mx.random.normal((1, kv_heads, cap, dim)).astype(mx.bfloat16) for _ in range(LAYERS)]}
        mx.eval(q, kn, cache["k"], cache["v"])

        def eager_kvcache():
            outs = []
            for k, v in zip(cache["k"], cache["v"]):
                k[..., used:used + 1, :] = kn
                v[..., used:used + 1, :] = kn
                outs.append(mx.fast.scaled_dot_product_attention(q, k[..., :used + 1, :], v[..., :used + 1, :],
                                                                 scale=0.1))
            mx.eval(outs, cache["k"], cache["v"])

        bench("eager slice-assign + sdpa(no mask)", eager_kvcache)
        for name, fn in steps(cap).items():
            for how, step in (("eager", fn), ("compiled", mx.compile(fn))):
                def run(step=step):
                    outs, cache["k"], cache["v"] = step(q, kn, mx.array([used], mx.int32), cache["k"], cache["v"])
                    mx.eval(outs, cache["k"], cache["v"])

                bench(f"{name} {how}", run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
