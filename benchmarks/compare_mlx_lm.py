"""Batch-1 speed of mlxcel vs mlx-lm on the same model and prompt, run alternately: prefill, TTFT, decode tok/s.

    python benchmarks/compare_mlx_lm.py --model ./SmolLM2-135M-Instruct            # an HF / MLX directory
    python benchmarks/compare_mlx_lm.py --model ./model.Q4_1.gguf --rounds 3        # mlx-lm gets the same arrays
    python benchmarks/compare_mlx_lm.py --model-shape llama-3.2-1b --bits 4 --json  # random weights

Models: mlxcel loads with `mlxcel_core.load_model`; mlx-lm loads a directory or Hub id with `mlx_lm.load`.
mlx-lm cannot read GGUF files and has no random-weight shapes, so for a .gguf or --model-shape its Model
class is built from mlxcel's config dict and loads mlxcel's arrays (quantized layers with the same group
size and bits): the very same weights, shared, not copied (benchmarks/mlx_lm_twin.py, per family). The script
prints how far the two models' logits differ and stops unless they agree (--logit-tolerance); for a shape it first
checks the family at float32 on a scaled-down copy with random norms and biases, where the two agree to rounding.
A family mlx-lm has no model for, or computes differently, is skipped with the reason.
--scale-down runs a shape at test size (benchmarks/scaled_shapes.py): a smoke test of the comparison, not a speed.

Timing, identical for both: one prompt of --prompt-tokens random token ids (seeded), greedy, EOS ignored,
no detokenization (mlxcel: an Engine whose tokenizer has no EOS and no text; mlx-lm: `generate_step`, which
neither stops at EOS nor detokenizes). t0 is taken before the request is handed over; TTFT is until the first
token is on the host (prefill tok/s = prompt tokens / TTFT); decode tok/s = N / (time of token N + 1 -
time of token 1), N = --gen-tokens. One warm-up run each, as long as a timed one, then --rounds rounds; each
round runs both, the first one alternating (mlxcel first in odd rounds), so slow drifts and background load hit both
alike.

mlxcel keeps one Engine for the whole comparison, as `mlxcel serve` and `mlxcel bench` do, with its prefix cache
emptied before every run (bench.forget_cached_prefixes: no run reuses the previous one's identical prompt). On CUDA
that keeps the decode step's CUDA graph recorded in the warm-up (backends/cuda/graph_decode.py), as a server keeps it;
the last line says how many steps were replayed (Engine.stats()). (Older rows in
benchmarks/archive/RESULTS-history.md made a new Engine a run: those timed runs also recorded their graph.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxcel_core  # noqa: F401,E402  (before mlx: MLX's CPU products on OpenBLAS, cpu_blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm_twin import (  # noqa: E402
    TwinMismatch,
    TwinUnavailable,
    activation_dtype,
    add_twin_arguments,
    build_twin,
    check_twin,
    mlx_lm_version,
    spelling_for,
    verify_architecture,
)
from scaled_shapes import scaled_down  # noqa: E402

from mlxcel_core.bench import RandomIdTokenizer, environment, forget_cached_prefixes, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.loading.shapes import (  # noqa: E402
    DTYPES,
    build_random_model,
    describe_shape,
    shape_config,
    shape_names,
)
from mlxcel_core.sampling import SamplingParams  # noqa: E402

RUNTIMES = ("mlxcel", "mlx-lm")


@dataclass
class Run:
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    tokens: list[int] = field(repr=False)


def timed(tokens_and_times: list[tuple[int, float]], t0: float, prompt_len: int) -> Run:
    tokens = [t for t, _ in tokens_and_times]
    times = [s for _, s in tokens_and_times]
    ttft = times[0] - t0
    return Run(ttft, prompt_len / ttft, (len(times) - 1) / (times[-1] - times[0]), tokens)


# -- mlxcel: its engine, as generate/run/serve use it ------------------------------------------------------------
def mlxcel_engine(
    model, vocab: int, storage: str = "auto", max_batch_size: int = 1, decode_graph: bool = True
) -> Engine:
    config = EngineConfig(max_batch_size=max_batch_size, storage=storage, decode_graph=decode_graph)
    return Engine(model, RandomIdTokenizer(vocab), config)  # no EOS, no text


def run_mlxcel(engine: Engine, prompt: list[int], gen: int) -> Run:
    forget_cached_prefixes(engine)
    computed = engine.stats().prefill_tokens
    seen: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    seq = engine.open(prompt, SamplingParams(max_tokens=gen + 1))  # greedy
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(f"mlxcel: {out.error}")
            if out.token is not None:
                seen.append((out.token, now))
    engine.release(seq)
    computed = engine.stats().prefill_tokens - computed
    if computed != len(prompt):  # the whole prompt, as mlx-lm computes it
        raise RuntimeError(f"mlxcel computed {computed} of {len(prompt)} prompt tokens")
    return timed(seen, t0, len(prompt))


# -- mlx-lm: generate_step, the loop under mlx_lm.generate / stream_generate ---------------------------------------
def run_mlx_lm(model, prompt: list[int], gen: int) -> Run:
    from mlx_lm.generate import generate_step

    seen: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=gen + 1):  # greedy, never stops at EOS
        seen.append((int(token), time.perf_counter()))
    return timed(seen, t0, len(prompt))


def load_both(args) -> tuple[object, object, int, str, str, dict]:
    """(mlxcel model, mlx-lm model, vocab size, model description, how mlx-lm got its model, config)."""
    if args.model_shape:
        config = shape_config(args.model_shape)
        description = describe_shape(args.model_shape, args.bits, args.dtype)
        if args.scale_down:
            config, summary = scaled_down(config)
            description += f", {summary}: a smoke test, not this shape's speed"
        spelling_for(config)  # a family mlx-lm cannot compare: say so before building anything
        ours, config = build_random_model(
            args.model_shape, bits=args.bits, dtype=args.dtype, seed=args.seed, config=config
        )
        theirs = build_twin(ours, config, dtype=args.dtype)
        held = "mlxcel's arrays" if activation_dtype(ours) == activation_dtype(theirs) else f"{args.dtype} copies"
        how = f"mlx-lm Model built from the shape's config, holding {held}"
        return ours, theirs, config["vocab_size"], description, how, config
    from mlxcel_core import load_model

    loaded = load_model(args.model)
    ours, config = loaded.model, loaded.config
    vocab = int(config.get("vocab_size") or loaded.tokenizer.vocab_size)
    kinds = sorted({str(v.dtype).split(".")[-1] for _, v in tree_flatten(ours.parameters())})
    description = f"{loaded.source.origin} ({config.get('model_type')}, {'/'.join(kinds)})"
    if loaded.source.kind == "gguf":
        return (
            ours,
            build_twin(ours, config),
            vocab,
            description,
            "mlx-lm cannot read GGUF: its Model built from mlxcel's config, holding mlxcel's arrays",
            config,
        )
    import mlx_lm

    theirs, _ = mlx_lm.load(str(loaded.source.path) if loaded.source.path else args.model)
    return ours, theirs, vocab, description, "mlx_lm.load on the same directory", config


def set_up(args, say, version: str):
    """Both models, checked: (ours, theirs, vocab, description, how mlx-lm got its model, Agreement, environment).
    TwinUnavailable: mlx-lm cannot compare this family; TwinMismatch: the two compute different logits."""
    if args.model_shape and not args.no_arch_check:
        spelling_for(shape_config(args.model_shape))
        say(verify_architecture(args.model_shape, bits=args.bits, seed=args.seed))
    ours, theirs, vocab, description, how, config = load_both(args)
    env = environment()
    say(
        f"mlxcel {env['mlxcel_version']}, mlx-lm {version}, mlx {env['mlx_version']}, "
        f"backend {env['backend']} ({env['device']})"
    )
    say(f"model: {description}; {how}")
    agreement = check_twin(ours, theirs, config, vocab, say, args.logit_tolerance)
    return ours, theirs, vocab, description, how, agreement, env


def describe_graph(engine: Engine, warm_replayed: int, timed_steps: int) -> str:
    """What the engine's CUDA graph did in the timed rounds (so a silent fallback shows in the output)."""
    stats = engine.stats()
    if stats.graph_replayed is None:
        return "not used (a backend without one, e.g. CPU or MLXCEL_CUDA=0, or a configuration it does not serve)"
    if stats.graph_not_replaying:
        return f"not replayable for this model: {stats.graph_not_replaying}"
    return f"{stats.graph_replayed - warm_replayed} of {timed_steps} timed decode steps replayed"


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", help="directory, .gguf or Hub id (default: mlxcel's default model)")
    what.add_argument("--model-shape", choices=shape_names(), help="random weights of a known architecture")
    parser.add_argument("--bits", type=int, choices=(4, 8), help="--model-shape: quantize (group size 64)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="--model-shape: weight dtype")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64, help="decode steps timed after the first token")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--storage",
        default="auto",
        choices=("auto", "dense", "paged"),
        help="mlxcel's KV storage (auto: paged on CUDA, else dense at batch 1)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (progress on stderr)")
    add_twin_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.gen_tokens < 1 or args.rounds < 1:
        parser.error("--prompt-tokens, --gen-tokens and --rounds must be >= 1")
    if (args.bits or args.dtype != "bfloat16" or args.scale_down) and not args.model_shape:
        parser.error("--bits, --dtype and --scale-down apply to --model-shape only")
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        peer_version = mlx_lm_version()
    except TwinUnavailable as e:
        parser.error(str(e))
    try:
        ours, theirs, vocab, description, how, agreement, env = set_up(args, say, peer_version)
    except TwinUnavailable as e:
        say(f"SKIPPED {args.model_shape or args.model}: {e}; no comparison is made")
        if args.json:
            print(json.dumps({"model": args.model_shape or args.model, "skipped": str(e)}))
        return 0
    except TwinMismatch as e:
        print(f"compare_mlx_lm: error: {e}", file=sys.stderr)
        return 1
    from mlxcel_core import backends
    from mlxcel_core.engine.compiled_decode import describe_decode_steps

    say(
        f"mlxcel KV storage {args.storage} ({EngineConfig(storage=args.storage).resolved_storage} at batch 1); "
        f"decode steps {describe_decode_steps()}; backend {backends.current().name}: {backends.current().describe()}"
    )
    say(
        f"prompt {args.prompt_tokens} random token ids (seed {args.seed}), {args.gen_tokens} decode steps timed "
        f"after the first token, greedy, EOS ignored; 1 warm-up each, {args.rounds} rounds, first runtime alternating"
    )

    prompt = random_prompt(vocab, args.prompt_tokens, args.seed, "compare")

    engine = mlxcel_engine(ours, vocab, args.storage)

    def once(runtime: str, gen: int) -> Run:
        gc.collect()
        mx.clear_cache()
        if runtime == "mlxcel":
            return run_mlxcel(engine, prompt, gen)
        return run_mlx_lm(theirs, prompt, gen)

    for runtime in RUNTIMES:  # warm-up: the same prompt and length as a timed run
        once(runtime, args.gen_tokens)
    warm_replayed = engine.stats().graph_replayed or 0

    rounds = []
    for r in range(args.rounds):
        order = RUNTIMES if r % 2 == 0 else RUNTIMES[::-1]
        runs = {runtime: once(runtime, args.gen_tokens) for runtime in order}
        a, b = runs["mlxcel"], runs["mlx-lm"]
        row = {
            "round": r + 1,
            "first": order[0],
            "mlxcel": a,
            "mlx-lm": b,
            "decode_ratio": a.decode_tps / b.decode_tps,
            "prefill_ratio": a.prefill_tps / b.prefill_tps,
            "same_tokens": agreeing_prefix(a.tokens, b.tokens),
        }
        rounds.append(row)
        say(
            f"round {r + 1} ({order[0]} first): decode mlxcel {a.decode_tps:.2f} / mlx-lm {b.decode_tps:.2f} tok/s = "
            f"{row['decode_ratio']:.3f}x | prefill mlxcel {a.prefill_tps:.1f} / mlx-lm {b.prefill_tps:.1f} tok/s = "
            f"{row['prefill_ratio']:.3f}x (TTFT {a.ttft_s * 1000:.0f} / {b.ttft_s * 1000:.0f} ms) | "
            f"greedy tokens agree for {row['same_tokens']}/{len(a.tokens)}"
        )

    def median(key, runtime=None):
        return statistics.median(row[runtime].__dict__[key] if runtime else row[key] for row in rounds)

    summary = {
        "decode_ratio_median": median("decode_ratio"),
        "prefill_ratio_median": median("prefill_ratio"),
        **{f"{rt}_{k}_median": median(k, rt) for rt in RUNTIMES for k in ("decode_tps", "prefill_tps", "ttft_s")},
    }
    say(
        f"median decode: mlxcel {summary['mlxcel_decode_tps_median']:.2f}, mlx-lm "
        f"{summary['mlx-lm_decode_tps_median']:.2f} tok/s; "
        f"median ratio mlxcel/mlx-lm {summary['decode_ratio_median']:.3f}x"
    )
    say(
        f"median prefill: mlxcel {summary['mlxcel_prefill_tps_median']:.1f}, mlx-lm "
        f"{summary['mlx-lm_prefill_tps_median']:.1f} tok/s; "
        f"median ratio mlxcel/mlx-lm {summary['prefill_ratio_median']:.3f}x"
    )
    summary["graph"] = describe_graph(engine, warm_replayed, args.rounds * args.gen_tokens)
    say(f"mlxcel CUDA graph: {summary['graph']}")
    if args.json:

        def plain(run: Run) -> dict:
            return {k: v for k, v in asdict(run).items() if k != "tokens"}

        print(
            json.dumps(
                {
                    **env,
                    "mlx_lm_version": peer_version,
                    "model": description,
                    "mlx_lm_model": how,
                    "max_logit_diff": agreement.max_abs,
                    "relative_logit_diff": agreement.rel,
                    "prompt_tokens": args.prompt_tokens,
                    "gen_tokens": args.gen_tokens,
                    "rounds": [
                        {**row, "mlxcel": plain(row["mlxcel"]), "mlx-lm": plain(row["mlx-lm"])} for row in rounds
                    ],
                    **summary,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
