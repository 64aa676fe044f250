"""Two engine measurements at batch 1 on a random-weight model shape (no mlx-lm; see compare_mlx_lm.py for that):

    python benchmarks/engine_ttft_fusion.py --model-shape llama-3-8b --bits 4
    python benchmarks/engine_ttft_fusion.py --model-shape llama-3.2-1b

1. TTFT of three 512-token requests in a row on ONE engine, dense then paged storage, twice (the first engine of
   each storage also pays the kernels' JIT compilation): tells a one-time cost of a new engine (allocating its
   KV pools, tracing compiled steps) from a cost every prefill pays.
2. Decode tok/s on paged storage (the engine's defaults otherwise), fused vs separate q/k/v and gate/up projections
   (kernels/fused_projections.py), alternated round by round on the same weights. Each round builds a new engine:
   a compiled decode step is traced once per engine and input shapes, and mx.compile does not see the Python-side
   switch, so on one engine both variants would replay the same trace (the first version of this script did).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from mlxcel_core.bench import RandomIdTokenizer, random_prompt  # noqa: E402
from mlxcel_core.engine import Engine, EngineConfig  # noqa: E402
from mlxcel_core.backends.cuda.kernels.fused_projections import fuse_projections, unfuse_projections  # noqa: E402
from mlxcel_core.models.shapes import build_random_model, shape_names  # noqa: E402
from mlxcel_core.sampling import SamplingParams  # noqa: E402


def request(engine: Engine, vocab: int, index: int, new_tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """(TTFT ms, decode tok/s after the first token) of one request run alone."""
    engine.open(random_prompt(vocab, prompt_tokens, 0, "engine", index), SamplingParams(max_tokens=new_tokens))
    t0, t1, produced = time.perf_counter(), None, 0
    while engine.has_work():
        for out in engine.step():
            if out.token is not None:
                produced += 1
                if produced == 1:
                    t1 = time.perf_counter()
    return (t1 - t0) * 1e3, (produced - 1) / max(time.perf_counter() - t1, 1e-9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=shape_names(), default="llama-3.2-1b")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    model, config = build_random_model(args.model_shape, bits=args.bits, dtype="bfloat16")
    vocab = config["vocab_size"]
    for storage in ("dense", "paged", "dense", "paged"):
        engine = Engine(model, RandomIdTokenizer(vocab), EngineConfig(max_batch_size=1, storage=storage))
        ttfts = [request(engine, vocab, i, 4, args.prompt_tokens)[0] for i in range(3)]
        print(f"{storage}: TTFT requests 1..3 on one engine: " + " ".join(f"{t:.1f}" for t in ttfts) + " ms",
              flush=True)
        del engine
        mx.clear_cache()
    results = {"fused": [], "separate": []}
    for r in range(args.rounds):
        for variant in ("fused", "separate") if r % 2 == 0 else ("separate", "fused"):
            (fuse_projections if variant == "fused" else unfuse_projections)(model)
            engine = Engine(model, RandomIdTokenizer(vocab), EngineConfig(max_batch_size=1, storage="paged"))
            request(engine, vocab, 1, 8, args.prompt_tokens)  # warm-up: traces this variant's step
            results[variant].append(request(engine, vocab, 1, args.gen_tokens + 1, args.prompt_tokens)[1])
            del engine
    for variant, rounds in results.items():
        print(f"{args.model_shape} bits={args.bits} paged b=1 {variant:9s} median {statistics.median(rounds):.1f} "
              f"tok/s (rounds " + " ".join(f"{x:.0f}" for x in rounds) + ")", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
