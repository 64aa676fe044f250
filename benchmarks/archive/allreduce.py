"""Latency of one `mx.distributed.all_sum` of a decode-sized activation, as tensor parallelism issues them.

    python benchmarks/allreduce.py --tp-size 2 [--hidden 4096] [--rows 1] [--iters 200]

Each timed iteration all-sums one [rows, hidden] bf16 array and evaluates it (a TP decoder layer does two
of these per token, after attention and after the MLP). Also times 64 chained all-sums evaluated once (the
32 layers of an 8B model in one graph), which is what a decode step costs in communication alone.
Without a launcher, --tp-size N starts N local ranks (NCCL, one GPU each, on CUDA; else the ring backend).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()

    from mlxcel_core.distributed import init_group, is_launched, run_local_ranks

    if not is_launched():
        return run_local_ranks(args.tp_size, command=[sys.executable, __file__, *sys.argv[1:]])
    group = init_group(args.tp_size)
    import mlx.core as mx

    x = mx.random.normal((args.rows, args.hidden)).astype(mx.bfloat16)
    mx.eval(x)

    def one():
        mx.eval(mx.distributed.all_sum(x, group=group))

    def chain():
        y = x
        for _ in range(64):
            y = mx.distributed.all_sum(y, group=group) * 0.5
        mx.eval(y)

    results = {}
    for name, fn, iters in (("one_all_sum_us", one, args.iters), ("chain_of_64_ms", chain, max(5, args.iters // 20))):
        for _ in range(10):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        scale = 1e6 if name.endswith("_us") else 1e3
        results[name] = round(statistics.median(times) * scale, 2)
    print(json.dumps({"tp_size": args.tp_size, "shape": [args.rows, args.hidden], "dtype": "bfloat16",
                      "backend": str(mx.default_device()), **results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
