"""Greedy tokens of a random-weight model shape at --tp-size N, to compare with --tp-size 1 on the same weights.

    python benchmarks/tp_greedy.py --model-shape llama-3-8b --bits 4 --tp-size 2 -p 64 -n 32

Every rank draws the same weights from --seed (the shards together are exactly the single-process model), the
prompt is --seed's random ids, and the engine decodes greedily (no EOS: random ids). Rank 0 prints one JSON
line: the shape, tp size, token ids and timings. Without a launcher, --tp-size N starts N local ranks (NCCL
with one GPU each on CUDA, else the ring backend on 127.0.0.1), like `mlxcel bench --tp-size N`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", required=True)
    parser.add_argument("--bits", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=64)
    parser.add_argument("-n", "--gen-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from mlxcel_core.distributed import init_group, is_launched, run_local_ranks

    if args.tp_size > 1 and not is_launched():
        return run_local_ranks(args.tp_size, command=[sys.executable, __file__, *sys.argv[1:]])
    group = init_group(args.tp_size)

    import mlx.core as mx

    from mlxcel_core.bench import RandomIdTokenizer, load_bench_model, random_prompt
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    start = time.perf_counter()
    bench_model = load_bench_model(
        shape=args.model_shape, bits=args.bits, dtype=args.dtype, seed=args.seed, group=group
    )
    built_s = time.perf_counter() - start
    engine = Engine(bench_model.model, RandomIdTokenizer(bench_model.vocab_size), EngineConfig(max_batch_size=1))
    prompt = random_prompt(bench_model.vocab_size, args.prompt_tokens, args.seed, "tp-greedy")
    seq_id = engine.open(prompt, SamplingParams(max_tokens=args.gen_tokens))
    start = time.perf_counter()
    tokens = []
    while engine.has_work():
        tokens += [out.token for out in engine.step() if out.token is not None]
    seq = engine.sequence(seq_id)
    print(
        json.dumps(
            {
                "shape": args.model_shape,
                "bits": args.bits,
                "dtype": args.dtype,
                "tp_size": args.tp_size,
                "prompt_tokens": args.prompt_tokens,
                "tokens": tokens,
                "build_s": round(built_s, 2),
                "generate_s": round(time.perf_counter() - start, 3),
                "decode_tok_s": round((len(tokens) - 1) / seq.timings.decode_s, 2) if seq.timings.decode_s else None,
                "peak_memory_gib_rank0": round(mx.get_peak_memory() / 2**30, 2),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
