"""The prefill chunk beside a running row: the longest engine step while one stream decodes and an N-token prompt
arrives, per chunk size.

    python benchmarks/prefill_chunk.py --chunks 64,32,16,8 --prompt-tokens 256              # the default model
    python benchmarks/prefill_chunk.py --model-shape llama-3.2-1b --bits 4 --chunks 2048,512,128 --prompt-tokens 2000

Through the Engine (batch 2; a prefill chunk granted after every --grant-interval decode steps, 1 by default, where
`mlxcel serve` keeps the engine's 16: that spaces the chunks, which lengthens the whole prefill but not the longest
step): a short prompt decodes until it streams, then the long prompt is opened; every step until the long prompt's
first token is timed, in wall time and in the process's CPU time (on a shared machine the wall time also holds
other processes' turns). Per chunk size: the longest step (what the running stream waits at most), the whole
prompt's prefill (opened -> first token) and the steps it took. A decode step alone (the stream before the prompt
arrives, median) gives the scale. Greedy; random prompt ids; the first chunk size is run once more first, as a
warm-up. backends/base.py's CPU_PREFILL_CHUNK and GPU_PREFILL_CHUNK come from these figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_core.loading.shapes import DTYPES, shape_names  # noqa: E402


class Clock:
    """Wall and process CPU seconds since `start`."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def measure(bench, chunk: int, prompt: list[int], decode_steps: int, grant_interval: int = 1) -> dict:
    """One run at `chunk`: the stream's decode steps alone, then every step until the long prompt's first token."""
    from mlxcel_core.bench_model import RandomIdTokenizer
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    engine = Engine(
        bench.model,
        RandomIdTokenizer(bench.vocab_size),
        EngineConfig(max_batch_size=2, prefill_chunk_size=chunk, prefill_grant_interval=grant_interval),
    )
    running = engine.open(
        [5, 6, 7], SamplingParams(max_tokens=decode_steps + (len(prompt) // chunk + 2) * (grant_interval + 1) + 64)
    )
    while not any(o.seq_id == running and o.token is not None for o in engine.step()):
        pass
    alone, clock = [], Clock()
    for _ in range(decode_steps):
        engine.step()
        alone.append(clock.lap())
    long = engine.open(prompt, SamplingParams(max_tokens=1))
    steps, began, clock = [], Clock(), Clock()
    while True:
        outputs = engine.step()
        steps.append(clock.lap())
        if any(o.seq_id == long and o.token is not None for o in outputs):
            break
    whole = began.lap()
    engine.close(running)
    while engine.has_work():
        engine.step()
    return {
        "chunk": chunk,
        "longest_step_wall_s": round(max(w for w, _ in steps), 4),
        "longest_step_cpu_s": round(max(c for _, c in steps), 4),
        "prefill_wall_s": round(whole[0], 3),
        "prefill_cpu_s": round(whole[1], 3),
        "steps": len(steps),
        "decode_step_wall_s": round(statistics.median(w for w, _ in alone), 4),
        "decode_step_cpu_s": round(statistics.median(c for _, c in alone), 4),
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", help="checkpoint (default: the default model, unless --model-shape)")
    parser.add_argument("--model-shape", choices=shape_names(), help="random weights of this shape")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--chunks", default="64,32,16,8", help="comma-separated chunk sizes (tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=8, help="steps the stream decodes alone first")
    parser.add_argument("--grant-interval", type=int, default=1, help="decode steps between prefill chunks")
    parser.add_argument("--json", action="store_true", help="one JSON object per chunk size")
    args = parser.parse_args(argv)
    try:
        args.chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks: comma-separated integers, got {args.chunks!r}")
    if any(c < 1 for c in args.chunks) or args.prompt_tokens < 2 or args.grant_interval < 1:
        parser.error("chunk sizes and --grant-interval must be >= 1, --prompt-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mlxcel_core.bench_model import load_bench_model
    from mlxcel_core.errors import InputError

    try:
        bench = load_bench_model(args.model, args.model_shape, args.bits, args.dtype)
    except InputError as exc:
        print(f"prefill_chunk: {exc}", file=sys.stderr)
        return 2
    rng = random.Random(0)
    prompt = [rng.randrange(3, bench.vocab_size) for _ in range(args.prompt_tokens)]
    measure(bench, args.chunks[0], prompt, 2)  # warm-up
    if not args.json:
        print(f"{bench.description}: one stream decoding beside a {args.prompt_tokens}-token prompt")
        print("chunk | longest step wall / CPU s | whole prefill wall / CPU s | steps | decode step alone wall / CPU s")
    for chunk in args.chunks:
        row = measure(bench, chunk, prompt, args.decode_steps, args.grant_interval)
        if args.json:
            print(json.dumps({"model": bench.description, "prompt_tokens": args.prompt_tokens, **row}), flush=True)
        else:
            print(
                f"{chunk:5d} | {row['longest_step_wall_s']:8.3f} / {row['longest_step_cpu_s']:7.3f} | "
                f"{row['prefill_wall_s']:8.2f} / {row['prefill_cpu_s']:7.2f} | {row['steps']:5d} | "
                f"{row['decode_step_wall_s']:.3f} / {row['decode_step_cpu_s']:.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
