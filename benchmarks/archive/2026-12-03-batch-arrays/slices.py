"""What a batch's per-row slices cost the host in MLX: an argmax step submitted as a slice per row (tokens and
readouts) plus the readouts' concatenation and the next step's token concatenation, against the two whole arrays.

    python benchmarks/archive/2026-12-03-batch-arrays/slices.py
"""

from __future__ import annotations

import time

import mlx.core as mx

WARMUP, STEPS = 20, 300


def step(x: mx.array, whole: bool) -> None:
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    readout = tokens + 0
    if whole:
        mx.async_eval([tokens, readout])
        host, following = readout, tokens
    else:
        rows = [tokens[i : i + 1] for i in range(x.shape[0])]
        reads = [readout[i : i + 1] for i in range(x.shape[0])]
        host = mx.concatenate(reads)
        mx.async_eval(rows + reads + [host])
        following = mx.concatenate(rows)
    host.tolist()
    mx.eval(following)


def main() -> None:
    for b in (8, 32, 64):
        x = mx.random.normal((b, 1000))
        mx.eval(x)
        for whole in (False, True, False, True):
            for _ in range(WARMUP):
                step(x, whole)
            t0 = time.perf_counter()
            for _ in range(STEPS):
                step(x, whole)
            us = (time.perf_counter() - t0) / STEPS * 1e6
            print(f"b={b} {'whole' if whole else 'slices'}: {us:.1f} us a step")


if __name__ == "__main__":
    main()
