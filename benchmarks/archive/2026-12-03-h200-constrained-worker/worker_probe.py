"""Issue 40, batch 8: the constrained step's host work on a worker thread while the forward is submitted.

    python benchmarks/archive/2026-12-03-h200-constrained-worker/worker_probe.py --model-shape llama-3.2-1b \
        --bits 4 --tokenizer-model DIR [--reps 5 --gen-tokens 64 --prompt-tokens 32 --batch 8]

fold_probe.py (archive/2026-12-03-h200-constrained-fold/) found that reading the previous step before the next
forward is submitted costs ~2 ms a step on the H200. Here the engine's thread submits the forward first, as the engine
does (split), and a worker thread does the rest of `_constrain`'s host part meanwhile: it reads the previous step
(waiting for the device without the engine's thread), commits its tokens (the matchers advance) and computes the
masks. MLX releases the GIL while it submits, so the two overlap; the engine's thread then waits for the worker and
submits the masked greedy. Modes, alternating in one process:
- split: the engine at this commit.
- worker: the above, CPython's default GIL switch interval (5 ms).
- worker-50us: the same with a 50 us switch interval (the engine's thread wants the GIL back when its submission
  returns; the worker may be holding it).
First, each worker mode's constrained tokens are checked against split's (the same greedy tokens, row by row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import mlxcel_core  # noqa: E402, F401  (first: on a CPU it installs the BLAS before MLX loads)

# isort: split
import mlx.core as mx  # noqa: E402
from structured_outputs import decode_run, load, wide_schema  # noqa: E402

from mlxcel_core.bench import random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402

STOCK = Engine._constrain
POOL = ThreadPoolExecutor(1)
DEFAULT_INTERVAL = sys.getswitchinterval()


def on_worker(self, seqs, logits):
    if not any(s.constraint is not None for s in seqs):
        return [], None
    outputs = []
    pending = POOL.submit(self._masks, seqs, outputs)  # reads the earlier steps, commits them, computes the masks
    mx.async_eval(logits)
    bitmask = pending.result()
    return outputs, None if bitmask is None else mx.array(bitmask)


MODES = {"split": (STOCK, DEFAULT_INTERVAL), "worker": (on_worker, DEFAULT_INTERVAL), "worker-50us": (on_worker, 5e-5)}


def use(mode: str) -> None:
    Engine._constrain, interval = MODES[mode]
    sys.setswitchinterval(interval)


def tokens(engine, prompts, schema, gen: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=gen, constraint=schema)
    ids = [engine.open(p, params) for p in prompts]
    out = {i: [] for i in ids}
    while engine.has_work():
        for o in engine.step():
            if o.token is not None:
                out[o.seq_id].append(o.token)
    return [out[i] for i in ids]


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
    engine = Engine(bench.model, tokenizer, EngineConfig(max_batch_size=args.batch, prefix_cache=False))
    b = args.batch
    prompts = [random_prompt(bench.vocab_size, args.prompt_tokens, "structured", b, i) for i in range(b)]
    use("split")
    expected = tokens(engine, prompts, schema, 24)
    for mode in MODES:
        use(mode)
        same = tokens(engine, prompts, schema, 24) == expected
        print(f"{mode}: constrained tokens {'equal' if same else 'DIFFER FROM'} split's", flush=True)
        decode_run(engine, prompts, 8, None)  # warm-up
        decode_run(engine, prompts, 8, schema)
    results: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for mode in MODES:
            use(mode)
            for kind, constraint in (("free", None), ("constrained", schema)):
                tps, _ = decode_run(engine, prompts, args.gen_tokens, constraint)
                results.setdefault(f"{mode} {kind}", []).append(tps)
                print(f"rep {rep} {mode:12s} {kind:12s} {tps:9.2f} tok/s", flush=True)
    use("split")
    for mode in MODES:
        c = statistics.median(results[f"{mode} constrained"])
        f = statistics.median(results[f"{mode} free"])
        print(f"{mode:12s} constrained {c:9.2f}  free {f:9.2f}  ratio {c / f:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
