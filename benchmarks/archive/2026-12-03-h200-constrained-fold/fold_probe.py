"""Issue 40, batch 8: where a constrained step's host work should go, three ways in one process, alternating.

    python benchmarks/archive/2026-12-03-h200-constrained-fold/fold_probe.py --model-shape llama-3.2-1b --bits 4 \
        --tokenizer-model DIR [--reps 5 --gen-tokens 64 --prompt-tokens 32 --batch 8]

- split (the engine at this commit): the forward goes to the device, then the host reads the previous step and
  computes the masks, then the masked greedy goes as a second submission.
- fold: the host reads the previous step and computes the masks first, then the forward and the masked greedy go
  as one submission (the device waits for the host's mask work; one submission fewer).
- overlap: the host reads the previous step, hands the masks to a worker thread, submits the forward (MLX releases
  the GIL while it submits) and then the masked greedy.
Printed: tok/s of each (mode, kind) per rep, and the medians' ratios to free.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import mlx.core as mx  # noqa: E402
from structured_outputs import decode_run, load, wide_schema  # noqa: E402

from mlxcel_core.bench import random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig, constrained  # noqa: E402

STOCK = Engine._constrain
POOL = ThreadPoolExecutor(1)


def folded(self, seqs, logits):
    if not any(s.constraint is not None for s in seqs):
        return [], None
    outputs = []
    bitmask = self._masks(seqs, outputs)
    return outputs, None if bitmask is None else mx.array(bitmask)


def overlapped(self, seqs, logits):
    if not any(s.constraint is not None for s in seqs):
        return [], None
    outputs = self._commit(keep=0)
    rows = [s.constraint for s in seqs]
    if all(row is None for row in rows):
        mx.async_eval(logits)
        return outputs, None
    pending = POOL.submit(constrained.next_masks, rows)
    mx.async_eval(logits)
    bitmask, dead = pending.result()
    outputs += [self._dead_end(seqs[i], message) for i, message in dead.items()]
    return outputs, None if len(dead) == len(seqs) else mx.array(bitmask)


MODES = {"split": STOCK, "fold": folded, "overlap": overlapped}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model")
    parser.add_argument("--model-shape")
    parser.add_argument("--bits", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--tokenizer-model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    bench, tokenizer = load(args)
    schema = wide_schema(50)
    engine = Engine(bench.model, tokenizer, EngineConfig(max_batch_size=args.batch))
    b = args.batch
    prompts = [random_prompt(bench.vocab_size, args.prompt_tokens, "structured", b, i) for i in range(b)]
    for mode in MODES.values():  # warm-up
        Engine._constrain = mode
        decode_run(engine, prompts, 8, None)
        decode_run(engine, prompts, 8, schema)
    results: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for name, mode in MODES.items():
            Engine._constrain = mode
            for kind, constraint in (("free", None), ("constrained", schema)):
                tps, _ = decode_run(engine, prompts, args.gen_tokens, constraint)
                results.setdefault(f"{name} {kind}", []).append(tps)
                print(f"rep {rep} {name:8s} {kind:12s} {tps:9.2f} tok/s", flush=True)
    Engine._constrain = STOCK
    free = statistics.median(v for k, vs in results.items() if k.endswith("free") for v in vs)
    print(f"median free (all modes) {free:.2f} tok/s")
    for name in MODES:
        c = statistics.median(results[f"{name} constrained"])
        f = statistics.median(results[f"{name} free"])
        print(f"{name:8s} constrained {c:9.2f}  free {f:9.2f}  ratio {c / f:.3f}x  (to every free run {c / free:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
