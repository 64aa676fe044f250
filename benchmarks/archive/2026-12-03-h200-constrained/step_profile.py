"""Where a constrained batch's decode step spends the host's time, against a free batch's (issue 40, batch 8 on the
H200): wall time per step, and inside it the host's time in the engine's parts (reading earlier steps, which waits
for the device; the masks; building the masked greedy; advancing matchers).

    python benchmarks/archive/2026-12-03-h200-constrained/step_profile.py --model-shape llama-3.2-1b --bits 4 \
        --tokenizer-model DIR --batch 8 --steps 64
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "benchmarks"))


def timed(owner, name: str, totals: dict, counts: dict):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            counts[name] += 1

    setattr(owner, name, wrapper)


def main() -> int:
    from structured_outputs import load, wide_schema

    from mlxcel_core import backends
    from mlxcel_core.bench import forget_cached_prefixes, random_prompt, run_requests
    from mlxcel_core.engine import Engine, EngineConfig, constrained
    from mlxcel_core.engine import engine as engine_module
    from mlxcel_core.sampling import SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--model-shape")
    parser.add_argument("--bits", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--tokenizer-model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    bench, tokenizer = load(args)
    engine = Engine(bench.model, tokenizer, EngineConfig(max_batch_size=args.batch))
    prompts = [random_prompt(bench.vocab_size, 32, "profile", args.batch, i) for i in range(args.batch)]
    schema = wide_schema(50)
    totals, counts = defaultdict(float), defaultdict(int)
    for name in ("step", "_commit", "_masks", "_constrain", "_run", "_submit", "_graph_decode"):
        timed(engine, name, totals, counts)
    timed(constrained, "next_masks", totals, counts)
    timed(engine_module.constrained, "apply_bitmask", totals, counts)
    backend = backends.current()
    for name in ("greedy_tokens", "masked_greedy_tokens"):
        timed(backend, name, totals, counts)
    timed(constrained.RowConstraint, "advance", totals, counts)
    timed(engine.runner, "decode", totals, counts)
    for kind, constraint in (("free", None), ("constrained", schema), ("free", None), ("constrained", schema)):
        forget_cached_prefixes(engine)
        params = SamplingParams(max_tokens=args.steps + 2, constraint=constraint)
        run_requests(engine, prompts, params.max_tokens, params=params)  # warm
        totals.clear(), counts.clear()
        forget_cached_prefixes(engine)
        start = time.perf_counter()
        run = run_requests(engine, prompts, params.max_tokens, steady_tokens=args.steps, params=params)
        wall = time.perf_counter() - start
        steps = counts["step"]
        print(
            f"{kind}: {run.window_tokens / (run.end - run.window_start):.1f} tok/s; {steps} steps, {wall / steps * 1e3:.3f} ms a step"
        )
        for name in sorted(totals, key=lambda n: -totals[n]):
            print(f"    {name:22s} {totals[name] / steps * 1e3:8.3f} ms a step  ({counts[name]} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
