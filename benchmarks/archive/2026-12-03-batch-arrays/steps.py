"""Host time of batched greedy decode steps on a tiny model (the host's share dominates): tokens a second over
--steps engine steps once every row has its first token. Run it against two trees to compare their step code:

    PYTHONPATH=TREE python benchmarks/archive/2026-12-03-batch-arrays/steps.py --batches 8,32,64 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxcel_core.bench import load_bench_model, random_prompt
from mlxcel_core.engine import Engine, EngineConfig
from mlxcel_core.sampling import SamplingParams


class Ids:
    """A tokenizer of ids alone (no text, no EOS)."""

    eos_token_ids: set = set()
    vocab_size = 320

    def decode(self, ids, **_):
        return ""


def tokens_per_second(engine, prompts, steps: int) -> float:
    ids = [engine.open(p, SamplingParams(max_tokens=steps + 64)) for p in prompts]
    started: set[int] = set()
    while len(started) < len(ids):
        started |= {o.seq_id for o in engine.step() if o.token is not None}
    count, t0 = 0, time.perf_counter()
    for _ in range(steps):
        count += sum(o.token is not None for o in engine.step())
    elapsed = time.perf_counter() - t0
    for s in ids:
        engine.close(s)
    while engine.has_work():
        engine.step()
    return count / elapsed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    bench = load_bench_model(None, "tiny", None, "float32")
    for b in (int(x) for x in args.batches.split(",")):
        engine = Engine(bench.model, Ids(), EngineConfig(max_batch_size=b, prefix_cache=False))
        prompts = [random_prompt(bench.vocab_size, 16, "steps", b, i) for i in range(b)]
        tokens_per_second(engine, prompts, 8)  # warm-up
        runs = [tokens_per_second(engine, prompts, args.steps) for _ in range(args.reps)]
        print(f"b={b}: {statistics.median(runs):.1f} tok/s (median of {args.reps}; {min(runs):.1f}-{max(runs):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
