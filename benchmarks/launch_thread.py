"""Would launching a decode step on a second thread, while the main thread builds the next, lower a batch-1 token's
host cost? (a probe, not the engine)

    python benchmarks/launch_thread.py --model-shape llama-3.2-1b --dtype bfloat16
    python benchmarks/launch_thread.py --model-shape llama-3.2-1b --bits 4 --rounds 5

On the H200 a 1B token is host-bound: of 1.40 ms a token, about 0.97 ms is inside `mx.async_eval` (MLX encoding the
step's kernels into CUDA graphs and launching them) and about 0.40 ms is Python building the next step's graph and
the loop around it (benchmarks/host_profile.py, twelfth session). The engine does them one after the other.
`mx.async_eval` releases the GIL, so a launcher thread could encode step k while the main thread builds step k + 1.

Two MLX facts shape the loop (MLX 0.32):
- Streams belong to the thread that made them ("There is no Stream(gpu, 0) in current thread" elsewhere).
  Everything here runs on one `mx.new_thread_unsafe_stream`, which any thread may evaluate on; keeping two threads
  off it at the same time is this loop's job.
- So the main thread reads a token only while the launcher is idle. It reads the token two steps back (lookahead
  2), so the GPU already holds the step after it.

Modes, interleaved, on the engine's own pieces (paged storage, ModelRunner with compiled steps, kernels/greedy.py):
- inline: build k, async_eval k, read k - 1 (the engine's loop).
- thread: build k (while the launcher encodes k - 1), wait for that launch, read k - 2, hand k to the launcher.
Every mode must decode the same tokens. What it leaves out: the engine's bookkeeping (scheduling, stop checks,
detokenizing), and that lookahead 2 computes a token more past an end of sequence than the engine does now.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import environment, random_prompt  # noqa: E402
from mlxcel_core.engine.compiled_decode import compile_enabled  # noqa: E402
from mlxcel_core.engine.engine import make_storage  # noqa: E402
from mlxcel_core.engine.runner import ModelRunner  # noqa: E402
from mlxcel_core.engine.types import EngineConfig  # noqa: E402
from mlxcel_core.kernels.greedy import greedy_tokens  # noqa: E402
from mlxcel_core.models.shapes import DTYPES, build_random_model, shape_names  # noqa: E402

MODES = ("inline", "thread")


def decode(model, prompt: list[int], count: int, mode: str, stream: mx.Stream) -> tuple[list[int], float]:
    """`count` greedy tokens after the prompt; (tokens, seconds of the decode loop)."""
    with mx.stream(stream):
        storage = make_storage(model, EngineConfig(storage="paged", max_batch_size=1), compiled=True)
        runner = ModelRunner(model, storage, compile_enabled())
        storage.add(0, prompt)
        token, readout = greedy_tokens(runner.prefill(0, prompt, 0, last=True))
        mx.eval(token, readout)
        tokens = readout.tolist()
        start = time.perf_counter()
        if mode == "inline":
            unread = None
            for _ in range(count):
                token, readout = greedy_tokens(runner.decode((0,), token))
                mx.async_eval(token, readout)
                if unread is not None:
                    tokens += unread.tolist()
                unread = readout
            tokens += unread.tolist()
        else:
            # The launcher submits every step, in order, so the storage's own submission of steps that wrote the
            # pools in place (an eval on this thread, racing the launcher) is not needed: its list is dropped.
            storage.submit_in_place_writes = storage.written_in_place.clear
            unread: list[mx.array] = []
            launching = None
            with ThreadPoolExecutor(1) as launcher:
                for _ in range(count):
                    token, readout = greedy_tokens(runner.decode((0,), token))  # while step k - 1 is encoded
                    if launching is not None:
                        launching.result()  # the stream is free
                    if len(unread) == 2:
                        tokens += unread.pop(0).tolist()  # step k - 2: the GPU already holds k - 1
                    launching = launcher.submit(mx.async_eval, token, readout)
                    unread.append(readout)
                launching.result()
            for readout in unread:
                tokens += readout.tolist()
        seconds = time.perf_counter() - start
        mx.synchronize()
    return tokens, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=shape_names(), default="llama-3.2-1b")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype)
    prompt = random_prompt(config["vocab_size"], args.prompt_tokens, 0, "launch_thread")
    stream = mx.new_thread_unsafe_stream(mx.default_device())
    print(f"{args.model_shape} {'%d-bit' % args.bits if args.bits else args.dtype}; {environment()}; "
          f"prompt {args.prompt_tokens}, {args.tokens} tokens timed, compiled steps {compile_enabled()}")
    want, _ = decode(model, prompt, args.tokens, "inline", stream)  # warm-up (kernels compile, traces are made)
    speeds: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            got, seconds = decode(model, prompt, args.tokens, mode, stream)
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                print(f"{mode}: tokens differ from inline's from position {first}")
                return 1
            speeds[mode].append(args.tokens / seconds)
            print(f"round {r + 1} {mode}: {args.tokens / seconds:.1f} tok/s")
    base = statistics.median(speeds["inline"])
    for mode, values in speeds.items():
        med = statistics.median(values)
        print(f"{mode}: median {med:.1f} tok/s ({med / base:.3f}x inline); the same {len(want)} tokens as inline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
