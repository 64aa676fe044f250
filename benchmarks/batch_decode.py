"""Aggregate decode tok/s at batch 1, 8, 32: mlxcel's engine vs mlx-lm's BatchGenerator on the SAME weights.

    python benchmarks/batch_decode.py --model-shape llama-3-8b --bits 4
    python benchmarks/batch_decode.py --model-shape smollm2-135m --prompt-tokens 16 --gen-tokens 16 --reps 2

Both runtimes get the same random weights (mlxcel builds them with mlxcel_core.loading.shapes; mlx-lm's model of
the family is built from the same config dict and loads those arrays, so nothing is copied: benchmarks/mlx_lm_twin.py)
and the same prompts (b random 128-token prompts, seeded). EOS is ignored, decoding is greedy. The two models' logits
must agree (--logit-tolerance), and the family first at float32 on a scaled-down copy with random norms and biases;
a family mlx-lm has no model for, or computes differently, is measured for mlxcel only, saying why.
--scale-down runs the shape at test size (benchmarks/scaled_shapes.py): a smoke test, not the shape's speed.

Aggregate decode tok/s = b * n / t, where t runs from the moment every row has its first token (read on the
host) until n more tokens per row have been read: n decode steps of the full batch. Prefill is not in t.
Order is interleaved (mlxcel b=1, mlx-lm b=1, mlxcel b=8, ...) so slow drifts (thermals, other load) hit
both alike; each (runtime, b) has one warm-up run first. mlx-lm is optional: without it, mlxcel alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm_twin import (  # noqa: E402
    TwinMismatch,
    TwinUnavailable,
    add_twin_arguments,
    batch_generator_refusal,
    build_twin,
    check_twin,
    mlx_lm_version,
    spelling_for,
    verify_architecture,
)
from scaled_shapes import scaled_down  # noqa: E402

from mlxcel_core.bench import (  # noqa: E402
    BenchModel,
    RandomIdTokenizer,
    bench_header,
    environment,
    forget_cached_prefixes,
    load_bench_model,
    prefill_wait_steps,
    random_prompt,
    run_requests,
)
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.engine.budget import state_tokens_per_sequence  # noqa: E402
from mlxcel_core.loading.shapes import (  # noqa: E402
    build_random_model,
    count_parameters,
    describe_shape,
    shape_config,
    shape_names,
)


@dataclass
class Measured:
    tps: list[float] = field(default_factory=list)  # aggregate decode tok/s per repetition
    ttft_ms: list[float] = field(default_factory=list)  # mean over rows
    peak_gb: float = 0.0


# -- mlxcel ------------------------------------------------------------------------------------------------
def mlxcel_run(model, vocab: int, prompts: list[list[int]], gen: int, engines: dict) -> tuple[float, float]:
    b = len(prompts)
    margin = prefill_wait_steps(EngineConfig(max_batch_size=b), prompts)
    if b not in engines:
        # + a recurrent state's share of the budget (hybrid models: budget.state_tokens_per_sequence)
        per_row = len(prompts[0]) + gen + 1 + margin + 64 + state_tokens_per_sequence(model)
        config = EngineConfig(max_batch_size=b, kv_budget_tokens=b * per_row)
        engines[b] = Engine(model, RandomIdTokenizer(vocab), config)
    engine = engines[b]
    forget_cached_prefixes(engine)  # identical prompts every repetition: never serve them from the cache
    run = run_requests(engine, prompts, gen + 1 + margin, steady_tokens=gen)
    if run.window_tokens != b * gen:
        raise RuntimeError(f"mlxcel: {run.window_tokens} tokens in the window, expected {b * gen}")
    ttft = statistics.fmean(run.ttft) * 1000
    return run.window_tokens / (run.end - run.window_start), ttft


# -- mlx-lm ----------------------------------------------------------------------------------------------------
def peer_model(args, bench_model: BenchModel, config: dict, say) -> object | None:
    """mlx-lm's model of the shape holding our arrays, checked to compute the same logits; None (said why) when
    mlx-lm cannot build it. TwinMismatch: the two compute different logits."""
    try:
        theirs = build_twin(bench_model.model, config, dtype=args.dtype)
    except TwinUnavailable as e:
        say(f"mlx-lm comparison SKIPPED for {args.model_shape}: {e}; measuring mlxcel only")
        return None
    if refusal := batch_generator_refusal(theirs):
        say(f"mlx-lm comparison SKIPPED for {args.model_shape}: {refusal}; measuring mlxcel only")
        return None
    say(f"mlx-lm {mlx_lm_version()}: BatchGenerator")
    check_twin(bench_model.model, theirs, config, bench_model.vocab_size, say, args.logit_tolerance)
    return theirs


def check_family(args, say) -> bool:
    """Whether mlx-lm can compare the shape's family (said why not), after the float32 scaled-down check unless
    --no-arch-check. TwinMismatch: the family computes different logits in mlx-lm."""
    try:
        mlx_lm_version()
        spelling_for(shape_config(args.model_shape))
        if not args.no_arch_check:
            say(verify_architecture(args.model_shape, bits=args.bits, seed=args.seed))
    except TwinUnavailable as e:
        say(f"mlx-lm comparison SKIPPED for {args.model_shape}: {e}; measuring mlxcel only")
        return False
    return True


def load_ours(args) -> tuple[BenchModel, dict]:
    """mlxcel's random-weight model of the shape (--scale-down: at test size) and its config."""
    if not args.scale_down:
        bench_model = load_bench_model(shape=args.model_shape, bits=args.bits, dtype=args.dtype, seed=args.seed)
        return bench_model, shape_config(args.model_shape)
    config, summary = scaled_down(shape_config(args.model_shape))
    model, config = build_random_model(args.model_shape, args.bits, args.dtype, args.seed, config=config)
    n_params, size = count_parameters(model)
    description = f"{describe_shape(args.model_shape, args.bits, args.dtype)}, {summary}: a smoke test, not its speed"
    return BenchModel(model, config["vocab_size"], description, args.model_shape, n_params, size), config


