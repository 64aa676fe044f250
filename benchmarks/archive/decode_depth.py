"""Does queuing several decode steps per mx.async_eval lower a batch-1 token's host cost? (a probe, not the engine)

    python benchmarks/decode_depth.py --model-shape llama-3.2-1b --dtype bfloat16 --depths 1 2 4

The engine builds one decode step, `mx.async_eval`s it, then reads the previous token (lookahead 1). On the H200 a
1B token is host-bound and most of its host time is inside async_eval: MLX encoding the step's kernels into CUDA
graphs and launching them (about 2 cudaGraphLaunch a token at 180-240 us each, benchmarks/host_profile.py). A step's
input token is the previous step's argmax, a lazy array, so the host can build `depth` steps back to back and hand
them to MLX in one async_eval, reading their tokens one group later. If the graph launches and updates are per
async_eval call rather than per kernel, a token's share of them falls with depth. This runs the engine's own pieces
(paged storage, ModelRunner with compiled steps, kernels/greedy.py's tokens) in that loop for each depth, interleaved,
and checks every depth decodes the same tokens. What it leaves out: the engine's bookkeeping (scheduling, stop
checks, detokenizing), and that a deeper queue computes up to depth - 1 tokens past an end of sequence.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import environment, random_prompt  # noqa: E402
from mlxcel_core.engine.compiled_decode import compile_enabled  # noqa: E402
from mlxcel_core.engine.storage import make_storage  # noqa: E402
from mlxcel_core.engine.runner import ModelRunner  # noqa: E402
from mlxcel_core.engine.types import EngineConfig  # noqa: E402
from mlxcel_core.backends.cuda.kernels.greedy import greedy_tokens  # noqa: E402
from mlxcel_core.models.shapes import add_shape_arguments, build_random_model  # noqa: E402


def decode(model, prompt: list[int], count: int, depth: int) -> tuple[list[int], float]:
    """`count` greedy tokens after the prompt, `depth` steps per async_eval; (tokens, seconds of the decode loop)."""
    storage = make_storage(model, EngineConfig(storage="paged", max_batch_size=1), compiled=True)
    runner = ModelRunner(model, storage, compile_enabled())
    storage.add(0, prompt)
    token, readout = greedy_tokens(runner.prefill(0, prompt, 0, last=True))
    mx.eval(token, readout)
    tokens = readout.tolist()
    start = time.perf_counter()
    pending = []  # the previous group's readouts, read after the next group is queued
    made = 0
    while made < count:
        group = []
        for _ in range(min(depth, count - made)):
            token, readout = greedy_tokens(runner.decode((0,), token))
            group.append(readout)
        made += len(group)
        mx.async_eval(token, *group)
        tokens += [t for r in pending for t in r.tolist()]
        pending = group
    tokens += [t for r in pending for t in r.tolist()]
    return tokens, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed per run")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if any(d < 1 for d in args.depths):
        parser.error("--depths must be >= 1")

    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype)
    prompt = random_prompt(config["vocab_size"], args.prompt_tokens, 0, "decode_depth")
    print(f"{args.model_shape} {'%d-bit' % args.bits if args.bits else args.dtype}; {environment()}; "
          f"prompt {args.prompt_tokens}, {args.tokens} tokens timed, compiled steps {compile_enabled()}")
    want, _ = decode(model, prompt, args.tokens, 1)  # warm-up (kernels compile, traces are made)
    speeds: dict[int, list[float]] = {d: [] for d in args.depths}
    for r in range(args.rounds):
        for depth in (args.depths if r % 2 == 0 else args.depths[::-1]):
            got, seconds = decode(model, prompt, args.tokens, depth)
            if got != want:
                first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                print(f"depth {depth}: tokens differ from depth 1's from position {first}")
                return 1
            speeds[depth].append(args.tokens / seconds)
            print(f"round {r + 1} depth {depth}: {args.tokens / seconds:.1f} tok/s")
    base = statistics.median(speeds[args.depths[0]])
    for depth, values in speeds.items():
        med = statistics.median(values)
        print(f"depth {depth}: median {med:.1f} tok/s ({med / base:.3f}x depth {args.depths[0]}); "
              f"the same {len(want)} tokens as depth 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
