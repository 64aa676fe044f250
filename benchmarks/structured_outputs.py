"""Constrained (structured-output) decoding vs free decoding: decode tok/s at batch 1 and 8, and time to first token
with a 50-property JSON schema (issue 40's targets: >= 90% of free decode throughput, TTFT <= 110% of free).

    python benchmarks/structured_outputs.py                                         # the default model (SmolLM2 Q4_1)
    python benchmarks/structured_outputs.py --model-shape smollm2-135m --dtype float32  # random weights, same vocab

Every row is greedy with the same random prompt as its free twin. A constrained row's output is held to a JSON
schema of 50 required properties (strings, integers, booleans), which no row completes in the measured tokens, so
both kinds decode exactly --gen-tokens after their first token (EOS is no token of any engine here). A --model-shape
takes the tokenizer of --tokenizer-model (default: the default model), whose vocabulary must fit the shape's.

Decode tok/s = b * n / t, t running from the moment every row has its first token (read on the host) until n more
tokens per row have been read (bench_runs.run_requests' steady window). TTFT is measured at batch 1: "cold" with a
schema the engine has never seen (its grammar compiled in the request), "warm" with one it has. The tokenizer's
llguidance form is built before timing, as `mlxcel serve` does when its model loads. Free and constrained runs
alternate, each (kind, batch) after one warm-up run; medians over --reps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxcel_core.bench import (  # noqa: E402
    bench_header,
    environment,
    forget_cached_prefixes,
    load_bench_model,
    prefill_wait_steps,
    random_prompt,
    run_requests,
)
from mlxcel_core.constraints import Constraint  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.engine.constrained import prepare  # noqa: E402
from mlxcel_core.loading.shapes import shape_names  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402

KINDS = ("string", "integer", "boolean")


def wide_schema(properties: int, tag: str = "") -> Constraint:
    """`properties` required properties of mixed types; `tag` renames them (a schema no cache has seen)."""
    props = {f"field{tag}_{i}": {"type": KINDS[i % 3]} for i in range(properties)}
    return Constraint.json_schema(
        {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    )


def load(args):
    """(bench model, tokenizer without EOS ids): a checkpoint with its tokenizer, or a shape with another's."""
    from mlxcel_core.loading import load_model

    bench = load_bench_model(args.model, args.model_shape, args.bits, args.dtype)
    loaded = load_model(args.tokenizer_model if args.model_shape else args.model, log=lambda m: None)
    tokenizer = loaded.tokenizer
    if tokenizer.vocab_size > bench.vocab_size:
        raise SystemExit(f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {bench.vocab_size}")
    # No EOS: every row decodes exactly the tokens asked for (the grammar's llguidance form keeps its own EOS).
    prepare(tokenizer, bench.vocab_size).result()
    return bench, dataclasses.replace(tokenizer, eos_token_ids=set())


def decode_run(engine, prompts, gen: int, constraint: Constraint | None) -> tuple[float, float]:
    """(aggregate decode tok/s, mean TTFT ms) of one run."""
    forget_cached_prefixes(engine)
    params = SamplingParams(max_tokens=gen + 1 + prefill_wait_steps(engine.config, prompts), constraint=constraint)
    run = run_requests(engine, prompts, params.max_tokens, steady_tokens=gen, params=params)
    if run.window_tokens != len(prompts) * gen:
        raise RuntimeError(f"{run.window_tokens} tokens in the window, expected {len(prompts) * gen}")
    return run.window_tokens / (run.end - run.window_start), statistics.fmean(run.ttft) * 1000


def ttft_run(engine, prompt, constraint: Constraint | None) -> float:
    forget_cached_prefixes(engine)
    params = SamplingParams(max_tokens=2, constraint=constraint)
    return run_requests(engine, [prompt], 2, params=params).ttft[0] * 1000


def measure(args, bench, tokenizer) -> dict:
    schema = wide_schema(args.properties)
    results: dict[str, list[float]] = {}
    engines = {}
    for b in args.batches:
        engines[b] = Engine(bench.model, tokenizer, EngineConfig(max_batch_size=b))
        prompts = [random_prompt(bench.vocab_size, args.prompt_tokens, "structured", b, i) for i in range(b)]
        for constraint in (None, schema):  # warm-up
            decode_run(engines[b], prompts, min(args.gen_tokens, 8), constraint)
    prompt = random_prompt(bench.vocab_size, args.prompt_tokens, "structured-ttft")
    for rep in range(args.reps):
        for b in args.batches:
            prompts = [random_prompt(bench.vocab_size, args.prompt_tokens, "structured", b, i) for i in range(b)]
            for name, constraint in (("free", None), ("constrained", schema)):
                tps, _ = decode_run(engines[b], prompts, args.gen_tokens, constraint)
                results.setdefault(f"decode b={b} {name}", []).append(tps)
        one = engines[args.batches[0]]
        results.setdefault("ttft free", []).append(ttft_run(one, prompt, None))
        results.setdefault("ttft cold", []).append(ttft_run(one, prompt, wide_schema(args.properties, f"r{rep}")))
        results.setdefault("ttft warm", []).append(ttft_run(one, prompt, schema))
    return {key: statistics.median(values) for key, values in results.items()} | {"_raw": results}


def report(args, bench, medians: dict) -> None:
    print(bench_header(bench, environment()))
    print(f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} decoded, {args.properties}-property schema, ", end="")
    print(f"median of {args.reps}")
    print("| what | free | constrained | ratio |\n|---|---|---|---|")
    for b in args.batches:
        free, constrained = medians[f"decode b={b} free"], medians[f"decode b={b} constrained"]
        print(f"| decode tok/s, batch {b} | {free:.2f} | {constrained:.2f} | {constrained / free:.3f}x |")
    free = medians["ttft free"]
    for kind in ("cold", "warm"):
        value = medians[f"ttft {kind}"]
        print(f"| TTFT ms, batch 1, schema {kind} | {free:.1f} | {value:.1f} | {value / free:.3f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", help="checkpoint (default: the default model)")
    parser.add_argument("--model-shape", choices=shape_names(), help="random weights of this shape instead")
    parser.add_argument("--bits", type=int, choices=(4, 8))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tokenizer-model", help="with --model-shape: whose tokenizer (default: the default model)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--properties", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="also write the medians and raw values to this file")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    bench, tokenizer = load(args)
    medians = measure(args, bench, tokenizer)
    report(args, bench, medians)
    if args.json:
        Path(args.json).write_text(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