def mlx_lm_run(model, prompts: list[list[int]], gen: int) -> tuple[float, float]:
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    # No stop tokens: EOS ignored. completion_batch_size=b: every row decodes in one batch.
    generator = BatchGenerator(model, max_tokens=gen + 1 + b + 2, stop_tokens=None, completion_batch_size=b)
    try:
        submitted = time.perf_counter()
        uids = generator.insert(prompts)
        first: dict[int, float] = {}
        done: set[int] = set()
        window_start, window_tokens, end = None, 0, None
        while True:
            _, responses = generator.next()
            now = time.perf_counter()
            for r in responses:
                if r.uid not in first:
                    first[r.uid] = now
                elif window_start is not None:
                    window_tokens += 1
                if r.finish_reason is not None:
                    done.add(r.uid)
            if window_start is None and len(first) == b:
                window_start = now
            if window_start is not None and (window_tokens >= b * gen or len(done) == b):
                end = now
                break
            if len(done) == b:
                raise RuntimeError("mlx-lm finished before the window closed")
        generator.remove(uids)
    finally:
        generator.close()
    if window_tokens != b * gen:
        raise RuntimeError(f"mlx-lm: {window_tokens} tokens in the window, expected {b * gen}")
    return window_tokens / (end - window_start), statistics.fmean(t - submitted for t in first.values()) * 1000


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", required=True, choices=shape_names())
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per (runtime, batch), after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mlx-lm", action="store_true", help="measure mlxcel only")
    add_twin_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        if not args.no_mlx_lm:  # before the model is built: whether mlx-lm can compare this family at all
            args.no_mlx_lm = not check_family(args, say)
        bench_model, config = load_ours(args)
        vocab = bench_model.vocab_size
        say(bench_header(bench_model))
        theirs = None if args.no_mlx_lm else peer_model(args, bench_model, config, say)
    except TwinMismatch as e:
        print(f"batch_decode: error: {e}", file=sys.stderr)
        return 1
    runtimes = ["mlxcel"] + (["mlx-lm"] if theirs is not None else [])
    say(
        f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} new tokens per sequence, greedy, EOS ignored; "
        f"{args.reps} timed run(s) after 1 warm-up per cell; "
        + ("mlxcel and mlx-lm" if theirs is not None else "mlx-lm: not measured")
    )

    prompts = {
        b: [random_prompt(vocab, args.prompt_tokens, args.seed, "batch", row) for row in range(b)] for b in batches
    }
    engines: dict = {}

    def once(runtime: str, b: int) -> tuple[float, float]:
        if runtime == "mlxcel":
            return mlxcel_run(bench_model.model, vocab, prompts[b], args.gen_tokens, engines)
        return mlx_lm_run(theirs, prompts[b], args.gen_tokens)

    results = {(r, b): Measured() for b in batches for r in runtimes}
    for rep in range(-1, args.reps):  # -1: the warm-up round
        for b in batches:
            for runtime in runtimes:
                mx.clear_cache()
                mx.reset_peak_memory()
                tps, ttft = once(runtime, b)
                cell = results[(runtime, b)]
                cell.peak_gb = max(cell.peak_gb, mx.get_peak_memory() / 1e9)
                what = "warm-up" if rep < 0 else f"run {rep + 1}/{args.reps}"
                print(
                    f"  {runtime:6} b={b:<3} {what}: {tps:.2f} tok/s aggregate, TTFT {ttft:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
                if rep >= 0:
                    cell.tps.append(tps)
                    cell.ttft_ms.append(ttft)

    print()
    print("| runtime | b | decode t/s (aggregate) | per sequence t/s | mean TTFT ms | peak GB |")
    print("| ------- | -: | ---------------------: | ---------------: | -----------: | ------: |")
    for b in batches:
        for runtime in runtimes:
            cell = results[(runtime, b)]
            mean = statistics.fmean(cell.tps)
            sd = statistics.stdev(cell.tps) if len(cell.tps) > 1 else 0.0
            print(
                f"| {runtime} | {b} | {mean:.2f} ± {sd:.2f} | {mean / b:.2f} | "
                f"{statistics.fmean(cell.ttft_ms):.0f} | {cell.peak_gb:.3f} |"
            )
        if len(runtimes) == 2:
            ratio = statistics.fmean(results[("mlxcel", b)].tps) / statistics.fmean(results[("mlx-lm", b)].tps)
            print(f"| mlxcel / mlx-lm | {b} | {ratio:.3f}x | | | |")
    env = environment()
    print(f"\nbackend {env['backend']}, mlx {env['mlx_version']}, mlxcel {env['mlxcel_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
