"""Where a batch-1 decode step's time goes: host graph building vs the device, op by op vs compiled.

    python benchmarks/decode_overhead.py --model-shape llama-3.2-1b --dtype bfloat16
    python benchmarks/decode_overhead.py --model-shape llama-3-8b --bits 4 --rounds 5

The model's own forward on dense KV caches (cache.KVCache), no engine, greedy argmax, EOS ignored, after a
--prompt-tokens prefill. Variants, alternated round by round (first one rotating):
  eager     the step's graph built op by op in Python (what mlx-lm's generate_step does)
  compiled  engine/compiled_decode.py's CompiledDecoder: one mx.compile'd call per step
  compiled-nomask  the same, attention over the whole buffer without its mask: WRONG tokens, timing only
            (what the mask costs: with an array mask MLX's CUDA attention leaves its fused decode kernel)
For each: tok/s with lookahead (step t+1 built and submitted before token t is read, as the engine does),
"build us" = host time to build one step's graph (Python + MLX graph construction; overlapped with the
device under lookahead), "sync us" = one step built, evaluated and read with nothing overlapped (host build
+ MLX dispatch + device time). If build us is close to 1e6 / tok/s, decode is bound by the host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import environment, random_prompt  # noqa: E402
from mlxcel_core.cache import make_cache  # noqa: E402
from mlxcel_core.engine.compiled_decode import CompiledDecoder, StepKV, StepTraces  # noqa: E402
from mlxcel_core.models.shapes import add_shape_arguments, build_random_model, describe_shape  # noqa: E402

VARIANTS = ("eager", "compiled", "compiled-nomask")


def prefill(model, prompt: list[int]):
    caches = make_cache(len(model.layers))
    token = mx.argmax(model(mx.array([prompt]), caches)[:, -1, :], axis=-1)
    mx.eval(token, [c.keys for c in caches], [c.values for c in caches])
    return token, caches


class UnmaskedStepKV(StepKV):
    def attend(self, queries, keys, values, scale, window=None, softcap=None):
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        return mx.fast.scaled_dot_product_attention(queries, self.keys, self.values, scale=scale)


class UnmaskedTraces(StepTraces):
    def _dense_forward(self, tokens, column, left_padding, keys, values):
        caches = [UnmaskedStepKV(k, v, column, left_padding) for k, v in zip(keys, values)]
        logits = self.model(tokens[:, None], caches)[:, -1, :]
        return logits, [c.keys for c in caches], [c.values for c in caches]


def UnmaskedDecoder(model) -> CompiledDecoder:  # noqa: N802 - reads as the class it was
    return CompiledDecoder(model, UnmaskedTraces(model))


def decode_fn(model, variant: str, decoders: dict):
    if variant.startswith("compiled"):
        return lambda tokens, caches: decoders[variant].decode(tokens, caches)
    return lambda tokens, caches: model(tokens[:, None], caches)[:, -1, :]


def run(model, decoder, variant: str, prompt: list[int], steps: int) -> dict:
    step = decode_fn(model, variant, decoder)
    token, caches = prefill(model, prompt)
    tokens, build = [], 0.0
    t0 = time.perf_counter()
    for _ in range(steps):  # lookahead: submit the next step, then read this one
        b = time.perf_counter()
        nxt = mx.argmax(step(token, caches), axis=-1)
        build += time.perf_counter() - b
        mx.async_eval(nxt)
        tokens.append(token.item())
        token = nxt
    tokens.append(token.item())
    elapsed = time.perf_counter() - t0
    sync = []
    for _ in range(16):  # unoverlapped steps
        b = time.perf_counter()
        token = mx.argmax(step(token, caches), axis=-1)
        token.item()
        sync.append(time.perf_counter() - b)
    return {"tps": steps / elapsed, "build_us": build / steps * 1e6, "sync_us": statistics.median(sync) * 1e6,
            "tokens": tokens}


def engine_run(model, vocab: int, storage: str, compiled: bool, prompts: list[list[int]], steps: int) -> dict:
    """The engine as generate/serve run it: aggregate decode tok/s after every row has its first token."""
    from mlxcel_core.bench import RandomIdTokenizer
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    engine = Engine(model, RandomIdTokenizer(vocab), EngineConfig(
        max_batch_size=len(prompts), storage=storage, compile_decode=compiled))
    ids = [engine.open(p, SamplingParams(max_tokens=steps + 1)) for p in prompts]
    started, t0, produced, tokens = set(), None, 0, {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            if out.token is None:
                continue
            tokens[out.seq_id].append(out.token)
            if t0 is not None:
                produced += 1
            started.add(out.seq_id)
        if t0 is None and len(started) == len(ids):
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - t0
    return {"tps": produced / elapsed, "tokens": tokens[ids[0]],
            "compiled_steps": engine.runner.compiled.steps if engine.runner.compiled else 0}


def engine_main(args, model, config) -> int:
    variants = [(st, c) for st in ("dense", "paged") for c in (False, True)]
    for batch in args.engine:
        prompts = [random_prompt(config["vocab_size"], args.prompt_tokens, 0, "engine", i) for i in range(batch)]
        for st, c in variants:  # warm-up
            engine_run(model, config["vocab_size"], st, c, prompts, 8)
        results = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants[r % 4:] + variants[:r % 4]:
                results[v].append(engine_run(model, config["vocab_size"], *v, prompts, args.gen_tokens))
        base = results[variants[0]][0]["tokens"]
        for v in variants:
            rows = results[v]
            same = next((i for i, (a, b) in enumerate(zip(rows[0]["tokens"], base)) if a != b), len(base))
            print(f"engine b={batch:<3d} {v[0]:5s} {'compiled' if v[1] else 'eager':8s} "
                  f"{statistics.median(x['tps'] for x in rows):8.1f} tok/s (rounds: "
                  f"{' '.join(format(x['tps'], '.0f') for x in rows)}) compiled steps "
                  f"{rows[0]['compiled_steps']}; row 0 greedy = dense eager for {same}/{len(base)}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--engine", type=lambda v: [int(b) for b in v.split(",")], metavar="B,B,...",
                        help="instead: the engine at these batch sizes, dense/paged x eager/compiled")
    args = parser.parse_args(argv)
    model, config = build_random_model(args.model_shape, bits=args.bits, dtype=args.dtype)
    if args.engine:
        return engine_main(args, model, config)
    decoder = {"compiled": CompiledDecoder(model), "compiled-nomask": UnmaskedDecoder(model)}
    env = environment()
    import os

    print(f"MLXCEL_QMV={os.environ.get('MLXCEL_QMV', 'unset')}; mlx {env['mlx_version']}, {env['backend']} ({env['device']}); {describe_shape(args.model_shape, args.bits, args.dtype)}; "
          f"prompt {args.prompt_tokens}, {args.gen_tokens} steps, {args.rounds} rounds", flush=True)
    prompt = random_prompt(config["vocab_size"], args.prompt_tokens, 0, "overhead")
    t = time.perf_counter()
    for variant in VARIANTS:  # warm-up (the compiled variant traces here)
        run(model, decoder, variant, prompt, 8)
    print(f"warm-up {time.perf_counter() - t:.1f} s", flush=True)
    results = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            res = run(model, decoder, variant, prompt, args.gen_tokens)
            results[variant].append(res)
            print(f"round {r + 1} {variant:9s} {res['tps']:8.1f} tok/s  build {res['build_us']:7.0f} us  "
                  f"sync {res['sync_us']:7.0f} us", flush=True)
    base = results["eager"][0]["tokens"]
    for variant in VARIANTS:
        rows = results[variant]
        same = next((i for i, (a, b) in enumerate(zip(rows[0]["tokens"], base)) if a != b), len(base))
        print(f"median {variant:9s} {statistics.median(r['tps'] for r in rows):8.1f} tok/s  "
              f"build {statistics.median(r['build_us'] for r in rows):7.0f} us  "
              f"sync {statistics.median(r['sync_us'] for r in rows):7.0f} us  greedy = eager for {same}/{len(base)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
